"""``AsyncMPClient``: the MP client for asyncio frontends.

Top layer: imports client_mp, waiting and asyncio. Like pyzmq's asyncio socket over its
sync one, it tries the channel at once and waits on a file descriptor only when it would
block (``shmclient.waiting``): for outputs, the output ring's wake pipe
(``transport="shm"``) or the ZMQ socket's FD, registered with ``loop.add_reader``, whose
callback drains the channel whenever something arrives, so utility replies and outputs
are handled in the loop even with no caller waiting, without a thread hop per message;
for room in a full request ring, the ring's space pipe. Before parking,
``get_output_async`` may spin on the ring for at most ``spin_us`` (adaptive, and it stops
spinning on a host where that does not pay), so the loop is never held longer.

The API is the ``*_async`` forms only (no inherited blocking method that raises):
``add_request_async``, ``get_output_async``, ``abort_requests_async``,
``call_utility_async`` and one per named utility, written out (as vLLM's AsyncMPClient)
so that type checkers and IDEs see them; a test keeps the list in step with
``UTILITY_METHODS``. Start-up and shutdown block for up to seconds, so from a running
loop use ``await AsyncMPClient.create(config)`` and ``await shutdown_async()`` (or
``async with``), which run them in a thread. The client binds to the first running loop
that uses it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from .config import EngineConfig
from . import waiting
from .channel import REQ_ABORT, REQ_ADD, REQ_UTILITY
from .client_mp import MPClient, _check_timeout
from .client_utilities import AsyncUtilities
from .doorbell import Spin
from .errors import (
    ClientClosedError,
    EngineDeadError,
    PeerDeadError,
    PeerNotConsumingError,
    PeerNotProducingError,
    ProtocolError,
    UsageError,
)
from .launcher import weak_callback
from .messages import EngineCoreOutputs, EngineCoreRequest


class AsyncMPClient(AsyncUtilities, MPClient):
    """The multiprocess client for asyncio frontends: ``make_client(True, True, config)``.

    Use the ``*_async`` methods from one event loop (the first that calls one binds the
    client; another loop gets ``UsageError``). None of them holds the loop for longer
    than a short spin (at most ``spin_us``): a task waiting for output, or for room in
    a full request ring, parks on a file descriptor. Build it from a running loop with
    ``await AsyncMPClient.create(config)`` (start-up runs in a thread) and close it with
    ``await shutdown_async()`` or ``async with``. Errors are those of the sync client.
    """

    _asyncio = True
    #: A task taking outputs that were already queued yields to the loop at least this
    #: often (see get_output_async).
    YIELD_EVERY_S = 200e-6
    #: Most messages one read in the loop decodes (a backlog of thousands would hold
    #: the loop for milliseconds); the rest are read in the next turn of the loop. 16
    #: rather than 64 took a busy engine's p99 delay of a concurrent 1 ms sleep from
    #: 321-405 to 278-328 µs, at the same outputs/s (16 streams: 516k against 509k).
    READ_LIMIT = 16

    def __init__(self, config: EngineConfig) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiters: set[asyncio.Future] = set()
        self._fd: int | None = None
        super().__init__(config)
        # Spin on the ring before parking the task (waking an event loop costs tens of µs
        # on small virtual machines), adaptively as the ring's own waits do, but never
        # longer than spin_us: the loop's other tasks wait meanwhile.
        self._spin = Spin(config.spin_us * 1e-6 if config.transport == "shm" else 0.0)
        self._last_yield = 0.0
        self.resources.before_close(self._remove_reader_hook())

    @classmethod
    async def create(cls, config: EngineConfig) -> "AsyncMPClient":
        """Build the client from a running loop without blocking it: the engine starts
        in a thread (seconds for a model). Raises what the constructor raises."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, cls, config)

    async def __aenter__(self) -> "AsyncMPClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.shutdown_async()

    # -- loop binding -----------------------------------------------------------------
    def _bind_loop(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return loop
        if self._loop is not None and not self._loop.is_closed():
            raise UsageError("this AsyncMPClient is already used by another event loop")
        self._ensure_alive()
        self._loop = loop
        self._fd = self.channel.recv_fd()
        loop.add_reader(self._fd, weak_callback(self._on_readable))
        return loop

    def _remove_reader_hook(self) -> Any:
        # Holds only what it needs (not the client), so it can run from the finalizer.
        state = self.__dict__

        def remove() -> None:
            loop, fd = state.get("_loop"), state.get("_fd")
            if loop is None or fd is None or loop.is_closed():
                return
            try:
                if _running_loop() is loop:
                    loop.remove_reader(fd)
                else:
                    loop.call_soon_threadsafe(loop.remove_reader, fd)
            except RuntimeError:
                pass

        return remove

    def _on_readable(self) -> None:
        """Loop reader: drain the channel whenever something was published, so replies
        and outputs are handled even with no task waiting."""
        if not self._lead.acquire(False):
            return  # a task is reading right now, or shutdown is closing the channel
        try:
            if self._closed:
                return
            self.channel.arm_recv()
            try:
                got = self.channel.try_recv(self.READ_LIMIT)
            except (PeerDeadError, ClientClosedError):
                got = []
            except ProtocolError as e:
                self._channel_broken(e)
                got = []
            if got:
                self._dispatch(got)
                self._wake_waiters()
                if len(got) >= self.READ_LIMIT and self._loop is not None:
                    # more may be waiting: read on after the loop's other tasks ran (an
                    # edge-triggered socket descriptor would not signal them again)
                    self._loop.call_soon(weak_callback(self._on_readable))
            if self.channel.peer_closed and self._loop is not None and self._fd is not None:
                # The engine closed its end (it is exiting): stop watching a descriptor
                # that now stays readable; the monitor reports the death to waiters.
                self._loop.remove_reader(self._fd)
        finally:
            self._lead.release()

    def _wake_waiters(self) -> None:
        for w in self._waiters:
            if not w.done():
                w.set_result(None)

    def _on_engine_dead(self) -> None:
        """Monitor thread: hand the news to the loop (futures belong to it)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return  # no loop bound: no future or waiter exists
        try:
            loop.call_soon_threadsafe(self._fail_in_loop)
        except RuntimeError:  # loop closed meanwhile
            pass

    def _fail_in_loop(self) -> None:
        self._fail_all_futures()
        self._wake_waiters()

    def _read_now(self, spin: float) -> None:
        """Read and dispatch what is there (spinning up to ``spin`` seconds for it),
        unless another task or shutdown holds the channel."""
        if not self._lead.acquire(False):
            return
        try:
            if self._closed or self.resources.dead.is_set():
                return
            try:
                got = waiting.recv_spin(self.channel, spin, self.READ_LIMIT)
            except (PeerDeadError, ClientClosedError):
                # Dead peer: the monitor's report wakes the waiters with its reason.
                got = []
            except ProtocolError as e:
                self._channel_broken(e)
                got = []
            if got:
                self._dispatch(got)
                self._wake_waiters()
                if len(got) >= self.READ_LIMIT and self._loop is not None:
                    self._loop.call_soon(weak_callback(self._on_readable))  # read on later
        finally:
            self._lead.release()

    # -- async API --------------------------------------------------------------------
    async def _send_async(self, rtype: int, payload: Any, timeout: float | None = None) -> None:
        """Send without blocking the loop: while the request ring is full the task parks
        on its space pipe (the reader callback keeps handling outputs meanwhile)."""
        self._ensure_alive()
        try:
            await waiting.send_async(self.channel, rtype, payload, timeout=timeout,
                                     alive=self.resources.alive)
        except PeerDeadError as e:  # ClientClosedError too: the channel closed under us
            raise self._dead_error() from e
        except PeerNotConsumingError as e:
            raise self._stalled(timeout) from e

    async def add_request_async(self, request: EngineCoreRequest, timeout: float | None = None) -> None:
        """Validate (InvalidRequestError naming the field, raised before anything is
        sent) and queue. While the request ring is full the task waits for room without
        blocking the loop, ``timeout`` seconds at most (None: as long as the engine
        lives), then PeerNotConsumingError (a ``TimeoutError``; the request was not sent
        and may be added again). EngineDeadError once the engine is gone or the client
        was shut down."""
        timeout = _check_timeout("add_request_async", timeout)
        self._bind_loop()
        self._admit(request)
        try:
            await self._send_async(REQ_ADD, self.channel.encode(request), timeout)
        except BaseException:
            self._live.discard(request.request_id)
            raise

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        """Abort requests; rides the same ordered ring as the adds. InvalidRequestError
        for ids that are not a list of str; a quiet no-op for [] or once the engine is
        dead. Waits (without blocking the loop) only while the request ring is full."""
        ids = self._abort_ids(request_ids)
        if not ids:
            return
        self._bind_loop()
        try:
            await self._send_async(REQ_ABORT, self.channel.encode(ids))
        except EngineDeadError:
            pass

    async def _read_remains_async(self) -> None:
        """Once the engine died: read what it wrote before dying and queue it, without
        blocking the loop. The zmq transport gets a short grace for its last messages
        (polled with awaits); the rings hold everything already."""
        zmq_grace = self.channel.late_after_peer_death
        deadline = time.monotonic() + self._ZMQ_REMAINS_GRACE_S
        while not self._remains_read and not self._closed:
            if self._lead.acquire(False):  # else a reader callback is on it right now
                try:
                    if self._remains_read or self._closed:
                        return
                    got = self._take_remains(0.0)
                    if got:
                        self._dispatch(got)
                    if got or not zmq_grace or time.monotonic() >= deadline:
                        return
                    self._remains_read = False  # zmq: look again until the grace ends
                finally:
                    self._lead.release()
            await asyncio.sleep(0.005)

    async def get_output_async(self, timeout: float | None = None) -> EngineCoreOutputs:
        """The next output batch; waits without blocking the loop, ``timeout`` seconds
        at most (None: no limit), then PeerNotProducingError (a ``TimeoutError``). Once
        the engine died, the outputs it wrote before dying still come first (as
        vLLM's), then EngineDeadError; EngineDeadError too once the client was shut
        down."""
        outputs = self._outputs
        # An output that is already queued, or that a short spin catches, returns
        # without suspending the task; a consumer keeping pace with a fast engine would
        # then never let the loop run its other tasks. So a call yields to the loop
        # first when the task has not been suspended for YIELD_EVERY_S.
        now = time.perf_counter()
        if now - self._last_yield > self.YIELD_EVERY_S:
            self._last_yield = now
            await asyncio.sleep(0)
        if outputs:
            return outputs.popleft()
        timeout = _check_timeout("get_output_async", timeout)
        loop = self._bind_loop()
        spin = self._spin
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            if self._closed:
                raise self._dead_error()
            if self.resources.dead.is_set():
                await self._read_remains_async()
                if outputs:
                    return outputs.popleft()
                raise self._dead_error()
            self._read_now(min(spin.budget, spin.base))
            if outputs:
                spin.after(True, 0.0)  # the spin paid
                return outputs.popleft()
            if deadline is not None and loop.time() >= deadline:
                raise PeerNotProducingError(
                    f"no output from the engine within {timeout} s (the engine is alive)")
            waiter = loop.create_future()
            self._waiters.add(waiter)
            handle = None
            if deadline is not None:
                handle = loop.call_at(deadline, lambda: waiter.done() or waiter.set_result(None))
            parked = time.perf_counter()
            try:
                await waiter
            finally:
                self._waiters.discard(waiter)
                if handle is not None:
                    handle.cancel()
            self._last_yield = now = time.perf_counter()
            spin.after_block(now - parked)  # how the wait ended steers the next spin
            if outputs:
                return outputs.popleft()

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        """Call ``method(*args)`` in the engine and await its result; see
        ``EngineCoreClient.call_utility`` for the errors."""
        loop = self._bind_loop()
        fut = loop.create_future()
        call_id, payload = self._register_call(method, args, fut)
        try:
            await self._send_async(REQ_UTILITY, payload)
        except BaseException:
            self._futures.pop(call_id, None)
            raise
        return await fut

    async def _utility(self, method: str, *args: Any) -> Any:
        return await self.call_utility_async(method, *args)

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the engine and free everything, blocking the calling thread for up to
        about ``timeout + 2`` s (None meaning ``DEFAULT_SHUTDOWN_TIMEOUT_S``; from a
        running loop use ``shutdown_async``); pending and later calls raise
        EngineDeadError. Idempotent."""
        super().shutdown(timeout)
        if self._loop is not None and not self._loop.is_closed() and _running_loop() is self._loop:
            self._fail_in_loop()

    async def shutdown_async(self, timeout: float | None = None) -> None:
        """``shutdown`` without blocking the loop (it runs in a thread); pending calls
        get EngineDeadError at once. Idempotent."""
        from .client import shutdown_timeout

        timeout = shutdown_timeout(timeout)
        loop = asyncio.get_running_loop()
        if self._closed:
            return
        await loop.run_in_executor(None, self.shutdown, timeout)
        if self._loop is loop and not loop.is_closed():
            self._fail_in_loop()


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
