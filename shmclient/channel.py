"""The sans-IO duplex endpoint shared by the client AND the engine: codec + tx + rx.

Middle layer: imports ring, shm, tensors, codec, messages, errors; never clients, asyncio,
``waiting`` or the engine. An endpoint sends ``(record_type, payload)`` pairs and receives
them decoded. ``ShmChannel`` is a request ring (frontend → engine) and an output ring
(engine → frontend) plus one tensor arena per direction; ``channel_zmq.ZmqChannel`` has
the same interface over vLLM's socket layout (the baseline transport).

Nothing here blocks. ``send_nowait`` / ``recv_nowait`` go ahead or raise ``WouldBlock``;
the wait handle (``wait_send`` / ``wait_recv`` for a thread, ``send_fd`` / ``recv_fd``
with ``arm_send`` / ``arm_recv`` for an event loop) is what ``shmclient.waiting``, the
one module that blocks, waits on. Out-of-band tensor blocks are released by the receiver;
the releases ride back on the opposite ring as ``REC_RELEASE`` records, sent ahead of the
next message and with every receive call (never in the middle of a fragmented message).

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
from typing import Any, Callable, Mapping, Protocol

import msgspec

from .codec import Decoder, Encoder
from .errors import ProtocolError, ShmCapacityError, WouldBlock
from .messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    UtilityRequest,
)
from .ring import HEADER_BYTES as RING_HEADER_BYTES
from .ring import Ring, RingSpec
from .ring_consumer import RingConsumer
from .ring_producer import RingProducer
from .shm import Segment, close_inherited
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


class ShmChannelSpec(msgspec.Struct, frozen=True):
    """What the engine needs to attach: ring and arena names (engine's point of view)."""

    rx: RingSpec
    tx: RingSpec
    tensor_rx: str
    tensor_tx: str
    spin_us: float
    enable_cuda_ipc: bool = True


def _decoders(tensors: ShmTensorReceiver | None) -> dict[int, Decoder]:
    return {t: Decoder(typ, tensors=tensors) for t, typ in _PAYLOAD_TYPES.items()}


class Framing(Protocol):
    """How a channel's messages become ring records and back: a parameter of
    ``ShmChannel``, built from the channel's tensor sender and receiver (so that
    tensors can travel out of band). ``encode(obj)`` gives one record's payload;
    ``decoders`` maps each record type a peer may send to an object whose
    ``decode(view)`` returns the message (the view is valid only during the call) and
    whose ``salvage(view)`` returns what an untyped read still sees (for ``BadMessage``);
    ``fields`` gives, per record type, the wire position of each field a reader may
    want from a message that did not decode."""

    decoders: Mapping[int, Any]
    fields: Mapping[int, Mapping[str, int]]

    def encode(self, obj: Any) -> Any: ...


class NativeFraming:
    """shmclient's own protocol: one record per message, the record type naming its
    struct (``REQ_*``, ``REC_OUTPUTS``), encoded by ``codec`` with tensors out of band."""

    def __init__(self, tensor_tx: ShmTensorSender | None, tensor_rx: ShmTensorReceiver | None) -> None:
        self.encode = Encoder(tensors=tensor_tx).encode
        self.decoders = _decoders(tensor_rx)
        self.fields = _FIELD_POS


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

    __slots__ = ("rtype", "error", "raw", "fields")

    def __init__(self, rtype: int, error: str, raw: Any,
                 fields: Mapping[int, Mapping[str, int]] | None = None) -> None:
        self.rtype = rtype
        self.error = error
        self.raw = raw
        self.fields = _FIELD_POS if fields is None else fields

    def field(self, name: str) -> Any:
        pos = self.fields.get(self.rtype, {}).get(name)
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


#: Builds a channel's framing from its tensor sender and receiver.
FramingFactory = Callable[[ShmTensorSender, ShmTensorReceiver], Framing]


class ShmChannel:
    """One side of a shared-memory duplex channel. ``framing``: how messages become
    records (``NativeFraming``: shmclient's protocol; the vLLM plug-in passes vLLM's)."""

    def __init__(
        self,
        tx: Ring,
        rx: Ring,
        tensor_tx: Segment,
        tensor_rx: Segment,
        owned: list[Any],
        enable_cuda_ipc: bool = True,
        framing: FramingFactory = NativeFraming,
    ) -> None:
        self.tx = tx
        self.rx = rx
        self._tx_segment = tensor_tx
        self._rx_segment = tensor_rx
        self._tensor_tx = ShmTensorSender(tensor_tx, enable_cuda_ipc=enable_cuda_ipc)
        self._tensor_rx = ShmTensorReceiver(tensor_rx, enable_cuda_ipc=enable_cuda_ipc)
        self.framing = framing(self._tensor_tx, self._tensor_rx)
        self._decoders = self.framing.decoders
        self._fields = self.framing.fields
        self._owned = owned  # things to unlink once the peer attached (owner side only)
        #: Held only around a non-blocking send (never while waiting).
        self._send_lock = threading.Lock()
        #: The payload of a fragmented message half-way through tx whose sender still
        #: waits to finish it (others wait for it), or None.
        self._partial: Any = None
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
        framing: FramingFactory = NativeFraming,
    ) -> tuple["ShmChannel", ShmChannelSpec]:
        """Create both rings and both arenas (frontend side). Returns the channel and the
        spec the engine attaches with. ``wake_fd``: also make the pipes an event loop
        waits on (``recv_fd`` for outputs, ``send_fd`` for room in the request ring). Raises ShmCapacityError naming the bytes the whole
        channel needs when its memory cannot be reserved; on any failure everything
        created so far is removed again."""
        made: list[Any] = []
        try:
            req = RingProducer.create(ring_capacity, spin_us=spin_us, producer_wake_fd=wake_fd)
            made.append(req)
            out = RingConsumer.create(ring_capacity, spin_us=spin_us, consumer_wake_fd=wake_fd)
            made.append(out)
            # Arenas are sized now and reserved by their sender on its first tensor, so a
            # client that never sends one never holds their memory. No arena (0 bytes):
            # a 1-byte segment holds no block, so every tensor goes as a one-off segment.
            size = max(arena_bytes, 1)
            arena_req = Segment.create(size, prefix="shmc-t", reserve=False)
            made.append(arena_req)
            arena_out = Segment.create(size, prefix="shmc-t", reserve=False)
            made.append(arena_out)
        except ShmCapacityError as e:
            for m in reversed(made):
                m.unlink()
                m.close()
            total = 2 * (ring_capacity + RING_HEADER_BYTES)
            raise ShmCapacityError(
                f"a shared-memory channel needs {total} bytes ({total / (1 << 20):.0f} MiB: two rings "
                f"of {ring_capacity} bytes; its two tensor arenas of {arena_bytes} bytes are "
                f"reserved later, on their first tensor) and they could not be reserved: {e}"
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
        try:
            return cls(req, out, arena_req, arena_out, made, enable_cuda_ipc, framing), spec
        except BaseException:
            for m in reversed(made):
                m.unlink()
                m.close()
            raise

    @classmethod
    def attach(cls, spec: ShmChannelSpec, framing: FramingFactory = NativeFraming) -> "ShmChannel":
        """Attach to a channel created by the peer (engine side)."""
        rx = RingConsumer.attach(spec.rx, spin_us=spec.spin_us)
        try:
            tx = RingProducer.attach(spec.tx, spin_us=spec.spin_us)
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
        # Everything is mapped (and the pipes reopened): the fds inherited for the
        # handles are not needed any more.
        close_inherited([spec.rx.segment, spec.rx.wake_pipe, spec.rx.space_pipe,
                         spec.tx.segment, spec.tx.wake_pipe, spec.tx.space_pipe,
                         spec.tensor_rx, spec.tensor_tx])
        try:
            return cls(tx, rx, seg_tx, seg_rx, [], spec.enable_cuda_ipc, framing)
        except BaseException:
            for m in (tx, rx, seg_tx, seg_rx):
                m.close()
            raise

    #: The peer registers by connecting: a ZMQ channel's capability only.
    wait_registered = None
    #: Everything the peer wrote before it died is in the ring already.
    late_after_peer_death = False

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

    def set_peer_pid(self, pid: int) -> None:
        """The peer's pid: from then on a one-off tensor handle must name one of its
        segments (a handle naming another process's file is refused)."""
        self._tensor_rx.peer_pid = pid
        if self._tensor_rx._cuda is not None:
            self._tensor_rx._cuda.peer_pid = pid

    def set_peer_gpus(self, uuids: list[str]) -> None:
        """The GPUs the peer sees (from the handshake): CUDA tensors on other GPUs, or
        to a peer without CUDA, travel as host copies."""
        self._tensor_tx.set_peer_gpus(list(uuids))

    # -- sending ----------------------------------------------------------------------
    def encode(self, obj: Any) -> bytes:
        """The message's bytes (tensors placed out of band). Encode once, then
        ``send_encoded`` may be retried without placing the tensors again."""
        return self.framing.encode(obj)

    def send_nowait(self, rtype: int, payload: bytes) -> None:
        """Send bytes from ``encode`` now, or raise WouldBlock: nothing of this message
        was sent, or (a message longer than one record) the fragments that fit were;
        sending the same payload again resumes after them. Pending tensor releases go
        first when there is room (else they wait for the next call: never lost, never
        sent twice). Raises PeerDeadError (the engine closed its end), ClientClosedError,
        ValueError (over 4 GiB). Never blocks (other threads' sends hold the lock only
        for their own non-blocking call)."""
        with self._send_lock:
            tx = self.tx
            if tx.partial_pending:
                if self._partial is not None and self._partial is not payload:
                    # another sender's fragmented message is half-way: it goes first
                    raise WouldBlock("another message is half-way through the ring")
            elif self._held_release is not None or self._released:
                self._flush_releases_locked()
            try:
                tx.send_nowait(rtype, payload)
            except WouldBlock:
                self._partial = payload if tx.partial_pending else None
                raise
            self._partial = None

    def abandon(self, payload: Any) -> None:
        """A send of ``payload`` gave up: if it is half-way through the ring, other
        messages may now go first (the engine then drops the partial message); sending
        the same payload again before that still resumes it."""
        with self._send_lock:
            if self._partial is payload:
                self._partial = None

    # -- the wait handle (see shmclient.waiting) ----------------------------------------
    def wait_send(self, timeout: float, *, spin: float | None = None, first: bool = True) -> bool:
        """Block this thread, once, until the request ring may have room (True) or
        ``timeout`` seconds passed (False)."""
        return self.tx.wait_writable(timeout, spin=spin, first=first)

    def wait_recv(self, timeout: float, *, spin: float | None = None, first: bool = True) -> bool:
        """Block this thread, once, until a record may be there (True) or ``timeout``
        seconds passed (False): spin (``spin``, None: adaptive), then the futex."""
        return self.rx.wait_readable(timeout, spin=spin, first=first)

    def send_fd(self) -> int:
        """Readable when the engine released room after ``arm_send()`` (needs
        ``wake_fd=True`` at creation)."""
        return self.tx.space_fileno()

    def arm_send(self) -> None:
        """Ask for a byte on ``send_fd()`` at the engine's next release; then try again."""
        self.tx.arm_space()

    def readable(self) -> bool:
        """Whether a record is waiting to be read (a plain look; never blocks)."""
        return self.rx.has_data()

    def wake_peer(self) -> None:
        """Make the peer's ``recv_fd()`` readable now (an early wake-up ahead of a
        publish); a no-op when the peer has no wake pipe. Never blocks."""
        self.tx.poke()

    def recv_fd(self) -> int:
        """Readable whenever a published record has not been read (``wake_fd=True``)."""
        return self.rx.fileno()

    def arm_recv(self) -> None:
        """Drain ``recv_fd()``; it turns readable again at once if a record is unread."""
        self.rx.drain_wake_fd()

    def _take_releases(self) -> list[bytes]:
        """Pending releases, oldest first: those held back before, then new ones.
        Caller holds the send lock."""
        held = self._held_release or []
        self._held_release = None
        rel = self._tensor_rx.take_releases()
        return held + [rel] if rel is not None else held

    def flush_releases(self) -> None:
        """Send pending tensor releases without blocking; if the ring is full, a
        fragmented message is half-way, or another thread is sending, they are kept and
        go out with the next message or flush (never lost)."""
        if self._held_release is None and not self._released:
            return  # the common case, without a lock
        if self.tx.partial_pending or not self._send_lock.acquire(False):
            return
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
                obj = BadMessage(rtype, _describe(e), dec.salvage(view), self._fields)
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

    def recv_nowait(self, limit: int = 0) -> list[tuple[int, Any]]:
        """Every message available now (at most ``limit`` if > 0; the rest stay for the
        next call), decoded, in order (at least one), or WouldBlock.
        A message that does not decode comes as ``BadMessage``; ProtocolError when the
        ring is broken (after the messages before it, returned first); PeerDeadError once
        the engine closed its end and everything it sent was read. Never blocks."""
        if self._deferred is not None:
            self._raise_deferred()
        self.flush_releases()
        try:
            self.rx.recv_into(self._on_record, limit)
        except WouldBlock:  # another thread of ours is reading this ring right now
            raise WouldBlock("another thread is reading this channel") from None
        except Exception as e:
            return self._got_then_raise(e)
        if not self._got:
            raise WouldBlock("nothing to receive")
        return self._take_got()

    def try_recv(self, limit: int = 0) -> list[tuple[int, Any]]:
        """``recv_nowait`` with [] instead of WouldBlock."""
        try:
            return self.recv_nowait(limit)
        except WouldBlock:
            return []

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
