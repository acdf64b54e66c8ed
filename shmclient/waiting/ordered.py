"""Sends in call order: one sender's messages on one channel leave in the order they
were sent, as on vLLM's socket, though some wait for room in the ring.

A send goes at once while none of its sender's sends waits for room; otherwise it takes
a turn behind those that do, first come first served, and the one whose turn it is waits
for room (``send`` / ``send_async``). Without the turns a small message (an abort, a
pause) would overtake a larger one waiting for room, in the room left at the ring's
start: an abort of a request the engine has not seen yet is ignored, and the request
runs to its end although ``abort_requests`` returned.

The try and the taking of a turn are one step (under a C lock in threads; with no
``await`` between them in a loop), so a message whose first fragments the try wrote is
first in line. Whatever ends a send (an error, a timeout, a signal, a cancelled task)
gives its half-sent message up (``abandon``) and hands the turn on.
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from collections import deque
from typing import Any, Callable

from ..errors import PeerDeadError, PeerNotConsumingError, WouldBlock, mark_not_sent
from . import LIVENESS_S, Alive, check_timeout, forget_closed_loops, send, send_async
from .protocols import AsyncSender, Sender

__all__ = ["OrderedSends", "OrderedSendsAsync"]


def _gone_error() -> PeerDeadError:
    return PeerDeadError("the peer is gone (this message was waiting for its turn)")


def _no_room(timeout: float | None) -> PeerNotConsumingError:
    return PeerNotConsumingError(
        f"the peer is not consuming: no room for the message within {timeout} s "
        "(earlier messages of this sender were still waiting for room)")


class OrderedSends:
    """One sender's sends on ``channel`` in call order, from any number of threads.
    ``alive()``: the peer lives (``waiting.send``'s check); ``gone()``: a cheap flag, the
    peer is known dead or the sender closed (a queued send then fails at once, with the
    ones before it)."""

    def __init__(self, channel: Sender, alive: Alive | None, gone: Callable[[], bool]) -> None:
        self.channel = channel
        self._alive = alive
        self._gone = gone
        self._lock = threading.Lock()  # (a C lock: ``with`` leaves no signal window)
        self._turn = threading.Condition(self._lock)
        self._queue: deque[object] = deque()

    def queued(self) -> int:
        """How many sends wait for room or for their turn."""
        return len(self._queue)

    def send(self, rtype: int, payload: Any, timeout: float | None = None) -> None:
        """``waiting.send`` in call order. ``timeout`` (None or inf: none) covers the
        turn and the wait for room. Raises as ``waiting.send``, and PeerDeadError at
        once while queued once ``gone()``."""
        timeout = check_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        lock, queue = self._lock, self._queue
        ticket = None
        try:
            with lock:
                if not queue:
                    try:
                        return self.channel.send_nowait(rtype, payload)
                    except WouldBlock:
                        pass  # (the fragments that fit went: this send is first from here)
                ticket = object()
                queue.append(ticket)
                if queue[0] is not ticket:
                    try:
                        self._wait_turn(ticket, deadline, timeout)
                    except BaseException as e:  # (nothing of this message went)
                        mark_not_sent(e)
                        raise
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            send(self.channel, rtype, payload, timeout=left, alive=self._alive)
        except BaseException:
            # (a signal after the try wrote the first fragments of a long message, before
            # waiting.send took it over: other messages may go first now)
            self.channel.abandon(payload)
            raise
        finally:
            if ticket is not None:
                with lock:
                    if ticket in queue:
                        first = queue[0] is ticket
                        queue.remove(ticket)
                        if first:
                            self._turn.notify_all()

    def _wait_turn(self, ticket: object, deadline: float | None, timeout: float | None) -> None:
        """Wait (holding the lock, released while asleep) until ``ticket`` is first, in
        slices that look at ``gone()``; PeerNotConsumingError at ``deadline``."""
        queue, gone = self._queue, self._gone
        while queue[0] is not ticket:
            if gone():
                raise _gone_error()
            left = LIVENESS_S if deadline is None else min(LIVENESS_S, deadline - time.monotonic())
            if left <= 0:
                raise _no_room(timeout)
            self._turn.wait(left)
        if gone():  # the ones before it failed for that: this one at once
            raise _gone_error()


class OrderedSendsAsync:
    """One sender's sends on ``channel`` in call order, from the tasks of one event
    loop (``reset`` when the sender moves to another). ``alive`` and ``gone`` as for
    ``OrderedSends``."""

    def __init__(self, channel: AsyncSender, alive: Alive | None, gone: Callable[[], bool]) -> None:
        self.channel = channel
        self._alive = alive
        self._gone = gone
        self._turns: deque[asyncio.Future] = deque()
        self._tasks: set[asyncio.Task] = set()
        #: The message of each turn taken: (rtype, payload).
        self._messages: dict[asyncio.Future, tuple[int, Any]] = {}
        #: The turns ``reset`` gave up: their coroutines, closed when their tasks are
        #: freed, touch nothing.
        self._forgotten: "weakref.WeakSet[asyncio.Future]" = weakref.WeakSet()

    def queued(self) -> int:
        """How many sends wait for room or for their turn."""
        return len(self._turns)

    def reset(self) -> None:
        """Forget the sends of a closed loop (their tasks will never run again). Their
        messages will never go: each is discarded (``channel.discard``), so that one left
        half-way in the ring no longer holds back every later send and the pending tensor
        releases, and their tensors' blocks come back. The waits the closed loop's tasks
        left parked are dropped too, so that those tasks and the loop can be freed."""
        messages, self._messages = self._messages, {}
        self._forgotten.update(self._turns)
        self._turns.clear()
        self._tasks.clear()
        for rtype, payload in messages.values():
            self.channel.discard(rtype, payload)
        forget_closed_loops()

    async def send(self, rtype: int, payload: Any, timeout: float | None = None) -> None:
        """``waiting.send_async`` in call order; ``timeout`` covers the turn and the wait
        for room. Raises as it, and PeerDeadError once ``gone()`` while queued."""
        timeout = check_timeout(timeout)
        sent = False
        turn = None
        try:  # (from the first try on: a signal anywhere gives the message up)
            if not self._turns:
                try:
                    self.channel.send_nowait(rtype, payload)
                    sent = True
                    return
                except WouldBlock:
                    pass  # (the fragments that fit are out: this send is first from here)
            loop = asyncio.get_running_loop()
            turn = loop.create_future()
            self._messages[turn] = (rtype, payload)
            deadline = self._enqueue(turn, loop, timeout)
            await self._in_turn(turn, rtype, payload, deadline, timeout)
        finally:
            if not sent:
                self._leave(turn, payload)

    def start(self, rtype: int, payload: Any, timeout: float | None = None,
              failed: "Callable[[BaseException], BaseException] | None" = None) -> "asyncio.Future | None":
        """Send now when nothing waits before this message and there is room (None);
        else take its turn now (the order is the order of the calls) and return a
        future that a task sending it in its turn completes: with what ``send`` raises,
        or what ``failed(e)`` returns for it (``failed`` also sees a cancellation of
        the task, at shutdown, even one before the task ran). Cancelling the
        future (the caller gave up waiting) does not stop the send: as on a socket, the
        message goes. However the task ends, its turn is handed on."""
        timeout = check_timeout(timeout)
        sent = False
        turn = task = None
        try:
            if not self._turns:
                try:
                    self.channel.send_nowait(rtype, payload)
                    sent = True
                    return None
                except WouldBlock:
                    pass
            loop = asyncio.get_running_loop()
            turn = loop.create_future()
            self._messages[turn] = (rtype, payload)
            deadline = self._enqueue(turn, loop, timeout)
            done = loop.create_future()
            ran: list[bool] = []
            task = loop.create_task(self._started(turn, rtype, payload, deadline, timeout, failed, ran))
            self._tasks.add(task)
            task.add_done_callback(lambda t: self._finished(t, turn, payload, failed, ran, done))
            return done
        except BaseException:
            if not sent:
                if task is not None:
                    task.cancel()  # (its callback hands on what it holds)
                self._leave(turn, payload)
            raise

    def tasks(self) -> "list[asyncio.Task]":
        """The tasks of ``start`` still running (any thread may look; a shutdown cancels
        them on their loop)."""
        return list(self._tasks)

    async def _started(self, turn: asyncio.Future, rtype: int, payload: Any, deadline: float | None,
                       timeout: float | None, failed: "Callable[[BaseException], BaseException] | None",
                       ran: list) -> None:
        ran.append(True)
        try:
            await self._in_turn(turn, rtype, payload, deadline, timeout)
        except BaseException as e:
            if failed is None:
                raise
            error = failed(e)
            if error is e:
                raise
            raise error from None

    def _finished(self, task: asyncio.Task, turn: asyncio.Future, payload: Any,
                  failed: "Callable[[BaseException], BaseException] | None", ran: list,
                  done: asyncio.Future) -> None:
        """``start``'s task is over: its turn handed on, its future completed."""
        self._tasks.discard(task)
        self._leave(turn, payload)
        if task.cancelled():
            error: BaseException = asyncio.CancelledError()
            if not ran and failed is not None:  # cancelled before it ran: ``failed`` never saw it
                error = failed(error)
        else:
            error = task.exception()
        if done.done():  # (the caller gave up waiting)
            return
        if error is None:
            done.set_result(None)
        elif isinstance(error, asyncio.CancelledError):
            done.cancel()
        else:
            done.set_exception(error)

    def _enqueue(self, turn: asyncio.Future, loop: asyncio.AbstractEventLoop, timeout: float | None) -> float | None:
        """Put ``turn`` last in line (first: its turn now); its deadline."""
        deadline = None if timeout is None else loop.time() + timeout
        self._turns.append(turn)
        if self._turns[0] is turn:
            turn.set_result(None)
        return deadline

    async def _in_turn(self, turn: asyncio.Future, rtype: int, payload: Any, deadline: float | None,
                       timeout: float | None) -> None:
        try:
            if not turn.done():
                loop = asyncio.get_running_loop()
                # asyncio.wait leaves ``turn`` alone at the timeout: no turn handed over
                # just then is lost (``_leave`` hands it on).
                await asyncio.wait((turn,), timeout=None if deadline is None else max(0.0, deadline - loop.time()))
                if self._gone():  # what went before failed for that: this one at once
                    raise _gone_error()
                if not turn.done():
                    raise _no_room(timeout)
            left = None if deadline is None else max(0.0, deadline - asyncio.get_running_loop().time())
            await send_async(self.channel, rtype, payload, timeout=left, alive=self._alive)
        finally:
            self._leave(turn, payload)

    def _leave(self, turn: "asyncio.Future | None", payload: Any) -> None:
        """The send of ``payload`` is over (idempotent): unless it went whole, its
        half-sent message is given up; ``turn`` (None: none taken) leaves the line, and
        the next turn is handed on."""
        if turn is not None and turn in self._forgotten:
            # A closed loop's send, given up by ``reset``, its coroutine closed when its
            # task was freed: maybe in a thread that holds the channel's send lock.
            return
        self.channel.abandon(payload)  # (a no-op unless it is half-way)
        if turn is None:
            return
        self._messages.pop(turn, None)
        turns = self._turns
        if turn not in turns:
            return
        first = turns[0] is turn
        turns.remove(turn)
        if first and turns and not turns[0].done():
            turns[0].set_result(None)
