"""``ZmqChannel``: the channel interface over vLLM's socket layout (the baseline transport).

Middle layer, beside ``channel``: imports pyzmq, ``codec``, ``framing`` (the record
types, decoders and ``BadMessage`` it shares with ``channel``), ``stats`` and
``errors``; never the ring, ``shm``, clients, asyncio, ``waiting`` or the engine. Frontend: ROUTER bound for requests (the engine's DEALER registers with one
empty message), PULL bound for outputs; engine: DEALER and PUSH connected. Each message
is ``[type byte, msgpack frame, *tensor frames]``; tensors travel as frames. The
frontend binds on abstract unix sockets (same host) or on tcp (``create(..., host=)``, an
engine on another host; free ports, announced in the spec). As vLLM's
sockets, nothing has a high-water mark: ``send_nowait`` always goes ahead (never
WouldBlock), ``recv_nowait`` raises WouldBlock when nothing is queued. The wait handle:
``wait_recv`` polls the socket, ``recv_fd`` is the socket's ZMQ_FD (edge-triggered:
``arm_recv`` reads ZMQ_EVENTS, which re-arms it). Nothing here blocks.
"""

from __future__ import annotations

import secrets
import threading
import time
from typing import Any

import msgspec
import zmq

from .codec import Encoder
from .errors import ClientClosedError, PeerDeadError, PeerNotProducingError, ProtocolError, WouldBlock
from .framing import BadMessage, decoders, describe
from .stats import ChannelStatistics


class ZmqChannelSpec(msgspec.Struct, frozen=True):
    """The two socket addresses the engine connects to, and the engine's identity on
    the request socket: random for each channel and known only to whoever was sent the
    spec (a remote engine: once it proved the secret), so the requests go to that
    engine, never to another process that connected to the port first."""

    input_address: str
    output_address: str
    identity: bytes


#: The largest frame the request socket takes from a peer (the registration is empty).
_REGISTRATION_MAX_BYTES = 64


def _data_socket_options(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)  # unbounded queues, as vLLM: sends never block
    sock.setsockopt(zmq.RCVHWM, 0)


