"""The writing end of a ring: ``RingProducer`` (built by ``Ring.create`` / ``Ring.attach``
with ``role="producer"``).

Lowest layer, beside ``ring`` (life cycle, waits; read its docstring first) and the C
end ``_ring.Producer`` (records, wrap-around, fragments, publication); imports nothing
above them. Nothing here blocks except ``send`` / ``send_batch`` waiting for space, with
their timeout and liveness check. A message longer than ``max_record`` is written in
fragments; when a send times out half-way, the next ``send`` of the same payload object
resumes at the fragment where it stopped (see ``send``).
"""

from __future__ import annotations

import os
from typing import Sequence

from . import _ring
from .doorbell import drain_pipe
from .errors import PeerNotConsumingError, WouldBlock
from .ring import MAX_PAYLOAD, BytesLike, Ring, _as_bytes


def _too_big(n: int) -> ValueError:
    return ValueError(f"payload of {n} bytes is larger than a message can carry ({MAX_PAYLOAD} bytes)")


def _nbytes(payload) -> int:
    return payload.nbytes if isinstance(payload, memoryview) else len(payload)


class RingProducer(Ring):
    """The writing end."""

    role = "producer"
    _peer = "consumer"

    def _make_end(self, res):
        end = _ring.Producer(res.seg.buf, res.wake_w)
        self._frag_chunk = max(8, (self.capacity // 4 - 16) & -8)
        self._partial: tuple[int, object, int] | None = None  # (type, payload, offset)
        return end

    # ---- public

    def try_send(self, rtype: int, payload: BytesLike) -> bool:
        """Write one record and publish it if it fits now; False if it does not (a
        message longer than ``max_record`` never fits here: use ``send``). Never waits
        for space (it may wait for another thread of this side to finish its call).
        Raises ValueError (type not in 0..255, payload over MAX_PAYLOAD), PeerDeadError
        (the consumer closed), ClientClosedError."""
        try:
            if self._c.try_send(rtype, payload):  # fast path: no lock, one C call
                return True
        except OverflowError:
            pass
        with self._lock:
            if self._closed:
                raise self._closed_error()
            if self._partial is not None:
                return False  # a fragmented message is half-way: it goes first
            try:
                r = self._c.try_send(rtype, payload, True)
            except OverflowError:
                if _nbytes(payload) > MAX_PAYLOAD:
                    raise _too_big(_nbytes(payload)) from None
                return False
            if r is None:
                raise self._peer_dead()
            return r

    def send_nowait(self, rtype: int, payload: BytesLike) -> None:
        """Write and publish one message without ever waiting: raises WouldBlock when the
        ring has no room now (or another thread of this side is in a call). A message
        longer than ``max_record`` goes in fragments: as many as fit now are written,
        then WouldBlock; calling again with the same payload resumes after them (any
        other record sent first makes the consumer drop the partial message). Raises
        ValueError, PeerDeadError, ClientClosedError as ``send``."""
        try:
            if self._c.try_send(rtype, payload):  # fast path: no lock, one C call
                return
        except OverflowError:
            pass
        if not self._lock.acquire(False):
            raise WouldBlock(f"another thread is in a call on this {self.role} end")
        c = self._c
        try:
            if self._closed:
                raise self._closed_error()
            c.held = True
            off = self._resume_at(rtype, payload)
            if off is not None:
                self._fragments_nowait(rtype, payload, off)
                return
            try:
                r = c.try_send(rtype, payload, True)
            except OverflowError:  # longer than one record: fragments
                self._fragments_nowait(rtype, payload, 0)
                return
            if r is None:
                raise self._peer_dead()
            if not r:
                raise WouldBlock(f"the ring is full ({c.pending()} of {self.capacity} bytes unread)")
        finally:
            c.held = self._partial is not None
            self._lock.release()

    def _resume_at(self, rtype: int, payload) -> int | None:
        """Where to resume ``payload`` if it is the fragmented message left half-way,
        else None; either way the half-way message is forgotten here (anything else sent
        first makes the consumer drop it). Caller holds the lock."""
        partial, self._partial = self._partial, None
        if partial is None:
            return None
        ptype, ppayload, off = partial
        return off if ptype == rtype and (ppayload is payload or ppayload == payload) else None

    def _fragments_nowait(self, rtype: int, payload, off: int) -> None:
        n = _nbytes(payload)
        if n > MAX_PAYLOAD:
            raise _too_big(n)
        if type(payload) is not bytes:
            payload = _as_bytes(payload)
        new = self._c.send_part(rtype, payload, off, self._frag_chunk)
        if new is None:
            raise self._peer_dead()
        if new < n:
            self._partial = (rtype, payload, new)
            raise WouldBlock(f"{new} of {n} bytes of a fragmented message written; the ring is full")

    def wait_writable(self, timeout: float, *, spin: float | None = None, first: bool = True) -> bool:
        """Wait, once, for the consumer to release space since the last write that did
        not fit: spin (``spin`` seconds, None: the adaptive budget), then sleep up to
        ``timeout`` seconds. True when space was released or the consumer closed (the
        next send says which), False on the timeout. No liveness check, no retry (see
        ``shmclient.waiting``). Raises ClientClosedError or what a signal handler raised."""
        return self._wait_once(self._c.wait_space, timeout, spin, first)

    def poke(self) -> None:
        """Write a wake byte to the consumer's wake pipe now, whether or not anything was
        published (an early wake-up: the consumer then looks and finds nothing, or what
        was published meanwhile). A no-op without a wake pipe; never blocks (a full pipe
        is readable already)."""
        fd = self._res.wake_w
        if fd < 0 or self._closed:
            return
        try:
            os.write(fd, b"\1")
        except OSError:  # full (already readable), or the consumer is gone
            pass

    @property
    def partial_pending(self) -> bool:
        """A fragmented message is half-way (``send_nowait`` ran out of room): it must
        be finished before any other record goes."""
        return self._partial is not None

    def space_fileno(self) -> int:
        """A descriptor that turns readable when the consumer released space after
        ``arm_space()`` (for ``loop.add_reader``). Needs ``producer_wake_fd=True`` at
        creation. Does not block."""
        if self._closed:
            raise self._closed_error()
        if self._res.space_r < 0:
            raise ValueError("this ring was created without producer_wake_fd=True")
        return self._res.space_r

    def arm_space(self) -> None:
        """Drain the space pipe and ask the consumer for a byte at its next release;
        then retry the send (no wake-up is lost between the two). Does not block."""
        if self._res.space_r >= 0:
            drain_pipe(self._res.space_r)
        self._c.arm_space()

    def send(self, rtype: int, payload: BytesLike, *, timeout: float | None = None, alive=None) -> None:
        """Write one record and publish it, waiting for space while the ring is full
        (spin, then sleep; never drops, never grows). ``timeout`` bounds each wait
        without progress (None: forever); ``alive`` runs every ``liveness_interval``
        while blocked. Raises PeerNotConsumingError, PeerDeadError, ValueError,
        ClientClosedError, or what a signal handler raised.

        A message longer than ``max_record`` goes in fragments. If the wait for space
        times out half-way, the fragments written stay in the ring and calling ``send``
        again with the same payload resumes after them; any other record sent first
        makes the consumer drop the partial message."""
        try:
            if self._c.try_send(rtype, payload):  # fast path: no lock, one C call
                return
        except OverflowError:
            pass
        if timeout is None:
            self._lock.acquire()
        else:
            self._lock_for(timeout)
        c = self._c
        try:
            if self._closed:
                raise self._closed_error()
            c.held = True
            off = self._resume_at(rtype, payload)
            if off is not None:
                self._send_fragments(rtype, payload, off, timeout, alive)
                return
            try:
                r = c.try_send(rtype, payload, True)
            except OverflowError:  # longer than one record: fragments
                self._send_fragments(rtype, payload, 0, timeout, alive)
                return
            while not r:
                if r is None:
                    raise self._peer_dead()
                self._wait_space(timeout, alive)
                r = c.try_send(rtype, payload, True)
        finally:
            # a message left half-way keeps the fast path closed: nothing may be
            # written between its fragments
            c.held = self._partial is not None
            self._lock.release()

    def send_batch(
        self, records: Sequence[tuple[int, BytesLike]], *, timeout: float | None = None, alive=None
    ) -> None:
        """Write several records and publish them together when they fit (else publish
        what is written, wait, go on). Blocks and raises like ``send``; when it raises,
        the records before the failing one may have been sent."""
        self._lock_for(timeout)
        c = self._c
        try:
            if self._closed:
                raise self._closed_error()
            c.held = True
            self._partial = None
            try:
                for rtype, payload in records:
                    try:
                        r = c.append(rtype, payload, True)
                    except OverflowError:
                        self._send_fragments(rtype, payload, 0, timeout, alive)
                        continue
                    while not r:
                        if r is None:
                            raise self._peer_dead()
                        c.publish()
                        self._wait_space(timeout, alive)
                        r = c.append(rtype, payload, True)
            finally:
                if not self._closed:
                    c.publish()
        finally:
            # a message left half-way keeps the fast path closed: nothing may be
            # written between its fragments
            c.held = self._partial is not None
            self._lock.release()

    # ---- fragments and space

    def _send_fragments(self, rtype: int, payload, off: int, timeout, alive) -> None:
        n = _nbytes(payload)
        if n > MAX_PAYLOAD:
            raise _too_big(n)
        if type(payload) is not bytes:
            payload = _as_bytes(payload)
        c = self._c
        chunk = self._frag_chunk
        while True:
            new = c.send_part(rtype, payload, off, chunk)
            if new is None:
                raise self._peer_dead()
            off = new
            if off >= n:
                return
            try:
                self._wait_space(timeout, alive)
            except PeerNotConsumingError:
                self._partial = (rtype, payload, off)
                raise

    def _wait_space(self, timeout, alive) -> None:
        if not self._wait(self._c.wait_space, timeout, alive):
            used = self._c.pending()
            raise PeerNotConsumingError(
                f"the peer is not consuming: no space was released in the ring for {timeout} s "
                f"({used} of {self.capacity} bytes still unread)"
            )
