"""The reading end of a ring: ``RingConsumer`` (built by ``Ring.create`` / ``Ring.attach``
with ``role="consumer"``).

Lowest layer, beside ``ring`` (life cycle, waits; read its docstring first) and the C
end ``_ring.Consumer`` (see, read, reassemble, release: one call); imports nothing above
them. ``try_recv`` and ``recv_into(timeout=0)`` never block; ``recv`` and ``recv_into``
with a timeout spin, then sleep, with a liveness check.

Each receive first tries one C call without the lock (the GIL orders it against other
threads' calls); only when there is nothing to read, or another thread's slow path holds
the end (``held``), does it take the lock and wait. Taking records and releasing their
space happen inside that one call, so no exception can land between them.
"""

from __future__ import annotations

from typing import Callable

from . import _ring
from .doorbell import drain_pipe
from .errors import PeerNotProducingError
from .ring import Ring


class RingConsumer(Ring):
    """The reading end."""

    role = "consumer"
    _peer = "producer"

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

    def recv(self, *, timeout: float | None = None, alive=None) -> list[tuple[int, bytes]]:
        """At least one record: everything available, copied out. Spins, then sleeps;
        ``timeout`` bounds each wait without progress (None: forever); ``alive`` runs
        every ``liveness_interval`` while blocked. Raises PeerNotProducingError,
        PeerDeadError, ClientClosedError, or what a signal handler raised."""
        out = self._c.take()  # fast path: no lock, one C call
        if out:
            return out
        if timeout is None:
            self._lock.acquire()
        else:
            self._lock_for(timeout)
        c = self._c
        try:
            if self._closed:
                raise self._closed_error()
            c.held = True
            while True:
                out = c.take(True)
                if out:
                    return out
                if not self._wait(c.wait, timeout, alive):
                    raise self._not_producing(timeout)
        finally:
            c.held = False
            self._lock.release()

    def recv_into(
        self, handler: Callable[[int, memoryview], None], *, timeout: float | None = 0.0, alive=None,
        limit: int = 0,
    ) -> int:
        """Zero-copy receive: call ``handler(rtype, view)`` for every record available,
        in order; ``view`` points into the ring and is valid only during the call (it is
        released afterwards). A view the handler kept an export of (``numpy.frombuffer``,
        ``torch.frombuffer``) pins its record: its space is not reused until that export
        is dropped. ``timeout=0`` (default) never blocks and may return 0; otherwise
        waits like ``recv`` for at least one record. Returns the number of records
        handled. If the handler raises, that record counts as consumed and the exception
        propagates; the rest come with the next call. The handler must not use this
        ring (RuntimeError); another thread's call waits for it to return (with
        ``timeout=0`` it raises PeerNotProducingError instead, as for a held lock).
        ``limit`` > 0: at most that many messages per call (the rest stay; the wake pipe
        stays readable)."""
        c = self._c
        n = c.recv_views(handler, False, limit)  # fast path: no lock, one C call
        if n:
            if self._closed:  # the handler closed this end
                raise self._closed_error()
            return n
        if n == 0 and timeout is not None and timeout <= 0 and c.poll() == 0:
            return 0  # nothing there and the producer is still open
        self._lock_for(timeout)
        try:
            if self._closed:
                raise self._closed_error()
            c.held = True
            nowait = timeout is not None and timeout <= 0
            while True:
                # with timeout 0, another thread's call in progress is not waited for
                n = c.recv_views(handler, 2 if nowait else True, limit)
                if self._closed:  # the handler closed this end
                    raise self._closed_error()
                if n is None:
                    raise PeerNotProducingError(
                        f"another thread is in a call on this {self.role} end (timeout {timeout} s)")
                if n:
                    return n
                if timeout is not None and timeout <= 0:
                    if c.poll() == 2:
                        raise self._peer_dead()
                    return 0
                if c.pinned:
                    c.unpin()  # views dropped since the last call free their space now
                if not self._wait(c.wait, timeout, alive):
                    raise self._not_producing(timeout)
        finally:
            if not self._closed:
                c.held = False
            self._lock.release()

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
        loses the wake-up of the records it did not get to). Never blocks."""
        drain_pipe(self.fileno())
        self._c.rearm()

    @property
    def pinned(self) -> int:
        """Records whose space a handler's kept view still holds."""
        return 0 if self._closed else self._c.pinned

    def _not_producing(self, timeout) -> PeerNotProducingError:
        return PeerNotProducingError(
            f"the peer is not producing: nothing was published in the ring for {timeout} s"
        )