class ZmqChannel:
    """One side of the ZMQ data path (see the module docstring)."""

    # Capabilities a ZMQ channel does not have (``waiting.ChannelCapabilities``): nothing
    # to unlink (abstract socket names), no handle fds to pass, tensors travel as frames
    # (no peer GPUs, no peer pid to check one-off handles against, no releases).
    handle_fds = None
    #: What the peer sent just before it died may still be on its way (the sockets' IO
    #: threads): whoever reads what a dead engine left waits a short grace for it.
    late_after_peer_death = True
    #: ZMQ_FD is edge-triggered: a reader arms it (reads ZMQ_EVENTS) before it reads.
    arm_after_read = False
    peer_attached = None
    set_peer_pid = None
    set_peer_gpus = None
    flush_releases = None

    def __init__(self, tx: zmq.Socket, rx: zmq.Socket, frontend: bool, identity: bytes) -> None:
        self._tx = tx
        self._identity = identity
        self._rx = rx
        self._frontend = frontend
        self._encoder = Encoder()
        self._decoders = decoders(None)
        self._send_lock = threading.Lock()  # held only around one non-blocking send
        self._poller = zmq.Poller()
        self._poller.register(rx, zmq.POLLIN)
        self._deferred: BaseException | None = None
        self._closed = False

    @classmethod
    def create(cls, ctx: zmq.Context, base: str | None = None, *,
               host: str | None = None) -> tuple["ZmqChannel", ZmqChannelSpec]:
        """Frontend: bind the two sockets, on ``<base>-in`` / ``<base>-out`` (ipc), or on
        free tcp ports of ``host`` (one of the two must be given). Returns the channel
        and the spec the engine attaches with (the bound addresses). Raises
        ``zmq.ZMQError`` when an address cannot be bound. Never blocks."""
        if (base is None) == (host is None):
            raise ValueError("ZmqChannel.create takes an ipc base or a tcp host, not both")
        tx = ctx.socket(zmq.ROUTER)
        rx = ctx.socket(zmq.PULL)
        try:
            for s in (tx, rx):
                _data_socket_options(s)
            tx.setsockopt(zmq.ROUTER_MANDATORY, 1)
            # Nothing but the engine's empty registration ever comes in on the request
            # socket, and it is read only until then: anything larger drops the peer
            # that sent it, and a peer's queue holds a few messages, so that whoever
            # reaches the port cannot fill this process's memory.
            tx.setsockopt(zmq.MAXMSGSIZE, _REGISTRATION_MAX_BYTES)
            tx.setsockopt(zmq.RCVHWM, 4)
            if host is not None:
                tx.bind(f"tcp://{host}:0")
                rx.bind(f"tcp://{host}:0")
            else:
                tx.bind(f"{base}-in")
                rx.bind(f"{base}-out")
            spec = ZmqChannelSpec(
                input_address=tx.getsockopt_string(zmq.LAST_ENDPOINT),
                output_address=rx.getsockopt_string(zmq.LAST_ENDPOINT),
                identity=b"E" + secrets.token_bytes(16))  # (ZMQ reserves a leading 0)
        except BaseException:
            tx.close(linger=0)
            rx.close(linger=0)
            raise
        return cls(tx, rx, frontend=True, identity=spec.identity), spec

    @classmethod
    def attach(cls, ctx: zmq.Context, spec: ZmqChannelSpec) -> "ZmqChannel":
        rx = ctx.socket(zmq.DEALER)
        rx.setsockopt(zmq.IDENTITY, spec.identity)
        tx = ctx.socket(zmq.PUSH)
        for s in (tx, rx):
            _data_socket_options(s)
        rx.connect(spec.input_address)
        tx.connect(spec.output_address)
        rx.send(b"")  # registration: lets the ROUTER route to us
        return cls(tx, rx, frontend=False, identity=spec.identity)

    def wait_registered(self, timeout: float) -> None:
        """Frontend: wait for the engine DEALER's registration message (one from
        another identity is dropped)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._tx.poll(max(1, int(left * 1000)), zmq.POLLIN):
                raise PeerNotProducingError("engine did not connect to the request socket")
            frames = self._tx.recv_multipart()
            if frames[0] == self._identity:
                return

    def fits_whole(self, nbytes: int) -> bool:  # sends never block on zmq
        return True

    def encode(self, obj: Any) -> list:
        return self._encoder.encode_frames(obj)

    def send_nowait(self, rtype: int, frames: list) -> None:
        """Queue the frames from ``encode``; always goes ahead (no high-water mark, as
        vLLM's sockets). Raises PeerDeadError (the engine's socket is gone),
        ClientClosedError. Never blocks."""
        head = [self._identity] if self._frontend else []
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
            return rtype, BadMessage(rtype, describe(e), dec.salvage(bufs[0]))

    def recv_nowait(self, limit: int = 0) -> list[tuple[int, Any]]:
        """Every message queued now (at most ``limit`` if > 0), decoded, in order (at
        least one), or WouldBlock. A
        message that does not decode comes as ``BadMessage``; ProtocolError for a
        malformed one (after the messages before it, which are returned first). Never
        blocks."""
        if self._deferred is not None:
            e, self._deferred = self._deferred, None
            raise e
        out: list[tuple[int, Any]] = []
        while True:
            try:
                frames = self._rx.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                if not out:
                    raise WouldBlock("nothing to receive") from None
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
            if limit and len(out) >= limit:
                return out

    def try_recv(self, limit: int = 0) -> list[tuple[int, Any]]:
        """``recv_nowait`` with [] instead of WouldBlock."""
        try:
            return self.recv_nowait(limit)
        except WouldBlock:
            return []

    # -- the wait handle (see shmclient.waiting) ----------------------------------------
    def wait_recv(self, timeout: float, *, spin: float | None = None, first: bool = True) -> bool:
        """Block this thread, once, until a message is queued (True) or ``timeout``
        seconds passed (False). Sockets are not spun on: ``spin`` is ignored."""
        try:
            return bool(self._poller.poll(max(0, int(timeout * 1000 + 0.999))))
        except zmq.ZMQError as e:
            raise self._socket_error(e) from e

    def wait_send(self, timeout: float, *, spin: float | None = None, first: bool = True) -> bool:
        """Sends never wait here: always True."""
        return True

    def recv_fd(self) -> int:
        """The socket's ZMQ_FD: readable when ``arm_recv()`` must be called again."""
        return self._rx.getsockopt(zmq.FD)

    def arm_recv(self) -> None:
        """Read ZMQ_EVENTS, which re-arms the edge-triggered ZMQ_FD."""
        self._rx.getsockopt(zmq.EVENTS)

    def send_fd(self) -> int:
        """Sends never wait here (no high-water mark): there is no send descriptor."""
        raise ProtocolError("a zmq channel never waits for room: send_nowait always goes ahead")

    def arm_send(self) -> None:
        """Sends never wait here."""

    def abandon(self, payload: Any) -> None:
        """Sends never go in part here: nothing to do."""

    def discard(self, rtype: int, payload: Any) -> None:
        """Nothing travels out of band here: nothing to free."""

    @property
    def peer_closed(self) -> bool:
        return False

    def statistics(self) -> ChannelStatistics:
        """Nothing to count here: no rings, no arena (every field None)."""
        return ChannelStatistics()

    def close(self) -> None:
        """Close both sockets. A send under way in another thread ends first (a zmq
        socket is not thread-safe: closing it under a send is undefined behaviour)."""
        with self._send_lock:
            if self._closed:
                return
            self._closed = True
            self._tx.close(linger=0)
        self._rx.close(linger=0)
