"""``AsyncMPClient``: the MP client for asyncio frontends.

Top layer: imports client_mp, waiting and asyncio. The protocol is ``MPClient``'s; the
waiting is ``shmclient.waiting``'s: its ``LoopReader`` watches the output ring's wake pipe
(``transport="shm"``) or the ZMQ socket's FD and drains the channel into ``_dispatch``
whenever something arrives, so utility replies and outputs are handled in the loop even
with no caller waiting; ``get_output_async`` spins on the ring for at most ``spin_us``
(adaptive), then parks; ``send_async`` parks on the request ring's space pipe while it is
full. A client that merges several engines' outputs (``client_dp``) has them forwarded
(``forward_outputs``) into its own stream instead. Its contract (the API, start-up and
shutdown from a running loop, which loop it binds to): docs/design.md, "Module notes",
``shmclient.client_async``.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable

from .config import EngineConfig
from . import waiting
from .channel import REQ_ABORT, REQ_ADD, REQ_UTILITY
from .client_mp import MPClient, _check_timeout
from .client_utilities import AsyncUtilities
from .errors import (NOT_SENT, EngineDeadError, PeerDeadError, PeerNotConsumingError, ProtocolError,
                     UsageError)
from .messages import EngineCoreOutputs, EngineCoreRequest


#: How often a send that found the engine gone looks whether the client learnt of it.
_DEATH_POLL_S = 0.005


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

    def __init__(self, config: EngineConfig, *, _abandon: threading.Event | None = None) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        #: Set by ``forward_outputs``: told of the engine's death, after its last outputs.
        self._forward_dead: Callable[[EngineDeadError], None] | None = None
        self._death_task: asyncio.Task | None = None
        super().__init__(config, _abandon=_abandon)
        self.resources.before_close(self._reader.unwatch_hook())

    def _make_sends(self):
        return waiting.OrderedSendsAsync(self.channel, self.resources.alive, self._is_gone)

    def _make_reader(self) -> waiting.LoopReader:
        # Spin on the ring before parking the task (waking an event loop costs tens of µs
        # on small virtual machines), but never longer than spin_us: the loop's other
        # tasks wait meanwhile.
        config = self.config
        return waiting.LoopReader(
            self.channel, self._dispatch, lead=self._lead, closed=self._is_closed,
            dead=self.resources.dead.is_set, dead_error=self._dead_error,
            broken=self._channel_broken,
            spin_s=config.spin_us * 1e-6 if config.transport == "shm" else 0.0)

    @classmethod
    async def create(cls, config: EngineConfig) -> "AsyncMPClient":
        """Build the client from a running loop without blocking it: the engine starts
        in a thread (seconds for a model). Raises what the constructor raises;
        cancelled, the client built after all is shut down."""
        from .client import build_in_thread

        return await build_in_thread(cls, config)

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
        self._sends.reset()  # a closed loop's sends will never take their turns
        self._reader.bind(loop)
        return loop

    def forward_outputs(self, sink: Callable[[EngineCoreOutputs], None], parking: waiting.Parking,
                        on_dead: Callable[[EngineDeadError], None]) -> None:
        """For a client that merges several engines into one stream (the data-parallel
        clients): from now on every output batch goes to ``sink(outputs)`` in the loop,
        not to ``get_output_async``; ``parking``'s tasks are woken after each read that
        brought any; once the engine is gone, ``on_dead(error)`` is called in the loop
        after what it wrote before dying went to ``sink``. Binds the client to the
        running loop; raises UsageError (another loop) or EngineDeadError."""
        self._bind_loop()
        self._put = sink
        self._reader.parking = parking
        self._forward_dead = on_dead

    def stop_watching(self) -> None:
        """Stop the bound loop watching this client's channel (nothing is read in the
        loop from then on): for a client about to be shut down, from the loop's thread,
        by another thread (the data-parallel clients' engine stops), which would only
        queue that to the loop while the loop may not turn before the channel's
        descriptor is closed and its number reused. At once on the loop's thread
        (queued to the loop from another); once; never blocks."""
        self._reader.unwatch_hook()()

    def stop_engine(self) -> None:
        """Tell the engine to stop now, closing nothing: for a data-parallel client
        whose event loop is bound but idle when another engine died (this client's
        ``shutdown`` closes the channel's descriptors, which that loop must stop
        watching first, on its own thread). From here on the engine's exit is the
        client's doing (no death is reported; calls raise EngineDeadError): a local
        engine gets SIGTERM, a remote one ``Shutdown`` from its monitor. ``shutdown``
        must still follow (it closes the channel and reaps the process). Any thread;
        never blocks; a no-op once the client was shut down."""
        res = self.resources
        if self._forked or res.shut_down:
            return
        res.begin_shutdown()
        proc = res.proc
        if proc is not None:
            try:
                proc.terminate()  # (a no-op once the process was reaped)
            except OSError:
                pass

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
        """Loop thread, once the engine is gone or the client shut down: every call
        still waiting fails. After a death, what the engine wrote before dying is read
        first (a utility's reply then resolves its call, as vLLM's does; a data-parallel
        client gets the outputs before the death report); after a shutdown at once
        (nothing more is read)."""
        if self._closed or self._loop is None:
            self._fail_waiting()
        elif self._death_task is None:
            self._death_task = self._loop.create_task(self._after_death())

    async def _after_death(self) -> None:
        try:
            await self._reader.read_remains()
        finally:
            self._fail_waiting()

    def _fail_waiting(self) -> None:
        self._fail_all_futures()
        self._reader.parking.wake()
        report, self._forward_dead = self._forward_dead, None
        if report is not None:
            report(self._dead_error())

    # -- async API --------------------------------------------------------------------
    async def _send_async(self, rtype: int, payload: Any, timeout: float | None = None) -> None:
        """Send without blocking the loop: while the request ring is full the task parks
        on its space pipe (the reader callback keeps handling outputs meanwhile)."""
        try:
            try:
                self._ensure_alive()
                await self._sends.send(rtype, payload, timeout)
            except (*NOT_SENT, asyncio.CancelledError):  # (cancelled only while it waited)
                self.channel.discard(rtype, payload)  # its tensors' blocks come back now
                raise
        except PeerDeadError as e:  # ClientClosedError too: the channel closed under us
            raise await self._send_dead_error_async(e) from e
        except PeerNotConsumingError as e:
            raise self._stalled(timeout) from e
        except ProtocolError as e:  # the engine broke the request ring's protocol
            raise self._channel_broken(e) from e

    async def _send_dead_error_async(self, e: PeerDeadError) -> EngineDeadError:
        """``_send_dead_error`` without blocking the loop: the dead event is looked at
        every few ms (a threading event: the monitor thread sets it), for at most
        ``DEATH_NOTICE_S``."""
        if self._seen_dead(e):
            loop = asyncio.get_running_loop()
            end = loop.time() + self.DEATH_NOTICE_S
            dead = self.resources.dead
            while not dead.is_set() and loop.time() < end:
                await asyncio.sleep(_DEATH_POLL_S)
            self._mark_seen_dead(e)
        return self._dead_error()

    async def add_request_async(self, request: EngineCoreRequest, timeout: float | None = None) -> None:
        """Validate (InvalidRequestError naming the field, raised before anything is
        sent) and queue. While the request ring is full the task waits for room without
        blocking the loop, ``timeout`` seconds at most (None: as long as the engine
        lives), then PeerNotConsumingError (a ``TimeoutError``; the request was not sent
        and may be added again). EngineDeadError once the engine is gone or the client
        was shut down."""
        await self._add_async(request, _check_timeout("add_request_async", timeout), False)

    async def _add_checked_async(self, request: EngineCoreRequest, timeout: float | None) -> None:
        """``add_request_async`` for a caller that ran ``check_request`` on ``request``
        against this engine's limits (or stricter ones) and checked ``timeout``: the data-
        parallel clients, so that a request is checked once. The live-id check stays."""
        await self._add_async(request, timeout, True)

    async def _add_async(self, request: EngineCoreRequest, timeout: float | None, checked: bool) -> None:
        self._bind_loop()
        self._admit(request, checked)
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

    async def get_output_async(self, timeout: float | None = None) -> EngineCoreOutputs:
        """The next output batch; waits without blocking the loop, ``timeout`` seconds
        at most (None: no limit), then PeerNotProducingError (a ``TimeoutError``). Once
        the engine died, the outputs it wrote before dying still come first (as
        vLLM's), then EngineDeadError; EngineDeadError too once the client was shut
        down."""
        outputs = self._outputs
        reader = self._reader
        # An output that is already queued, or that a short spin catches, returns
        # without suspending the task; a consumer keeping pace with a fast engine would
        # then never let the loop run its other tasks. So a call yields to the loop
        # first when the task has not been suspended for a while (``turn_due``).
        if reader.turn_due():
            await asyncio.sleep(0)
        if outputs and not self._closed:
            return outputs.popleft()
        timeout = _check_timeout("get_output_async", timeout)
        loop = self._bind_loop()
        await reader.wait(outputs.__len__, None if timeout is None else loop.time() + timeout)
        return outputs.popleft()

    async def call_utility_async(self, method: str, *args: Any,
                                 timeout: float | None = None) -> Any:
        """Call ``method(*args)`` in the engine and await its result, ``timeout``
        seconds at most (None: as long as the engine lives); see
        ``SyncEngineCoreClient.call_utility`` for the errors."""
        timeout = _check_timeout("call_utility_async", timeout)
        loop = self._bind_loop()
        deadline = None if timeout is None else loop.time() + timeout
        fut = loop.create_future()
        call_id, payload = self._register_call(method, args, fut)
        try:
            await self._send_async(REQ_UTILITY, payload, timeout)
        except BaseException:
            self._futures.pop(call_id, None)
            # Nobody awaits ``fut`` now. The engine's death may have failed it while the
            # send waited for room (the send raises that death itself): read its error,
            # or asyncio logs "Future exception was never retrieved" at ERROR.
            if fut.done():
                if not fut.cancelled():
                    fut.exception()
            else:
                fut.cancel()
            raise
        if deadline is None:
            try:
                return await fut
            except asyncio.CancelledError:  # (the caller's; a reply now would be dropped)
                self._futures.pop(call_id, None)
                raise
        try:
            # (``asyncio.wait`` never cancels ``fut``: it is unregistered first)
            await asyncio.wait((fut,), timeout=max(0.0, deadline - loop.time()))
        except asyncio.CancelledError:
            self._futures.pop(call_id, None)
            fut.cancel()  # (nobody reads it now: an error set later would be logged)
            raise
        if fut.done():
            return fut.result()
        self._futures.pop(call_id, None)  # (a late reply is dropped)
        fut.cancel()
        raise self._no_reply(method, timeout)

    async def _utility(self, method: str, *args: Any) -> Any:
        return await self.call_utility_async(method, *args)

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the engine and free everything, blocking the calling thread for up to
        about ``timeout + 2`` s (None meaning ``DEFAULT_SHUTDOWN_TIMEOUT_S``; from a
        running loop use ``shutdown_async``); pending and later calls raise
        EngineDeadError. Idempotent; interrupted, the stop goes on and another call
        waits for it."""
        on_loop = (self._loop is not None and not self._loop.is_closed()
                   and _running_loop() is self._loop)
        if on_loop:
            # The loop cannot turn while this blocks: stop watching the channel's
            # descriptor here, before the shutdown's thread closes it.
            self.stop_watching()
        super().shutdown(timeout)
        if on_loop:
            self._fail_in_loop()

    async def shutdown_async(self, timeout: float | None = None) -> None:
        """``shutdown`` without blocking the loop (it runs in a thread); pending calls
        get EngineDeadError at once. Idempotent; cancelled, the stop goes on and another
        call waits for it."""
        from .client import shutdown_timeout

        timeout = shutdown_timeout(timeout)
        loop = asyncio.get_running_loop()
        if self._forked:
            return
        if self._loop is loop and not loop.is_closed() and not self._closed:
            self.stop_watching()
        if not self.resources.shut_down:
            await loop.run_in_executor(None, self.shutdown, timeout)
        if self._loop is loop and not loop.is_closed():
            self._fail_in_loop()


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
