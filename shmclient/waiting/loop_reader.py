"""``LoopReader``: one channel read from an event loop, and ``Parking``: the tasks that wait
for what a reader delivers, each until it is woken or its deadline passes.

Waiting layer (part of ``shmclient.waiting``): imports asyncio, the package's
``recv_spin``, the spin policy (``doorbell.Spin``), the ring's ``try_hold`` (a lock guard)
and errors, never the clients or a channel class. Like pyzmq's asyncio socket over its sync
one, it tries the channel at once and waits on a file descriptor only when it would block:
``loop.add_reader`` on the channel's ``recv_fd()`` runs a callback that drains the channel
into ``dispatch`` whenever something arrives, so replies and outputs are handled in the
loop even with no task waiting, without a thread hop per message. A waiting task first
spins for at most the adaptive budget (never longer than the configured base), then parks.
It also owns the grace for what a dead peer left. What the messages mean is the caller's
(``dispatch``).
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from time import perf_counter
from typing import Any, Callable

from .._ring import try_hold
from ..doorbell import Spin
from ..errors import ClientClosedError, PeerDeadError, PeerNotProducingError, ProtocolError
from . import recv_spin
from .protocols import Channel, EarlyWake

__all__ = ["LoopReader", "Parking"]

Dispatch = Callable[[list[tuple[int, Any]]], None]


def _release(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


class Parking:
    """Tasks of one loop parked until something they wait for may have come: ``wake()``
    releases them all (each looks again), a deadline releases one. Loop thread only."""

    __slots__ = ("waiters",)

    def __init__(self) -> None:
        self.waiters: set[asyncio.Future] = set()

    def wake(self) -> None:
        """Release every parked task. Never blocks. A waiter whose loop was closed with
        its task parked (the owner then bound another loop) is dropped."""
        stale = None
        for w in self.waiters:
            if not w.done():
                try:
                    w.set_result(None)
                except RuntimeError:  # its loop is closed: nothing will ever run it
                    stale = stale or []
                    stale.append(w)
        if stale:
            self.waiters.difference_update(stale)

    async def park(self, loop: asyncio.AbstractEventLoop, deadline: float | None) -> None:
        """Suspend the running task until ``wake()`` or ``loop.time() >= deadline``
        (None: no deadline). Raises only CancelledError; leaves nothing behind."""
        waiter = loop.create_future()
        self.waiters.add(waiter)
        handle = None if deadline is None else loop.call_at(deadline, _release, waiter)
        try:
            await waiter
        finally:
            self.waiters.discard(waiter)
            if handle is not None:
                handle.cancel()


class _Watch:
    """The loop and descriptor being watched: all that a close hook may hold."""

    __slots__ = ("loop", "fd", "_lock")

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.fd: int | None = None
        self._lock = threading.Lock()

    def watch(self, loop: asyncio.AbstractEventLoop, fd: int) -> None:
        with self._lock:
            self.loop, self.fd = loop, fd

    def unwatch(self) -> None:
        """Stop watching, from any thread: from the loop's own at once, from another
        queued to the loop (which must run it before the descriptor's number is
        reused: call it from the loop's thread where the loop may not turn before the
        descriptor is closed). Once only: a later call does nothing, so it never
        removes a reader registered meanwhile on a reused number. Never blocks."""
        with self._lock:
            loop, fd = self.loop, self.fd
            self.fd = None
        if loop is None or fd is None or loop.is_closed():
            return
        try:
            if _running_loop() is loop:
                loop.remove_reader(fd)
            else:
                loop.call_soon_threadsafe(loop.remove_reader, fd)
        except RuntimeError:  # closed meanwhile
            pass


class LoopReader:
    """Reads ``channel`` in one event loop and hands each batch to ``dispatch(got)``;
    tasks wait for what it brings with ``wait(ready, deadline)``, parked in ``parking``
    (which a caller may replace, to merge several readers into one stream).

    The caller passes ``lead`` (the lock of whoever reads the channel; its owner takes it
    to close the channel), ``closed()`` (nothing more is read), ``dead()`` (the peer is
    gone: waiters read what it left, within ``REMAINS_GRACE_S`` for a channel with
    ``late_after_peer_death``, then raise ``dead_error()``), ``broken(e)`` (the channel
    raised ProtocolError: the owner marks the peer dead), ``spin_s`` (the most a task
    spins before it parks; 0: never) and, for a peer that announces its publishes,
    ``early`` (``EarlyWake``: armed while a task is parked; a wake-up that found nothing
    spins for the announced publish).

    The callback reads before it re-arms the descriptor on a channel with
    ``arm_after_read`` (the ring's wake pipe: re-arming writes a byte for any record
    still unread, so arming first would wake the loop once more for the record being
    read); it arms first on any other (an edge-triggered socket descriptor signals
    only what arrives after it was armed). ``wakes`` and ``empty_wakes`` count the
    callbacks and those that found nothing.
    """

    #: Most messages one read in the loop decodes (a backlog of thousands would hold the
    #: loop for milliseconds); the rest are read in the next turn of the loop.
    READ_LIMIT = 16
    #: A task taking what was already there yields to the loop at least this often.
    YIELD_EVERY_S = 200e-6
    #: How long a channel whose last messages may trail the peer's death is given for them.
    REMAINS_GRACE_S = 0.05
    #: How often that grace looks again when nothing woke it (the channel may be held by
    #: another thread).
    REMAINS_POLL_S = 0.005

    def __init__(self, channel: Channel, dispatch: Dispatch, *, lead: threading.Lock,
                 closed: Callable[[], bool], dead: Callable[[], bool],
                 dead_error: Callable[[], BaseException],
                 broken: Callable[[ProtocolError], Any], spin_s: float,
                 early: EarlyWake | None = None) -> None:
        self.channel = channel
        self.lead = lead
        self.parking = Parking()
        self.spin = Spin(spin_s)
        self._dispatch = dispatch
        self._closed = closed
        self._dead = dead
        self._dead_error = dead_error
        self._broken = broken
        self._grace = self.REMAINS_GRACE_S if channel.late_after_peer_death else 0.0
        self._arm_after_read = bool(getattr(channel, "arm_after_read", False))
        self.early = early
        self.wakes = self.empty_wakes = 0
        self._watch = _Watch()
        self._again = _weak(self.on_readable)
        self._last_turn = 0.0
        #: Set once what the dead peer wrote has been read (or cannot be).
        self.remains_read = False

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        return self._watch.loop

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Watch ``channel.recv_fd()`` in ``loop`` (the loop holds the reader weakly)."""
        fd = self.channel.recv_fd()
        self._watch.watch(loop, fd)
        loop.add_reader(fd, self._again)

    def unwatch_hook(self) -> Callable[[], None]:
        """A callable that stops watching from any thread; it holds neither the reader
        nor its owner, so it may run from a finalizer."""
        return self._watch.unwatch

    # -- reading ----------------------------------------------------------------------
    def on_readable(self) -> None:
        """The loop's callback: drain the channel (``READ_LIMIT`` at a time) whenever
        something was published, even with no task waiting."""
        # try_hold, not `if lead.acquire(False): try:`: a KeyboardInterrupt between that
        # acquire's return and the try would leave the lead held for good (this callback
        # would then return at once on every turn, the wake pipe readable, nothing read).
        with try_hold(self.lead) as led:
            if not led:
                return  # a task is reading right now, or the owner is closing the channel
            if self._closed():
                return
            self.wakes += 1
            channel = self.channel
            after = self._arm_after_read
            if not after and not self._arm():  # then try: a publish after this signals the fd again
                return
            got = self._take(0.0)
            early = self.early
            if not got and early is not None and self.parking.waiters:
                spin = early.fired()
                if spin > 0.0:  # the peer announced a publish: spin for it
                    got = self._take(spin)
                    early.after(bool(got))
            if after:
                self._arm()  # a record still unread makes the fd readable again
            if got:
                self._deliver(got)
            else:
                self.empty_wakes += 1
            if channel.peer_closed and len(got) < self.READ_LIMIT:
                # The peer closed its end (it is exiting) and what it wrote has been
                # read: stop watching a descriptor that now stays readable; its owner
                # reports the death.
                self._watch.unwatch()

    def _arm(self) -> bool:
        """Arm the channel's descriptor; False (and no longer watched) once the channel
        is closed or broken (``broken`` was told)."""
        try:
            self.channel.arm_recv()
            return True
        except (ClientClosedError, OSError, ProtocolError):
            self._watch.unwatch()
            return False

    def _take(self, spin: float) -> list[tuple[int, Any]]:
        """What is there (spinning up to ``spin`` seconds for it); [] once the peer is
        gone or the channel broke (``broken`` told). Caller holds ``lead``."""
        try:
            return recv_spin(self.channel, spin, self.READ_LIMIT)
        except (PeerDeadError, ClientClosedError):
            return []  # a dead peer: its owner's report wakes the waiters
        except ProtocolError as e:
            self._broken(e)
            return []

    def read_now(self, spin: float) -> int:
        """Read and dispatch what is there, spinning up to ``spin`` seconds for it,
        unless someone else holds the channel or the peer is gone; how many messages
        that brought."""
        with try_hold(self.lead) as led:  # (see on_readable: no gap before the release)
            if not led or self._closed() or self._dead():
                return 0
            got = self._take(spin)
            if got:
                self._deliver(got)
            return len(got)

    def _deliver(self, got: list[tuple[int, Any]]) -> None:
        self._dispatch(got)
        self.parking.wake()
        if len(got) >= self.READ_LIMIT and not self._arm_after_read and self._watch.loop is not None:
            # More may be waiting: read on after the loop's other tasks ran (an
            # edge-triggered socket descriptor would not signal them again; the ring's
            # wake pipe does, once re-armed).
            self._watch.loop.call_soon(self._again)

    # -- waiting ----------------------------------------------------------------------
    def turn_due(self) -> bool:
        """Whether a task that has not been suspended for ``YIELD_EVERY_S`` should yield
        to the loop now (it then counts as suspended)."""
        now = perf_counter()
        if now - self._last_turn > self.YIELD_EVERY_S:
            self._last_turn = now
            return True
        return False

    async def wait(self, ready: Callable[[], bool], deadline: float | None) -> None:
        """Return once ``ready()`` (a dispatch brought what the task waits for); never
        holds the loop longer than a spin. ``deadline``: ``loop.time()`` (None: none),
        then PeerNotProducingError. Once the peer is gone, what it left is read first;
        then ``dead_error()`` unless that made ``ready()`` true; ``dead_error()`` at
        once after ``closed()``. The reader must be bound to the running loop."""
        loop = self._watch.loop
        assert loop is not None, "bind() the reader first"
        spin = self.spin
        while True:
            if self._closed():
                raise self._dead_error()
            if self._dead():
                await self.read_remains()
                if ready():
                    return
                raise self._dead_error()
            self.read_now(min(spin.budget, spin.base))
            if ready():
                spin.after(True, 0.0)  # the spin paid
                return
            if deadline is not None and loop.time() >= deadline:
                raise PeerNotProducingError("nothing arrived within the timeout (the peer is alive)")
            parked = perf_counter()
            await self.park(loop, deadline)
            self._last_turn = now = perf_counter()
            spin.after_block(now - parked)  # how the wait ended steers the next spin
            if ready():
                return

    async def park(self, loop: asyncio.AbstractEventLoop, deadline: float | None) -> None:
        """Park the running task in ``parking`` (see ``Parking.park``), with the peer's
        early wake-up armed meanwhile where it has one."""
        early = self.early
        if early is None:
            await self.parking.park(loop, deadline)
            return
        early.arm()
        try:
            await self.parking.park(loop, deadline)
        finally:
            early.disarm()

    async def read_remains(self) -> None:
        """Once the peer is gone: dispatch what it wrote before it died and nobody has
        read yet; a channel whose last messages may trail the death is read on until
        ``REMAINS_GRACE_S`` passed (parked meanwhile: the callback delivers them).
        Returns at once if that was done already or after ``closed()``."""
        loop = self._watch.loop
        assert loop is not None, "bind() the reader first"
        end = loop.time() + self._grace
        while not self.remains_read and not self._closed():
            got: list[tuple[int, Any]] = []
            with try_hold(self.lead) as led:  # (see on_readable: no gap before the release)
                if led:
                    if self.remains_read or self._closed():
                        return
                    try:
                        got = self.channel.try_recv(self.READ_LIMIT)
                    except (PeerDeadError, ClientClosedError, ProtocolError):
                        got = []
                    if got:
                        self._deliver(got)
                    elif loop.time() >= end:
                        self.remains_read = True
                        return
            if got:
                await asyncio.sleep(0)  # the loop's other tasks run between batches
                continue
            # Parked, not polling: a delivery by the callback wakes it; the slice bounds
            # the wait for a channel held by another thread.
            await self.parking.park(loop, loop.time() + self.REMAINS_POLL_S)


def _weak(method: Callable[[], None]) -> Callable[[], None]:
    """``method`` through a weak reference: the loop must not keep its object alive."""
    ref = weakref.WeakMethod(method)

    def call() -> None:
        m = ref()
        if m is not None:
            m()

    return call


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
