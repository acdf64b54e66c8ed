"""Duplex message endpoints shared by the client AND the engine: codec + tx + rx.

Middle layer: imports ring, shm, tensors, codec, messages, errors; never clients, asyncio
or the engine. An endpoint sends ``(record_type, object)`` pairs and receives them decoded.
Two transports with one interface:

* ``ShmChannel``: a request ring (frontend → engine) and an output ring (engine →
  frontend) plus one tensor arena per direction. Out-of-band tensor blocks are released by
  the receiver; the releases ride back on the opposite ring as ``REC_RELEASE`` records,
  flushed with every send and every receive call.
* ``ZmqChannel``: the baseline with vLLM's socket layout: ROUTER/DEALER for requests,
  PUSH/PULL for outputs, tensors as out-of-band frames.

Nothing here waits except ``recv`` / ``send`` with their timeouts; ``try_recv`` never
blocks. Waiting in an event loop is the caller's business (``fileno()``).

Isolation: a message that arrives intact but does not decode (a typed-decoder
``ValidationError``, malformed msgpack, nesting too deep, a tensor that cannot be opened)
fails alone: it is handed up as ``(rtype, BadMessage)`` in its place in the stream, and
whoever reads decides (the engine answers it with an error, the client logs it). Only a
broken channel (a record of unknown type, a release record that does not parse) raises
``ProtocolError``, which is fatal; the messages decoded before it in the same call are
returned first and the error is raised by the next call.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import msgspec
import zmq

from .codec import Decoder, Encoder
from .errors import ClientClosedError, PeerDeadError, PeerNotProducingError, ProtocolError, ShmCapacityError
from .messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    UtilityRequest,
)
from .ring import HEADER_BYTES as RING_HEADER_BYTES
from .ring import Ring, RingSpec
from .shm import Segment
from .tensors import ShmTensorReceiver, ShmTensorSender

REQ_ADD = EngineCoreRequestType.ADD.code
REQ_ABORT = EngineCoreRequestType.ABORT.code
REQ_UTILITY = EngineCoreRequestType.UTILITY.code
#: engine → frontend: one EngineCoreOutputs batch.
REC_OUTPUTS = 0x20
#: either way: tensor blocks the receiver is done with (payload from take_releases()).
REC_RELEASE = 0x10

_PAYLOAD_TYPES: dict[int, Any] = {
    REQ_ADD: EngineCoreRequest,
    REQ_ABORT: list[str],
    REQ_UTILITY: UtilityRequest,
    REC_OUTPUTS: EngineCoreOutputs,
}

Alive = Callable[[], bool]


class ShmChannelSpec(msgspec.Struct, frozen=True):
    """What the engine needs to attach: ring and arena names (engine's point of view)."""

    rx: RingSpec
    tx: RingSpec
    tensor_rx: str
    tensor_tx: str
    spin_us: float
    enable_cuda_ipc: bool = True


class ZmqChannelSpec(msgspec.Struct, frozen=True):
    input_address: str
    output_address: str


def _decoders(tensors: ShmTensorReceiver | None) -> dict[int, Decoder]:
    return {t: Decoder(typ, tensors=tensors) for t, typ in _PAYLOAD_TYPES.items()}


#: Wire position of each field, per record type whose payload is a struct.
_FIELD_POS: dict[int, dict[str, int]] = {
    t: {name: i for i, name in enumerate(typ.__struct_fields__)}
    for t, typ in _PAYLOAD_TYPES.items()
    if hasattr(typ, "__struct_fields__")
}


class BadMessage:
    """A message that arrived intact but could not be decoded; stands in its place.

    ``rtype``: its record type; ``error``: the decoder's message (msgspec's, e.g.
    ``Expected `str`, got `int` - at `$[0]```); ``raw``: what an untyped decode could
    still read (a list for a struct), or None. ``field(name)`` reads one field of the
    expected struct from ``raw`` (None when absent), so that the reader can still tell
    whose message it was (``request_id``, ``call_id``, ``client_index``).
    """

    __slots__ = ("rtype", "error", "raw")

    def __init__(self, rtype: int, error: str, raw: Any) -> None:
        self.rtype = rtype
        self.error = error
        self.raw = raw

    def field(self, name: str) -> Any:
        pos = _FIELD_POS.get(self.rtype, {}).get(name)
        raw = self.raw
        if pos is None or type(raw) is not list or pos >= len(raw):
            return None
        return raw[pos]

    def __repr__(self) -> str:
        return f"BadMessage(0x{self.rtype:02x}, {self.error!r})"


def _describe(e: BaseException) -> str:
    if isinstance(e, msgspec.ValidationError):
        return str(e)
    return f"{type(e).__name__}: {e}"


class ShmChannel:
    """One side of a shared-memory duplex channel."""

    def __init__(
        self,
        tx: Ring,
        rx: Ring,
        tensor_tx: Segment,
        tensor_rx: Segment,
        owned: list[Any],
        enable_cuda_ipc: bool = True,
    ) -> None:
        self.tx = tx
        self.rx = rx
        self._tx_segment = tensor_tx
        self._rx_segment = tensor_rx
        self._tensor_tx = ShmTensorSender(tensor_tx, enable_cuda_ipc=enable_cuda_ipc)
        self._tensor_rx = ShmTensorReceiver(tensor_rx)
        self._encoder = Encoder(tensors=self._tensor_tx)
        self._decoders = _decoders(self._tensor_rx)
        self._owned = owned  # things to unlink once the peer attached (owner side only)
        self._send_lock = threading.Lock()
        self._held_release: list[bytes] | None = None
        self._released = self._tensor_rx.pending  # tested for emptiness without a lock
        self._got: list[tuple[int, Any]] = []
        #: A fatal error met after some messages were decoded: raised by the next call.
        self._deferred: BaseException | None = None
        self._closed = False

    # -- construction -----------------------------------------------------------------
    @classmethod
    def create(
        cls,
        *,
        ring_capacity: int,
        arena_bytes: int,
        spin_us: float,
        wake_fd: bool,
        enable_cuda_ipc: bool = True,
    ) -> tuple["ShmChannel", ShmChannelSpec]:
        """Create both rings and both arenas (frontend side). Returns the channel and the
        spec the engine attaches with. Raises ShmCapacityError naming the bytes the whole
        channel needs when its memory cannot be reserved; on any failure everything
        created so far is removed again."""
        made: list[Any] = []
        try:
            req = Ring.create("producer", ring_capacity, spin_us=spin_us)
            made.append(req)
            out = Ring.create(
                "consumer", ring_capacity, spin_us=spin_us, consumer_wake_fd=wake_fd
            )
            made.append(out)
            arena_req = Segment.create(arena_bytes, prefix="shmc-t")
            made.append(arena_req)
            arena_out = Segment.create(arena_bytes, prefix="shmc-t")
            made.append(arena_out)
        except ShmCapacityError as e:
            for m in reversed(made):
                m.unlink()
                m.close()
            total = 2 * (ring_capacity + RING_HEADER_BYTES + arena_bytes)
            raise ShmCapacityError(
                f"a shared-memory channel needs {total} bytes ({total / (1 << 20):.0f} MiB: two rings "
                f"of {ring_capacity} bytes and two tensor arenas of {arena_bytes} bytes) and they "
                f"could not all be reserved: {e}"
            ) from e
        except BaseException:
            for m in reversed(made):
                m.unlink()
                m.close()
            raise
        spec = ShmChannelSpec(
            rx=req.spec,
            tx=out.spec,
            tensor_rx=arena_req.name,
            tensor_tx=arena_out.name,
            spin_us=spin_us,
            enable_cuda_ipc=enable_cuda_ipc,
        )
        return cls(req, out, arena_req, arena_out, made, enable_cuda_ipc), spec

    @classmethod
    def attach(cls, spec: ShmChannelSpec) -> "ShmChannel":
        """Attach to a channel created by the peer (engine side)."""
        rx = Ring.attach(spec.rx, "consumer", spin_us=spec.spin_us)
        try:
            tx = Ring.attach(spec.tx, "producer", spin_us=spec.spin_us)
            try:
                seg_rx = Segment.attach(spec.tensor_rx)
                try:
                    seg_tx = Segment.attach(spec.tensor_tx)
                except BaseException:
                    seg_rx.close()
                    raise
            except BaseException:
                tx.close()
                raise
        except BaseException:
            rx.close()
            raise
        return cls(tx, rx, seg_tx, seg_rx, [], spec.enable_cuda_ipc)

    def peer_attached(self) -> None:
        """Owner: the peer has attached; release the handles, so nothing else can attach."""
        for m in self._owned:
            m.unlink()

    def handle_fds(self) -> tuple[int, ...]:
        """Owner: the fds behind the handles in this channel's spec (segments, wake pipe),
        for a child to inherit (``subprocess.Popen(pass_fds=...)``)."""
        fds = []
        for m in self._owned:
            fds += m.handle_fds() if isinstance(m, Ring) else [m.fd]
        return tuple(fd for fd in fds if fd >= 0)

    def fits_whole(self, nbytes: int) -> bool:
        """Whether a message of ``nbytes`` goes as one record (not in fragments)."""
        return nbytes <= self.tx.max_record

    def set_peer_gpus(self, uuids: list[str]) -> None:
        """The GPUs the peer sees (from the handshake): CUDA tensors on other GPUs, or
        to a peer without CUDA, travel as host copies."""
        self._tensor_tx.set_peer_gpus(list(uuids))

    # -- sending ----------------------------------------------------------------------
    def encode(self, obj: Any) -> bytes:
        """The message's bytes (tensors placed out of band). Encode once, then
        ``send_encoded`` may be retried without placing the tensors again."""
        return self._encoder.encode(obj)

    def send(
        self, rtype: int, obj: Any, *, timeout: float | None = None, alive: Alive | None = None
    ) -> None:
        """Encode and send one message (pending tensor releases go ahead of it). Blocks
        only while the ring is full (backpressure), up to ``timeout``; raises
        PeerNotConsumingError / PeerDeadError / ClientClosedError."""
        self.send_encoded(rtype, self._encoder.encode(obj), timeout=timeout, alive=alive)

    def send_encoded(
        self,
        rtype: int,
        payload: bytes,
        *,
        timeout: float | None = None,
        alive: Alive | None = None,
    ) -> None:
        """Send bytes from ``encode``. When it raises, nothing of this message was sent
        (a message larger than the ring may have been sent in part; the receiver drops
        it). Pending tensor releases go first if the ring has room now; otherwise they
        wait for the next send or receive (never lost, never sent twice)."""
        with self._send_lock:
            if self._held_release is not None or self._released:
                self._flush_releases_locked()
            self.tx.send(rtype, payload, timeout=timeout, alive=alive)

    def _take_releases(self) -> list[bytes]:
        """Pending releases, oldest first: those held back before, then new ones.
        Caller holds the send lock."""
        held = self._held_release or []
        self._held_release = None
        rel = self._tensor_rx.take_releases()
        return held + [rel] if rel is not None else held

    def flush_releases(self) -> None:
        """Send pending tensor releases without blocking; if the ring is full, or another
        thread is sending (it may be waiting for room), they are kept and go out with the
        next message or flush (never lost)."""
        if self._held_release is None and not self._released:
            return  # the common case, without a lock
        if not self._send_lock.acquire(False):
            return  # a sender holds it (perhaps waiting on a full ring): it flushes them
        try:
            self._flush_releases_locked()
        finally:
            self._send_lock.release()

    def _flush_releases_locked(self) -> None:
        rels = self._take_releases()
        while rels and self.tx.try_send(REC_RELEASE, rels[0]):
            rels.pop(0)
        self._held_release = rels or None

    # -- receiving --------------------------------------------------------------------
    def _on_record(self, rtype: int, view: memoryview) -> None:
        """Decode one record straight from the ring (the view is valid during the call;
        the decoder copies what it keeps)."""
        dec = self._decoders.get(rtype)
        if dec is not None:
            try:
                obj = dec.decode(view)
            except Exception as e:  # this message alone is bad; the ring is intact
                obj = BadMessage(rtype, _describe(e), dec.salvage(view))
            self._got.append((rtype, obj))
        elif rtype == REC_RELEASE:
            try:
                self._tensor_tx.on_release(bytes(view))
            except Exception as e:
                raise ProtocolError(f"malformed tensor release record on the ring: {e}") from e
        else:
            raise ProtocolError(
                f"unknown record type 0x{rtype:02x} on the ring: the peer does not speak "
                "this protocol or the ring is corrupt"
            )

    def _take_got(self) -> list[tuple[int, Any]]:
        got = self._got
        self._got = []
        return got

    def _raise_deferred(self) -> None:
        e, self._deferred = self._deferred, None
        if e is not None:
            raise e

    def _got_then_raise(self, e: BaseException) -> list[tuple[int, Any]]:
        """Called with the exception in flight: hand out what was decoded before it and
        keep the exception for the next call; with nothing decoded, re-raise now."""
        if not self._got:
            raise e
        self._deferred = e
        return self._take_got()

    def try_recv(self) -> list[tuple[int, Any]]:
        """Every message available now, decoded, in order; [] if none. Never blocks.
        A message that does not decode comes as ``BadMessage``; ProtocolError when the
        ring is broken."""
        if self._deferred is not None:
            self._raise_deferred()
        self.flush_releases()
        try:
            self.rx.recv_into(self._on_record, timeout=0.0)
        except Exception as e:
            return self._got_then_raise(e)
        return self._take_got() if self._got else []

    def recv(self, *, timeout: float | None, alive: Alive | None = None) -> list[tuple[int, Any]]:
        """Spin, then block until at least one record arrives (may decode to [] when only
        releases came). Raises PeerNotProducingError on timeout, PeerDeadError,
        ProtocolError; messages decoded before an error are returned first."""
        if self._deferred is not None:
            self._raise_deferred()
        self.flush_releases()
        if timeout is not None and timeout <= 0:
            timeout = 1e-9  # recv_into reads 0 as "never wait"
        try:
            self.rx.recv_into(self._on_record, timeout=timeout, alive=alive)
        except Exception as e:
            return self._got_then_raise(e)
        return self._take_got()

    def fileno(self) -> int:
        """A file descriptor that becomes readable when something was published."""
        return self.rx.fileno()

    def drain_wake(self) -> None:
        self.rx.drain_wake_fd()

    @property
    def peer_closed(self) -> bool:
        return self.rx.peer_closed or self.tx.peer_closed

    def stats(self) -> dict[str, Any]:
        return {"tx": self.tx.stats(), "rx": self.rx.stats(), "tensors": self._tensor_tx.stats()}

    def close(self) -> None:
        """Tell the peer we are gone (wakes it if blocked), remove names, unmap."""
        if self._closed:
            return
        self._closed = True
        for m in self._owned:
            m.unlink()
        self.tx.close()
        self.rx.close()
        self._tensor_tx.close()
        self._tensor_rx.close()
        self._tx_segment.close()
        self._rx_segment.close()


def _data_socket_options(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)  # unbounded queues, as vLLM: sends never block
    sock.setsockopt(zmq.RCVHWM, 0)


class ZmqChannel:
    """One side of the ZMQ data path (the baseline transport).

    Frontend: ROUTER bound for requests (the engine's DEALER registers with one empty
    message), PULL bound for outputs. Engine: DEALER and PUSH connected. Each message is
    ``[type byte, msgpack frame, *tensor frames]``.
    """

    ENGINE_IDENTITY = b"\x00\x00"

    def __init__(self, tx: zmq.Socket, rx: zmq.Socket, frontend: bool) -> None:
        self._tx = tx
        self._rx = rx
        self._frontend = frontend
        self._encoder = Encoder()
        self._decoders = _decoders(None)
        self._send_lock = threading.Lock()
        self._poller = zmq.Poller()
        self._poller.register(rx, zmq.POLLIN)
        self._deferred: BaseException | None = None
        self._closed = False

    @classmethod
    def create(cls, ctx: zmq.Context, base: str) -> tuple["ZmqChannel", ZmqChannelSpec]:
        spec = ZmqChannelSpec(input_address=f"{base}-in", output_address=f"{base}-out")
        tx = ctx.socket(zmq.ROUTER)
        rx = ctx.socket(zmq.PULL)
        for s in (tx, rx):
            _data_socket_options(s)
        tx.setsockopt(zmq.ROUTER_MANDATORY, 1)
        tx.bind(spec.input_address)
        rx.bind(spec.output_address)
        return cls(tx, rx, frontend=True), spec

    @classmethod
    def attach(cls, ctx: zmq.Context, spec: ZmqChannelSpec) -> "ZmqChannel":
        rx = ctx.socket(zmq.DEALER)
        rx.setsockopt(zmq.IDENTITY, cls.ENGINE_IDENTITY)
        tx = ctx.socket(zmq.PUSH)
        for s in (tx, rx):
            _data_socket_options(s)
        rx.connect(spec.input_address)
        tx.connect(spec.output_address)
        rx.send(b"")  # registration: lets the ROUTER route to us
        return cls(tx, rx, frontend=False)

    def wait_registered(self, timeout: float) -> None:
        """Frontend: wait for the engine DEALER's registration message."""
        if not self._tx.poll(int(timeout * 1000), zmq.POLLIN):
            raise PeerNotProducingError("engine did not connect to the request socket")
        self._tx.recv_multipart()

    def peer_attached(self) -> None:  # nothing to unlink: abstract socket names
        pass

    def set_peer_gpus(self, uuids: list[str]) -> None:  # tensors travel as host frames
        pass

    def fits_whole(self, nbytes: int) -> bool:  # sends never block on zmq
        return True

    def encode(self, obj: Any) -> list:
        return self._encoder.encode_frames(obj)

    def send(
        self, rtype: int, obj: Any, *, timeout: float | None = None, alive: Alive | None = None
    ) -> None:
        self.send_encoded(rtype, self._encoder.encode_frames(obj))

    def send_encoded(
        self, rtype: int, frames: list, *, timeout: float | None = None, alive: Alive | None = None
    ) -> None:
        """Queue the frames; never blocks (no high-water mark, as vLLM's sockets)."""
        head = [self.ENGINE_IDENTITY] if self._frontend else []
        with self._send_lock:
            if self._closed:
                raise ClientClosedError("this zmq channel was closed")
            try:
                self._tx.send_multipart([*head, bytes((rtype,)), *frames], copy=False)
            except zmq.ZMQError as e:
                raise self._socket_error(e) from e

    def _socket_error(self, e: zmq.ZMQError) -> Exception:
        """A socket failure as the error a caller handles: our end closed, or the peer
        gone (``Host unreachable``: the engine's DEALER disconnected)."""
        if self._closed or e.errno in (zmq.ENOTSOCK, zmq.ETERM):
            return ClientClosedError("this zmq channel was closed")
        return PeerDeadError(f"the peer is not connected to the socket ({e})")

    def flush_releases(self) -> None:  # tensors travel as frames: nothing to release
        pass

    def _decode_msg(self, frames: list[zmq.Frame]) -> tuple[int, Any]:
        head = frames[0].bytes
        dec = self._decoders.get(head[0]) if len(head) == 1 and len(frames) > 1 else None
        if dec is None:
            raise ProtocolError(
                f"malformed message on the socket (type frame {head[:4]!r}, {len(frames)} "
                "frames): the peer does not speak this protocol"
            )
        rtype = head[0]
        bufs = [f.buffer for f in frames[1:]]
        try:
            return rtype, dec.decode_frames(bufs)
        except Exception as e:  # this message alone is bad
            return rtype, BadMessage(rtype, _describe(e), dec.salvage(bufs[0]))

    def try_recv(self) -> list[tuple[int, Any]]:
        """Every message available now, in order; [] if none. Never blocks. A message
        that does not decode comes as ``BadMessage``; ProtocolError for a malformed one
        (after the messages before it, which are returned first)."""
        if self._deferred is not None:
            e, self._deferred = self._deferred, None
            raise e
        out: list[tuple[int, Any]] = []
        while True:
            try:
                frames = self._rx.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return out
            except zmq.ZMQError as e:
                err = self._socket_error(e)
                if out:
                    self._deferred = err
                    return out
                raise err from e
            if len(frames) == 1 and len(frames[0]) == 0:
                continue  # stray registration echo
            try:
                out.append(self._decode_msg(frames))
            except ProtocolError as e:
                if out:
                    self._deferred = e
                    return out
                raise

    def recv(self, *, timeout: float | None, alive: Alive | None = None) -> list[tuple[int, Any]]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            got = self.try_recv()
            if got:
                return got
            if alive is not None and not alive():
                raise PeerDeadError("peer is gone")
            slice_s = 0.1
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PeerNotProducingError(
                        f"nothing arrived within {timeout} s: the peer is not producing"
                    )
                slice_s = min(slice_s, left)
            try:
                self._poller.poll(int(slice_s * 1000) + 1)
            except zmq.ZMQError as e:
                raise self._socket_error(e) from e

    def fileno(self) -> int:
        return self._rx.getsockopt(zmq.FD)

    def drain_wake(self) -> None:
        # ZMQ_FD is edge-triggered; reading ZMQ_EVENTS re-arms it.
        self._rx.getsockopt(zmq.EVENTS)

    @property
    def peer_closed(self) -> bool:
        return False

    def stats(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._tx.close(linger=0)
        self._rx.close(linger=0)
