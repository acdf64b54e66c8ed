"""``ThreadReader``: the threads that wait on one channel read it by turns, leader and
followers, and whatever one of them reads is dispatched for all.

Waiting layer (part of ``shmclient.waiting``): imports the package's ``recv``, errors and
the ring's ``try_hold`` (a lock guard), never the clients, a channel class or asyncio. It
owns the leader/follower hand-over, the waiter's deadline, the reaction to a dead peer or a
broken channel, and reading, once, what a dead peer left. What the messages mean (futures,
queues) is the caller's: it passes ``dispatch`` in, and says with ``done()`` when its
waiter may stop. Why no reader thread: a thread-to-thread hand-off costs several ring hops
and a spinning reader holds the GIL the caller needs, so the caller's own thread reads.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from .._ring import try_hold
from ..errors import ClientClosedError, PeerDeadError, PeerNotProducingError, ProtocolError
from . import recv
from .protocols import Channel, Flag

__all__ = ["ThreadReader", "take_remains"]

Dispatch = Callable[[list[tuple[int, Any]]], None]


def take_remains(channel: Channel, grace: float) -> list[tuple[int, Any]]:
    """What a dead peer wrote and nobody has read yet: everything there now and, with
    ``grace`` > 0, what keeps arriving until ``grace`` seconds pass with nothing (a
    channel whose last messages may trail the peer's death). Blocks for at most that;
    returns [] for a channel that is broken or closed."""
    got: list[tuple[int, Any]] = []
    while True:
        try:
            more = recv(channel, timeout=grace) if grace > 0 else channel.try_recv()
        except (PeerNotProducingError, PeerDeadError, ClientClosedError, ProtocolError):
            more = []
        if not more:
            return got
        got.extend(more)


class ThreadReader:
    """Reads ``channel`` for every thread that waits on it; ``dispatch(got)`` gets each
    batch read, in order, from whichever thread read it.

    ``wait(done, deadline)`` blocks the calling thread until ``done()``. The first waiter
    to take ``lead`` reads (``shmclient.waiting.recv``, with ``alive`` between slices)
    and dispatches; the others follow: they sleep on a condition that the leader notifies
    whenever it hands the channel back, and one of them leads next. Between the slices of
    a wait the leader sends the releases of tensors the caller dropped meanwhile (a
    channel's ``flush_releases``), so the peer's arena does not fill up while it waits. The
    caller passes:

    * ``lead``: the lock of whoever reads the channel (its owner also takes it to close
      the channel under a reader);
    * ``dead``: set once the peer is gone (or the owner is closing): waiters read what the
      peer left (once, ``read_remains``), then raise ``dead_error()``;
    * ``closed()``: the owner closed the channel (or may no longer use it): nothing more
      is read from it, waiters raise ``dead_error()``;
    * ``broken(e)``: the channel raised ProtocolError; returns the error to raise (the
      owner marks the peer dead).

    A channel with ``late_after_peer_death`` gets ``REMAINS_GRACE_S`` for the messages
    that trail the death.
    """

    #: Longest a follower sleeps before it looks again (a safety net: the leader notifies
    #: the followers whenever it hands the channel back).
    FOLLOW_SLICE_S = 0.05
    #: How long a channel whose last messages may trail the peer's death is given for them.
    REMAINS_GRACE_S = 0.05
    #: How long reading what a dead peer left waits for the channel's current reader.
    LEAD_WAIT_S = 2.0

    def __init__(self, channel: Channel, dispatch: Dispatch, *, lead: threading.Lock,
                 dead: Flag, alive: Callable[[], bool], closed: Callable[[], bool],
                 dead_error: Callable[[], BaseException],
                 broken: Callable[[ProtocolError], BaseException]) -> None:
        self.channel = channel
        self.lead = lead
        self._dispatch = dispatch
        self._dead = dead
        self._alive = alive
        self._flush = getattr(channel, "flush_releases", None)
        self._closed = closed
        self._dead_error = dead_error
        self._broken = broken
        self._grace = self.REMAINS_GRACE_S if channel.late_after_peer_death else 0.0
        self._cond = threading.Condition(threading.Lock())  # followers wait here
        self._followers = 0
        #: Set once what the dead peer wrote has been read (or cannot be).
        self.remains_read = False

    def wait(self, done: Callable[[], bool], deadline: float | None) -> None:
        """Block until ``done()`` (``time.monotonic()`` ``deadline``; None: none).
        Raises ``dead_error()`` once the peer is gone and what it left did not make
        ``done()`` true, ``broken(e)``'s error, PeerNotProducingError at the deadline."""
        lead = self.lead
        dead = self._dead
        tried = False  # a deadline already past still gets one look at the channel
        while True:
            if done():
                return
            if self._closed():
                raise self._dead_error()  # shut down, or a forked child's copy
            if dead.is_set():
                # What the peer wrote before it died comes first, then the error (also
                # after another thread's reading of it, which read_remains waits for).
                self.read_remains()
                if done():
                    return
                raise self._dead_error()
            left = None if deadline is None else deadline - time.monotonic()
            expired = left is not None and left <= 0
            if expired and tried:
                raise PeerNotProducingError("nothing arrived within the timeout (the peer is alive)")
            # try_hold, not `if lead.acquire(False): try:`: a KeyboardInterrupt between
            # that acquire's return and the try would leave the lead held for good (every
            # later wait would follow a reader that is gone).
            led = False
            try:
                with try_hold(lead) as led:
                    if led:
                        tried = True
                        if done() or dead.is_set():
                            continue
                        try:
                            got = recv(self.channel, timeout=0.0 if expired else left, alive=self._alive_and_flush)
                            if got:
                                self._dispatch(got)
                        except PeerNotProducingError:
                            pass
                        except ProtocolError as e:
                            raise self._broken(e) from e
                        except (PeerDeadError, ClientClosedError) as e:
                            if not dead.is_set():
                                dead.wait(2.0)  # the channel saw the peer go before its owner did
                            if not dead.is_set():
                                raise self._dead_error() from e
                            # Dead: the loop's top reads what is left, then raises.
            finally:
                if led and self._followers:  # after the lead's release: they may lead next
                    self.wake_all()
            if led:
                continue
            if expired:  # another thread is reading: nothing more to look at
                raise PeerNotProducingError("nothing arrived within the timeout (the peer is alive)")
            else:
                self._follow(done, left)

    def _alive_and_flush(self) -> bool:
        flush = self._flush
        if flush is not None:
            flush()
        return self._alive()

    def _follow(self, done: Callable[[], bool], left: float | None) -> None:
        """Sleep until the leader hands the channel back (or a slice passed). The count
        goes up under the condition before the leader is looked at, so a leader that
        releases after the look sees a follower and notifies: no wake-up is lost."""
        with self._cond:
            self._followers += 1
            try:
                if self.lead.locked() and not done() and not self._dead.is_set():
                    self._cond.wait(self.FOLLOW_SLICE_S if left is None else min(left, self.FOLLOW_SLICE_S))
            finally:
                self._followers -= 1

    def wake_all(self, first: Callable[[], None] | None = None) -> None:
        """Wake every follower (to look at ``done()`` and ``dead`` again); ``first()``
        runs under the followers' lock before they wake (e.g. failing the futures they
        wait for)."""
        with self._cond:
            if first is not None:
                first()
            self._cond.notify_all()

    def read_remains(self) -> bool:
        """Once the peer is gone: read, once, what it wrote before it died and dispatch
        it. True if that brought anything. Waits up to ``LEAD_WAIT_S`` for the current
        reader (a thread reading the remains included: returned, they are dispatched),
        then up to the grace; nothing once ``closed()``."""
        if self._closed():
            return False
        got: list[tuple[int, Any]] = []
        led = False
        try:
            with try_hold(self.lead, self.LEAD_WAIT_S) as led:  # (see wait: no gap before the release)
                if not led or self.remains_read or self._closed():
                    return False
                self.remains_read = True
                got = take_remains(self.channel, self._grace)
                if got:
                    self._dispatch(got)
        finally:
            if led and self._followers:
                self.wake_all()
        return bool(got)
