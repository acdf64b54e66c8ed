"""The sans-IO duplex endpoint shared by the client AND the engine: codec + tx + rx.

Middle layer: imports ``framing`` (record types, ``NativeFraming``, ``BadMessage``),
``channel_spec`` (``ShmChannelSpec``, the rings and arenas made or attached; both
re-exported here), ``ring`` (and the process's spin gate, re-exported here as
``SPIN_GATE``), ``shm``, ``tensors``, ``stats`` and ``errors``; never
clients, asyncio, ``waiting`` or the engine. An endpoint sends ``(record_type,
payload)`` pairs and receives them decoded (a message that does not decode comes as a
``BadMessage`` in its place, see ``framing``; a broken channel raises
``ProtocolError``). ``ShmChannel`` is a request ring (frontend → engine) and an output
ring (engine → frontend) plus one tensor arena per direction; ``channel_zmq.ZmqChannel``
has the same interface over vLLM's socket layout (the baseline transport). Nothing here
blocks. Its contract (the wait handle, tensor releases): docs/design.md, "Module notes",
``shmclient.channel``.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from .channel_spec import ShmChannelSpec, attach_parts, create_parts
from .errors import EndBusy, PeerDeadError, ProtocolError, WouldBlock
from .framing import (  # noqa: F401 - the record types and BadMessage, re-exported from here
    REC_OUTPUTS,
    REC_RELEASE,
    REQ_ABORT,
    REQ_ADD,
    REQ_UTILITY,
    BadMessage,
    Framing,
    FramingFactory,
    NativeFraming,
    describe,
)
from .ring import Ring, gate as SPIN_GATE
from .shm import Segment
from .stats import ChannelStatistics
from .tensors import ShmTensorReceiver, ShmTensorSender

log = logging.getLogger("shmclient")

__all__ = [
    "REC_OUTPUTS", "REC_RELEASE", "REQ_ABORT", "REQ_ADD", "REQ_UTILITY", "BadMessage",
    "ChannelStatistics", "Framing", "FramingFactory", "NativeFraming", "SPIN_GATE", "ShmChannel",
    "ShmChannelSpec",
]


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
        #: the thread whose message is half-way; the others wait for it to end
        #: (``wait_send``), not for room, which would not help them
        self._partial_owner = 0
        self._partial_done = threading.Condition(self._send_lock)
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
        waits on (``recv_fd`` for outputs, ``send_fd`` for room in the request ring).
        Raises ShmCapacityError naming the bytes the whole channel needs when its memory
        cannot be reserved; on any failure everything created so far is removed again
        (see ``channel_spec.create_parts``)."""
        parts, spec = create_parts(ring_capacity=ring_capacity, arena_bytes=arena_bytes, spin_us=spin_us,
                                   wake_fd=wake_fd, enable_cuda_ipc=enable_cuda_ipc)
        try:
            return cls(*parts, enable_cuda_ipc, framing), spec
        except BaseException:
            for m in reversed(parts.owned):
                m.unlink()
                m.close()
            raise

    @classmethod
    def attach(cls, spec: ShmChannelSpec, framing: FramingFactory = NativeFraming) -> "ShmChannel":
        """Attach to a channel created by the peer (engine side)."""
        parts = attach_parts(spec)
        try:
            return cls(*parts, spec.enable_cuda_ipc, framing)
        except BaseException:
            for m in (parts.tx, parts.rx, parts.tensor_tx, parts.tensor_rx):
                m.close()
            raise

    #: The peer registers by connecting: a ZMQ channel's capability only.
    wait_registered = None
    #: Everything the peer wrote before it died is in the ring already.
    late_after_peer_death = False
    #: A reader re-arms the wake pipe after reading (``waiting.protocols``).
    arm_after_read = True

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

    def send_nowait(self, rtype: int, payload: bytes, *, wake: bool = True) -> None:
        """Send bytes from ``encode`` now, or raise WouldBlock: nothing of this message
        was sent, or (a message longer than one record) the fragments that fit were;
        sending the same payload again resumes after them. Pending tensor releases go
        first when there is room (else they wait for the next call: never lost, never
        sent twice). Raises PeerDeadError (the engine closed its end), ClientClosedError,
        ValueError (over 4 GiB). Never blocks (other threads' sends hold the lock only
        for their own non-blocking call).

        ``wake=False``: what is published does not wake a sleeping peer; the wake-up is
        owed until ``wake_owed()``, which the caller must call (a later send with
        ``wake=True`` gives it too)."""
        with self._send_lock:
            if wake:
                self._send_locked(rtype, payload)
                return
            tx = self.tx
            tx.quiet = True
            try:
                self._send_locked(rtype, payload)
            finally:
                tx.quiet = False

    def wake_owed(self) -> bool:
        """Wake the peer if sends with ``wake=False`` held its wake-up back; whether one
        was owed. Never blocks."""
        return self.tx.wake_owed()

    def _send_locked(self, rtype: int, payload: bytes) -> None:
        """send_nowait's body; the caller holds the send lock."""
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
            if tx.partial_pending:
                self._partial = payload
                self._partial_owner = threading.get_ident()
            else:
                self._partial = None
            raise
        if self._partial is not None:
            self._partial = None
            self._partial_done.notify_all()

    def abandon(self, payload: Any) -> None:
        """A send of ``payload`` gave up: if it is half-way through the ring, other
        messages may now go first (the engine then drops the partial message); sending
        the same payload again before that still resumes it."""
        with self._send_lock:
            if self._partial is payload:
                self._partial = None
                self._partial_done.notify_all()

    def discard(self, rtype: int, payload: Any) -> None:
        """A send of ``payload`` (from ``encode``) certainly did not go whole and will not
        be sent again (``waiting.send`` raised a timeout, the peer's death or a closed
        channel, or the task was cancelled while it waited for room): free the
        shared-memory blocks its tensors were placed in, which the engine, never decoding
        it, would never release. Frees nothing under a framing without ``handles``. A
        message it left half-way in the ring is forgotten there: pending tensor releases
        (and every other record) may go at once, instead of waiting behind a message
        nobody will finish until another is sent. Never raises."""
        self.abandon(payload)
        with self._send_lock:
            if self._partial is None:  # (no other message of this side is half-way)
                try:
                    self.tx.drop_partial(payload)
                except Exception:  # noqa: BLE001 - a bare or closed end: nothing to forget
                    pass
        find = getattr(self.framing, "handles", None)
        if find is None:
            return
        try:
            handles = find(rtype, payload)
        except Exception:  # noqa: BLE001 - not one of ours: nothing placed that we know of
            log.debug("no out-of-band tensors found in a discarded message", exc_info=True)
            return
        self.cancel_handles(handles)

    def cancel_handles(self, handles: list) -> None:
        """Free the blocks of ``handles`` (an encode's placed tensors) whose message was
        never handed to a send (an exception between the encode and the send). Never
        raises for a handle that is not one of ours."""
        for h in handles:
            if type(h) is list and len(h) > 1 and type(h[1]) is int:
                self._tensor_tx.cancel(h)

    # -- the wait handle (see shmclient.waiting) ----------------------------------------
    def wait_send(self, timeout: float, *, spin: float | None = None, first: bool = True) -> bool:
        """Block this thread, once, until the request ring may have room (True) or
        ``timeout`` seconds passed (False). While another thread's message is half-way
        through the ring (it refused this one), until that message went or was given
        up instead: room would not let this one go first, and a wait for room would
        return at each release meanwhile."""
        if self._partial is not None and self._partial_owner != threading.get_ident():
            with self._send_lock:
                if self._partial is not None and self._partial_owner != threading.get_ident():
                    # (threading's waits take no inf: a timeout that long is none)
                    return self._partial_done.wait(None if timeout >= threading.TIMEOUT_MAX else timeout)
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

    def flush_releases(self) -> None:
        """Send pending tensor releases without blocking; if the ring is full, a
        fragmented message is half-way, or another thread is sending, they are kept and
        go out with the next message or flush (never lost)."""
        if self._held_release is None and not self._released:
            return  # the common case, without a lock
        if self.tx.partial_pending:
            return
        # try_hold, not `if self._send_lock.acquire(False): try:`: a KeyboardInterrupt
        # between that acquire's return and the try would leave the send lock held, and
        # every later send blocked for good (send_nowait takes it with no timeout).
        from ._ring import try_hold

        with try_hold(self._send_lock) as held:
            if held:
                self._flush_releases_locked()

    def _flush_releases_locked(self) -> None:
        """Send the pending releases, oldest first: those held back before, then new
        ones, in records of at most ``max_record`` bytes (a release is never fragmented:
        one longer than a record would never go, and every later one would wait behind
        it). Caller holds the send lock. A signal handler's exception anywhere in here
        loses no id (one may go twice: the sender ignores an id it has freed). A peer
        that closed its end frees nothing any more: its releases are dropped, and what it
        wrote before closing is still read (a release it can no longer take must not
        hide its last outputs)."""
        rx = self._tensor_rx
        got = rx.peek_releases()
        if got is not None:
            count, rel = got
            step = self.tx.max_record & ~7  # whole ids
            # Held before the ids leave the receiver's queue.
            self._held_release = (self._held_release or []) + [
                rel[i:i + step] for i in range(0, len(rel), step)]
            rx.drop_releases(count)
        rels = self._held_release
        try:
            while rels and self.tx.try_send(REC_RELEASE, rels[0]):
                rels.pop(0)
        except PeerDeadError:
            rels = None
        finally:  # kept, whatever stopped the loop (a signal handler's exception too)
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
                obj = BadMessage(rtype, describe(e), dec.salvage(view), self._fields)
            except BaseException:
                # A signal handler's exception (Ctrl-C) in the decode: the ring counts
                # this record as read, so the blocks of the tensors it names that were
                # not opened yet go back now (the peer would wait for them for good).
                dec.salvage(view)
                raise
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
            # The limit counts records, tensor releases among them, which are no message:
            # read on while only those came (a reader that takes "nothing" for "empty"
            # would leave the messages behind them).
            while self.rx.recv_into(self._on_record, limit) and limit and not self._got:
                pass
        except WouldBlock:  # another thread of ours is reading this ring right now
            raise EndBusy("another thread is reading this channel") from None
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

    def statistics(self) -> ChannelStatistics:
        """Both rings' counters and the tensor sender's (after ``close()``: the rings' as
        they were when closed). Does not block."""
        return ChannelStatistics(tx=self.tx.statistics(), rx=self.rx.statistics(),
                                 tensors=self._tensor_tx.statistics())

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
