"""The reading end of a ring: ``RingConsumer`` (``RingConsumer.create`` / ``.attach``).

Lowest layer, beside ``ring`` (the shared life cycle and layout; read its docstring
first) and the C end ``_ring.Consumer`` (see, read, reassemble, release: one call);
imports ``ring`` and nothing above it: not ``ring_producer``, ``waiting`` or asyncio. It
owns reading: ``try_recv``, ``recv_nowait`` (copied out) and ``recv_into`` (in place)
never wait for data, and the one wait for it is ``wait_readable`` (``wait_recv``), a
single spin then sleep; these are the wait handle through which ``shmclient.waiting``
receives with a deadline and a liveness check, or ``fileno`` / ``drain_wake_fd`` for an
event loop. Its contract (threads, the lock): docs/design.md, "Module notes",
``shmclient.ring_consumer``.
"""

from __future__ import annotations

from typing import Callable

from . import _ring
from .doorbell import drain_pipe
from .errors import EndBusy, WouldBlock
from .ring import Ring


class RingConsumer(Ring):
    """The reading end."""

    role = "consumer"
    _peer = "producer"
    _reads_wake = True

    def _make_end(self, res):
        self._wake_r = res.wake_r
        return _ring.Consumer(res.seg.buf, res.wake_w, res.space_w)

    # ---- public

    def try_recv(self) -> list[tuple[int, bytes]]:
        """Every complete record available now, in order, copied out; [] if none.
        Never waits for data (it may wait for another thread of this side to finish its
        call). Raises PeerDeadError once the producer has closed and everything it sent
        has been read; RingCorruptError (a ProtocolError) when the producer broke the
        protocol; ClientClosedError (ForkedError in a forked child)."""
        c = self._c
        out = c.take()  # fast path: no lock, one C call
        if out or (out is not None and c.poll() == 0):
            return out
        with self._lock:
            if self._closed:
                raise self._closed_error()
            out = self._c.take(True)
            if not out and self._c.poll() == 2:
                raise self._peer_dead()
            return out

    def recv_nowait(self, limit: int = 0) -> list[tuple[int, bytes]]:
        """``try_recv`` for the wait handle: every record available now (at most
        ``limit`` if > 0; the rest stay for the next call), in order, copied out; raises
        WouldBlock when there is none (or, with a ``limit``, when another thread of this
        side is in a call). Raises as ``try_recv`` otherwise."""
        if limit > 0:
            out: list[tuple[int, bytes]] = []
            self.recv_into(lambda t, v: out.append((t, bytes(v))), limit)
        else:
            out = self.try_recv()
        if not out:
            raise WouldBlock("nothing to receive")
        return out

    def recv_into(self, handler: Callable[[int, memoryview], None], limit: int = 0) -> int:
        """Zero-copy receive: call ``handler(rtype, view)`` for every record available
        now, in order, and return how many (0: none there). Never waits for data
        (``shmclient.waiting.recv_into`` waits for it). ``view`` points into the ring and
        is valid only during the call (it is released afterwards). A view the handler
        kept an export of (``numpy.frombuffer``; ``torch.from_numpy`` of one) pins its record:
        its space is not reused until that export is dropped (which frees it and wakes
        a producer waiting for it, or, during a receive call, that call's end frees it).
        If the handler raises,
        that record counts as consumed and the exception propagates; the rest come with
        the next call. The handler must not use this ring (RuntimeError). ``limit`` > 0:
        at most that many messages per call (the rest stay; the wake pipe stays
        readable). Raises WouldBlock when another thread of this side is in a call (a
        handler may take long: it is not waited for), PeerDeadError once the producer
        closed and everything was read, RingCorruptError, ClientClosedError."""
        c = self._c
        n = c.recv_views(handler, False, limit)  # fast path: no lock, one C call
        if n:
            if self._closed:  # the handler closed this end
                raise self._closed_error()
            return n
        if n == 0 and c.poll() == 0:
            return 0  # nothing there and the producer is still open
        # try_hold: a Ctrl-C as the lock is taken cannot leave it held (every later call
        # of this end would find it busy, and close would wait for it)
        with _ring.try_hold(self._lock) as held:
            if not held:
                raise EndBusy(f"another thread is in a call on this {self.role} end")
            try:
                if self._closed:
                    raise self._closed_error()
                c.held = True
                n = c.recv_views(handler, 2, limit)  # 2: another thread's call is not waited for
                if self._closed:  # the handler closed this end
                    raise self._closed_error()
                if n is None:
                    raise EndBusy(f"another thread is in a call on this {self.role} end")
                if not n and c.poll() == 2:
                    raise self._peer_dead()
                return n
            finally:
                if not self._closed:
                    c.held = False

    def has_data(self) -> bool:
        """Whether a record is waiting (a plain look; never blocks)."""
        return self._c.poll() == 1

    def wait_readable(self, timeout: float, *, spin: float | None = None, first: bool = True) -> bool:
        """Wait, once, for a record to read: spin (``spin`` seconds, None: the adaptive
        budget), then sleep up to ``timeout`` seconds. True when one is there or the
        producer closed (the next ``try_recv`` says which), False on the timeout. No
        liveness check, no retry: the slice loop is the caller's (``shmclient.waiting``).
        Raises ClientClosedError or what a signal handler raised."""
        c = self._c
        if c.pinned:
            c.unpin()  # views dropped since the last call free their space now
        return self._wait_once(c.wait, timeout, spin, first)

    #: The wait handle's name for ``wait_readable`` (``shmclient.waiting.recv``).
    wait_recv = wait_readable

    def fileno(self) -> int:
        """A descriptor that is readable whenever a published record has not been read
        (for ``loop.add_reader``). Call ``drain_wake_fd()`` and then ``try_recv()``."""
        if self._closed:
            raise self._closed_error()
        if self._wake_r < 0:
            raise ValueError("this ring was created without consumer_wake_fd=True")
        return self._wake_r

    def drain_wake_fd(self) -> None:
        """Consume pending wake bytes; if a record is still unread, the descriptor is
        made readable again at once (so a reader that fails after draining it never
        loses the wake-up of the records it did not get to). ClientClosedError once
        closed (also by another thread during the call; ForkedError in a forked child).
        Never blocks for data (it may wait for another thread of this side to finish its
        call): the pipe is read under the lock, because a close waits for this lock
        before it closes the pipe, whose number may be another file's after."""
        if self._closed:  # (first without the lock: a forked child's, whose holder may not exist there)
            raise self._closed_error()
        with self._lock:
            if self._closed:
                raise self._closed_error()
            fd = self._wake_r
            if fd < 0:
                raise ValueError("this ring was created without consumer_wake_fd=True")
            drain_pipe(fd)
            self._c.rearm()

    @property
    def pinned(self) -> int:
        """Records whose space a handler's kept view still holds."""
        return 0 if self._closed else self._c.pinned
