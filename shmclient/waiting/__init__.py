"""The only place above the ring that blocks: waiting on a channel or a ring end, for
threads and asyncio, and the two readers the clients wait for output with.

Waiting layer: imports errors, asyncio and the ring's lock guard (``try_hold``) only; it
knows channels and ring ends by their interface (``waiting.protocols``), never the
clients, the engine or those classes themselves. It owns every wait with a deadline and a liveness check. Every other module
tries without blocking (``send_nowait`` / ``recv_nowait``, which raise ``WouldBlock``)
and comes here to wait; both clients and the engine loop do. This module holds the single
waits (``send``, ``recv``, ``recv_into``, ``recv_spin``, ``wait_fd``, ``send_async``);
``thread_reader.ThreadReader`` (threads share one channel, leader and followers) and
``loop_reader.LoopReader`` (an event loop's reader callback, parking with deadlines) are
written over them, each with the client's ``dispatch`` passed in, as are
``ordered.OrderedSends`` and ``OrderedSendsAsync`` (one sender's sends in call order).
Its contract (the wait handle, timeouts, liveness, signals): docs/design.md, "Module
notes", ``shmclient.waiting``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, TypeVar

from .._ring import try_hold  # (re-exported: the lock guard of the readers and their users)
from ..errors import (EndBusy, PeerDeadError, PeerNotConsumingError, PeerNotProducingError, WouldBlock,
                      mark_not_sent)
from .protocols import (
    CAPABILITIES,
    FLAGS,
    AsyncSender,
    Channel,
    ChannelCapabilities,
    EarlyWake,
    Flag,
    Receiver,
    RecordReceiver,
    Sender,
)

__all__ = ["CAPABILITIES", "FLAGS", "LIVENESS_S", "AsyncSender", "Channel", "ChannelCapabilities", "EarlyWake", "Flag",
           "LoopReader", "OrderedSends", "OrderedSendsAsync", "Parking", "Receiver", "RecordReceiver", "Sender",
           "ThreadReader", "check_timeout", "forget_closed_loops", "recv", "recv_into", "recv_spin", "send",
           "send_async", "try_hold", "wait_fd"]

#: Longest a wait sleeps before it checks ``alive()`` again.
LIVENESS_S = 0.1

T = TypeVar("T")
Alive = Callable[[], bool]


def check_timeout(timeout: float | None) -> float | None:
    """``timeout`` as a wait takes it: None, inf or more seconds than a float holds (no
    limit: None), else seconds >= 0. Raises ValueError for NaN, a negative number or
    something that is not one."""
    if timeout is None:
        return None
    try:
        ok = timeout >= 0
    except (TypeError, ArithmeticError):  # (a Decimal NaN raises on comparison)
        ok = False
    if not ok or isinstance(timeout, bool):
        raise ValueError(f"timeout must be None or a number of seconds >= 0 (inf: no limit), got {timeout!r}")
    try:
        seconds = float(timeout)
    except OverflowError:  # an int past any float: no limit, as inf
        return None
    return None if seconds == float("inf") else seconds


#: The longest pause between the tries of a wait whose end another thread's call holds.
_BUSY_BACKOFF_MAX_S = 0.001


def _block(
    attempt: Callable[[], T],
    wait_once: Callable[..., bool],
    timeout: float | None,
    alive: Alive | None,
    timed_out: Callable[[], Exception],
    mark: bool = False,
) -> T:
    """``attempt()`` until it does not raise WouldBlock, waiting with ``wait_once``
    between tries; a deadline of ``timeout`` seconds (None: none) and ``alive()``
    between slices. ``mark``: an exception raised between the attempts (a signal
    handler's, in the wait) is marked ``mark_not_sent`` (no attempt was under way)."""
    try:
        return attempt()
    except WouldBlock:
        pass
    deadline = None if timeout is None else time.monotonic() + timeout
    first = True
    trying = False  # an attempt may be under way (set before it, cleared after WouldBlock)
    busy = 0  # waits in a row that said ready, then nothing could be taken
    try:
        while True:
            if deadline is None:
                slice_s = LIVENESS_S
            else:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise timed_out()
                slice_s = min(left, LIVENESS_S)
            ready = wait_once(slice_s, first=first)
            first = False
            trying = True
            try:
                return attempt()
            except EndBusy:
                held = True
            except WouldBlock:  # (nothing whole yet: a fragment or a release was taken)
                held = False
            trying = False
            if ready and held:
                # Ready, and yet the end was refused, twice in a row: another thread's
                # call holds it (its receive handler may run long), and each wait would
                # say ready at once: back off (up to 1 ms) instead of spinning.
                busy += 1
                if busy > 1:
                    pause = min(_BUSY_BACKOFF_MAX_S, 10e-6 * (1 << min(busy, 7)))
                    if deadline is not None:
                        pause = min(pause, max(0.0, deadline - time.monotonic()))
                    time.sleep(pause)
            else:
                busy = 0
            if not ready and alive is not None and not alive():
                trying = True
                try:
                    return attempt()  # it may have written just before it went
                except WouldBlock:
                    raise PeerDeadError(
                        "the peer is gone: its liveness check failed while we waited") from None
    except BaseException as e:
        if mark and not trying:
            mark_not_sent(e)
        raise


def send(
    channel: Sender, rtype: int, payload: Any, *, timeout: float | None = None, alive: Alive | None = None
) -> None:
    """Send ``payload`` (from ``channel.encode``) from this thread, waiting while the
    channel has no room (backpressure). Raises PeerNotConsumingError after ``timeout``
    seconds (None: no limit; a message bigger than the ring may then be sent in part and
    resumes when sent again), PeerDeadError, ClientClosedError, ValueError."""

    timeout = check_timeout(timeout)

    def timed_out() -> Exception:
        return PeerNotConsumingError(
            f"the peer is not consuming: no room for the message within {timeout} s")

    try:
        _block(lambda: channel.send_nowait(rtype, payload), channel.wait_send, timeout, alive,
               timed_out, mark=True)
    except BaseException:
        channel.abandon(payload)  # half-sent: the next other message may go first
        raise


def recv(channel: Receiver, *, timeout: float | None = None, alive: Alive | None = None,
         spin: float | None = None) -> list[tuple[int, Any]]:
    """At least one message, decoded (everything available), waiting in this thread.
    ``spin``: seconds the first wait may spin before it sleeps (None: the channel's
    adaptive budget; 0: sleep at once, for a thread that must not hold the GIL while it
    waits, because other threads of its process need it). Raises PeerNotProducingError
    after ``timeout`` seconds (None: no limit), PeerDeadError, ProtocolError,
    ClientClosedError, or what a signal handler raised."""

    timeout = check_timeout(timeout)

    def timed_out() -> Exception:
        return PeerNotProducingError(f"nothing arrived within {timeout} s: the peer is not producing")

    if spin is None:
        wait_once = channel.wait_recv
    else:
        def wait_once(slice_s: float, *, first: bool) -> bool:
            # The first slice only: a later one (each LIVENESS_S) sleeps at once, or an
            # idle waiter would spin ``spin`` in every slice.
            return channel.wait_recv(slice_s, spin=spin if first else 0.0, first=first)

    return _block(channel.recv_nowait, wait_once, timeout, alive, timed_out)


def recv_into(
    end: RecordReceiver, handler: Callable[[int, memoryview], Any], *, timeout: float | None = None,
    alive: Alive | None = None, limit: int = 0,
) -> int:
    """Zero-copy ``recv`` for a ring consumer end: ``handler(rtype, view)`` for every
    record there (at least one; at most ``limit`` messages if > 0), waiting in this
    thread while there is none; returns how many. ``end.recv_into(handler, limit)`` must
    never wait and return 0 when nothing is there (``RingConsumer.recv_into``: the view
    is valid during the call only; a handler's exception propagates, its record counted
    as read). Raises as ``recv``."""

    timeout = check_timeout(timeout)

    def attempt() -> int:
        n = end.recv_into(handler, limit)
        if not n:
            raise WouldBlock("nothing to receive")
        return n

    def timed_out() -> Exception:
        return PeerNotProducingError(f"nothing arrived within {timeout} s: the peer is not producing")

    return _block(attempt, end.wait_recv, timeout, alive, timed_out)


def recv_spin(channel: Receiver, spin: float | None, limit: int = 0) -> list[tuple[int, Any]]:
    """What is there now, else what arrives within a spin of ``spin`` seconds (None: the
    channel's adaptive budget; never a sleep), else []; at most ``limit`` messages if
    > 0. For an event loop: it holds the loop for at most the spin and the decoding of
    ``limit`` messages. Raises as ``recv``."""
    try:
        return channel.recv_nowait(limit)
    except WouldBlock:
        pass
    if spin is not None and spin <= 0:
        return []
    channel.wait_recv(0.0, spin=spin)
    try:
        return channel.recv_nowait(limit)
    except WouldBlock:
        return []


#: Tasks parked on a descriptor, per (loop, fd): one reader serves them all (a second
#: ``add_reader`` on the same fd would replace the first task's callback).
_parked: dict[tuple[int, int], set[asyncio.Future]] = {}


def _wake_parked(loop: asyncio.AbstractEventLoop, key: tuple[int, int]) -> None:
    futs = _parked.pop(key, ())
    loop.remove_reader(key[1])
    for f in futs:
        if not f.done():
            f.set_result(True)


def forget_closed_loops() -> None:
    """Drop the waits that tasks of closed event loops left parked on descriptors (a
    loop closed while they waited: they will never run again). Without this their
    futures, and with them the tasks and the loops, are never freed; a later loop never
    shares an entry with them (a parked future holds its loop, so its id is not reused
    while the entry is there)."""
    for key, futs in list(_parked.items()):
        if any(f.get_loop().is_closed() for f in futs):
            _parked.pop(key, None)


async def wait_fd(fd: int, timeout: float | None) -> bool:
    """Park the running task until ``fd`` is readable (True) or ``timeout`` seconds
    passed (False; None: no limit). Never blocks the loop; any number of tasks may wait
    on one fd; a cancelled or timed-out wait leaves no reader behind once no task
    waits."""
    timeout = check_timeout(timeout)
    loop = asyncio.get_running_loop()
    key = (id(loop), fd)
    fut = loop.create_future()
    futs = _parked.get(key)
    if futs is None:
        # The reader first: if add_reader raises (a descriptor closed under the caller),
        # no empty entry is left, which would keep a later wait on a new descriptor of
        # the same number from registering its reader (woken by its timeout only).
        loop.add_reader(fd, _wake_parked, loop, key)
        futs = _parked[key] = set()
    futs.add(fut)
    handle = None
    if timeout is not None:
        handle = loop.call_later(max(timeout, 0.0), lambda: fut.done() or fut.set_result(False))
    try:
        return await fut
    finally:
        if handle is not None:
            handle.cancel()
        futs.discard(fut)
        if not futs and _parked.get(key) is futs:
            del _parked[key]
            loop.remove_reader(fd)


async def send_async(
    channel: AsyncSender, rtype: int, payload: Any, *, timeout: float | None = None, alive: Alive | None = None
) -> None:
    """``send`` for an event loop: while the channel has no room, the task parks on the
    channel's ``send_fd()`` (the loop keeps running other tasks; no polling). Raises as
    ``send``."""
    timeout = check_timeout(timeout)
    try:
        return channel.send_nowait(rtype, payload)
    except WouldBlock:
        pass
    try:
        await _send_parked(channel, rtype, payload, timeout, alive)
    except GeneratorExit:
        # The coroutine was closed unfinished: its loop closed and the collector freed
        # the task, in whatever thread it ran, which may hold the channel's send lock.
        # Nothing is taken here; whoever forgets the closed loop's sends gives the
        # message up (``OrderedSendsAsync.reset``).
        raise
    except BaseException:
        channel.abandon(payload)  # half-sent: the next other message may go first
        raise


async def _send_parked(channel: AsyncSender, rtype: int, payload: Any, timeout: float | None,
                       alive: Alive | None) -> None:
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        channel.arm_send()
        try:
            return channel.send_nowait(rtype, payload)
        except WouldBlock:
            pass
        if deadline is None:
            slice_s = LIVENESS_S
        else:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerNotConsumingError(
                    f"the peer is not consuming: no room for the message within {timeout} s")
            slice_s = min(left, LIVENESS_S)
        ready = await wait_fd(channel.send_fd(), slice_s)
        if not ready and alive is not None and not alive():
            try:
                return channel.send_nowait(rtype, payload)
            except WouldBlock:
                raise PeerDeadError("the peer is gone: its liveness check failed while we waited") from None


# The readers are written over the waits above (imported last: they use this module's
# ``recv``, ``recv_spin`` and ``LIVENESS_S``).
from .loop_reader import LoopReader, Parking  # noqa: E402
from .thread_reader import ThreadReader  # noqa: E402
from .ordered import OrderedSends, OrderedSendsAsync  # noqa: E402
