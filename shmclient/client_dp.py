"""Data-parallel clients: several engine cores behind one asyncio client, as vLLM's.

Top layer, beside ``client_async``: imports client, client_async, config, messages,
errors, validate and waiting, and uses ``AsyncMPClient`` only through its public API (one
``AsyncMPClient`` per engine, each with its own engine process and its own ring pair, so
every ring stays single-producer single-consumer); it must not import the engine, the
launcher, the channels or the rings. It owns the routing of requests to engines, the
request → engine map (aborts go to the owner), the merged output stream (each engine's
loop reader forwards its batches into one dispatch, ``_take``; tasks park on one
``waiting.Parking``), the fan-out of utility calls and the capacity the engines report
together. ``DPAsyncMPClient`` (``data_parallel_external_lb=True``): an external load
balancer runs one client per rank; this client starts and talks to its own rank only.
``client_dp_lb.DPLBAsyncMPClient`` (every rank behind one client) is this class with
its own routing; ``make_async_mp_client`` (``shmclient.client``) picks between them and
``AsyncMPClient`` with vLLM's rules.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import weakref
from collections import deque
from functools import partial
from time import perf_counter
from typing import Any

from .config import EngineConfig
from . import forksafe
from .client_utilities import DPUtilities
from .client import (EngineCoreClient, check_abort_ids, check_request, check_timeout,
                     shutdown_timeout)
from .dp_balance import work_estimate
from .dp_engines import EngineStops, engine_config, start_engines
from .errors import (ClientClosedError, ConfigError, EngineDeadError, ForkedError,
                     InvalidRequestError, PeerNotProducingError, UsageError)
from .messages import EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from .waiting import LoopReader, Parking

logger = logging.getLogger("shmclient")

_NO_STATS = SchedulerStats()

#: What each engine still running gets to exit once another died (then SIGTERM, and
#: SIGKILL 2 s later).
_DEATH_STOP_TIMEOUT_S = 1.0
#: How long ``shutdown`` waits for the engines' stops beyond their ``timeout``: an engine
#: client's shutdown takes up to about ``timeout + 2`` s (SIGTERM, then SIGKILL), a
#: little more when its reader or monitor is slow to leave.
_STOP_GRACE_S = 10.0

__all__ = ["DPAsyncMPClient", "engine_config", "start_engines"]


def __getattr__(name: str) -> Any:
    if name == "DPLBAsyncMPClient":  # its own module, which imports this one
        from .client_dp_lb import DPLBAsyncMPClient

        return DPLBAsyncMPClient
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class DPAsyncMPClient(DPUtilities, EngineCoreClient):
    """One data-parallel rank behind an external load balancer (vLLM's
    ``DPAsyncMPClient``): ``make_client(True, True, config)`` with
    ``data_parallel_size > 1`` and ``data_parallel_external_lb=True``.

    ``config.data_parallel_rank`` names this client's rank (``ConfigError`` when None:
    an external load balancer runs one client per rank). The engine is started with
    that rank and every output batch carries it as ``engine_index``. A request's
    ``data_parallel_rank`` must be None or this rank (``InvalidRequestError``).

    Construction blocks until the engine(s) are ready and raises what ``AsyncMPClient``
    raises. Engines given ready-made need ``AsyncMPClient``'s async API, its
    ``shutdown``, ``forward_outputs`` and ``on_dead`` (which reports a death, never the
    engine client's own shutdown); its ``stop_engine`` where they have one. Use the
    ``*_async`` methods from one event loop (the first that calls one binds the client;
    another loop gets ``UsageError``); none blocks the loop. As ``AsyncMPClient``, it has no blocking
    forms. When an engine dies, every pending and later call raises ``EngineDeadError``
    naming it, and the engines still alive are stopped at once, as vLLM does, whether
    or not an event loop uses the client.
    """

    def __init__(self, config: EngineConfig | None = None, *, engines: list[Any] | None = None) -> None:
        """``engines``: instead of starting them, take these engine clients, already
        started, one per managed rank in rank order (each with ``AsyncMPClient``'s
        public async API, e.g. ``AsyncMPClient(engine_config(config, rank))`` with
        another transport); from then on this client owns them (``shutdown`` stops
        them). ConfigError when their number is not the number of ranks."""
        if config is None:
            config = EngineConfig()
        self.config = config
        ranks = self._managed_ranks(config)
        #: The data-parallel rank of each engine, in order.
        self.engine_ranks: tuple[int, ...] = tuple(ranks)
        if engines is None:
            engines = start_engines(config, ranks)
        elif len(engines) != len(ranks):
            raise ConfigError(
                f"{type(self).__name__}: got {len(engines)} engine clients for ranks "
                f"{list(ranks)}: give one per rank")
        self.engines: list[Any] = list(engines)
        self.num_gpu_blocks = sum(e.num_gpu_blocks for e in self.engines)
        self.block_size = self.engines[0].block_size
        self.max_model_len = min(e.max_model_len for e in self.engines)
        #: What ``check_request`` checks a request against: the limits of the engine its
        #: ``data_parallel_rank`` names (by rank), else the group's (any engine may get it).
        self._limits = {rank: (e.max_model_len, getattr(e, "config", config))
                        for rank, e in zip(self.engine_ranks, self.engines)}
        # The engines' own sizes where they all share them (a request any of them may
        # get is checked against those); else this client's config's, and every engine
        # checks again against its own.
        configs = [getattr(e, "config", None) for e in self.engines]
        shared = None not in configs and len({(c.hidden_size, c.vocab_size) for c in configs}) == 1
        self._group_limits = (self.max_model_len, configs[0] if shared else config)
        #: Per engine: its add, without the request checks where it has one and the
        #: checks here were its own (they ran once; ``AsyncMPClient._add_checked_async``),
        #: else its public one.
        self._adds = [(getattr(e, "_add_checked_async", None) if shared else None) or e.add_request_async
                      for e in self.engines]
        #: Process id of each engine (None where an engine client does not say).
        self.engine_pids = [getattr(e, "engine_pid", None) for e in self.engines]
        n = len(self.engines)
        #: request id → (engine position, work estimate), until the request finished.
        self.reqs_in_flight: dict[str, tuple[int, int]] = {}
        #: Per engine: this client's unfinished requests, and their work in tokens.
        self.engine_inflight = [0] * n
        self.engine_work = [0] * n
        #: Per engine: the latest ``SchedulerStats`` it reported.
        self.lb_engines: list[SchedulerStats] = [_NO_STATS] * n
        #: Requests routed to each engine since start (the balance the benchmark reports).
        self.requests_routed = [0] * n
        self._outputs: deque[EngineCoreOutputs] = deque()
        #: When the task reading outputs was last suspended (see ``get_output_async``).
        self._last_turn = 0.0
        self._parking = Parking()
        #: Set once an engine died or the client shut down: no more batches are taken.
        self._halted = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead_fut: asyncio.Future | None = None
        #: Set in the loop once an engine's death was handled there (after its last
        #: outputs): from then on ``get_output_async`` raises.
        self._dead_reason: str | None = None
        #: (position, reason) of the first engine death seen, in whatever thread saw it.
        self._death: tuple[int, str] | None = None
        #: Per engine: its outputs and death are forwarded to this client's loop.
        self._forwarded = [False] * n
        self._closed = False
        #: Guards ``_death`` against ``_closed``: a death seen after shutdown began is none.
        self._death_lock = threading.Lock()
        self._stops = EngineStops(self.engines)
        self._pid = os.getpid()
        forksafe.register(self)
        # Last: an engine already gone calls back at once.
        ref = weakref.ref(self)
        for i, e in enumerate(self.engines):
            e.on_dead(partial(_engine_gone, ref, i))

    #: True in a process forked from the one that built the client (see forksafe).
    _forked = False

    def _forget_after_fork(self) -> None:
        """In a forked child: the engines are the parent's (each engine client forgets
        its own too). Every call raises ForkedError from here on; ``shutdown()`` does
        nothing. What the parent had queued is dropped from the child's copy."""
        self._forked = True
        self._closed = True
        self._outputs.clear()

    @classmethod
    async def create(cls, config: EngineConfig | None = None) -> "DPAsyncMPClient":
        """Build the client from a running loop without blocking it: the engines start
        in a thread (each in one of its own, at once). Raises what the constructor
        raises; cancelled, the engines' start gives up (those started are stopped) and
        a client built after all is shut down (a subclass whose constructor does not
        take ``engines``: the client built after all only)."""
        from .client import build_in_thread, takes_keyword

        return await build_in_thread(cls._build if takes_keyword(cls, "engines") else cls, config)

    @classmethod
    def _build(cls, config: EngineConfig | None, *, _abandon: threading.Event) -> "DPAsyncMPClient":
        """``cls(config)`` for ``create``: its engines' start gives up once ``_abandon``
        is set (``start_engines``), and the client then takes them ready-made."""
        if config is None:
            config = EngineConfig()
        engines = start_engines(config, cls._managed_ranks(config), _abandon)
        try:
            return cls(config, engines=engines)
        except BaseException:
            for e in engines:
                e.shutdown(timeout=0.0)
            raise

    # -- set-up ----------------------------------------------------------------------
    @staticmethod
    def _managed_ranks(config: EngineConfig) -> list[int]:
        rank = config.data_parallel_rank
        if rank is None:
            raise ConfigError(
                "EngineConfig.data_parallel_rank=None is invalid: with "
                "data_parallel_external_lb=True each client serves one rank; give it")
        return [rank]

    def _bind(self) -> asyncio.AbstractEventLoop:
        """Bind to the running loop on first use; each engine's reader forwards its
        batches to ``_take`` from then on."""
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return loop
        if self._loop is not None and not self._loop.is_closed():
            raise UsageError(f"this {type(self).__name__} is already used by another event loop")
        self._ensure_alive()
        self._loop = loop
        self._dead_fut = loop.create_future()
        for i, e in enumerate(self.engines):
            try:
                e.forward_outputs(partial(self._take, i), self._parking, partial(self._engine_died, i))
            except EngineDeadError as err:  # it died just now: nothing of it is forwarded
                self._engine_died(i, err)
                raise self._dead_error() from err
            self._forwarded[i] = True
        return loop

    # -- state -----------------------------------------------------------------------
    @property
    def is_dead(self) -> bool:
        """True once an engine died or the client was shut down (never resets)."""
        return self._closed or self._dead_reason is not None or any(e.is_dead for e in self.engines)

    def _dead_error(self) -> EngineDeadError:
        if self._forked:
            return ForkedError(
                f"this {type(self).__name__} belongs to process {self._pid}, whose engines it "
                f"drives; the forked child {os.getpid()} cannot use it (nothing was sent): "
                "make a new client in the child")
        if self._closed:
            return ClientClosedError("the client was shut down")
        reason = self._dead_reason
        if reason is None and self._death is not None:
            reason = self._death[1]
        if reason is None:
            dead = [self.engine_ranks[i] for i, e in enumerate(self.engines) if e.is_dead]
            if dead:
                return EngineDeadError(f"data-parallel engine {dead[0]} is dead")
        return EngineDeadError(reason)

    def _ensure_alive(self) -> None:
        if self.is_dead:
            raise self._dead_error()

    def _death_seen(self, pos: int, err: BaseException) -> bool:
        """Note engine ``pos``'s death (any thread); False when it is none (the client
        was shut down) or another was seen first."""
        with self._death_lock:
            if self._closed or self._death is not None:
                return False
            rank = self.engine_ranks[pos]
            self._death = (pos, f"data-parallel engine {rank} (pid {self.engine_pids[pos]}) "
                                f"died: {err}")
        logger.error("%s; stopping the other engines", self._death[1])
        return True

    def _note_death(self, pos: int, err: BaseException) -> None:
        """Engine ``pos`` is gone (its ``on_dead`` callback, in the thread that saw it,
        mostly its monitor's, whether or not a loop uses this client): the client is
        dead (vLLM's rule) and every other engine is stopped now. Where the loop reads
        this engine, it goes on reading what the engine wrote before dying and then
        reports the death (``_engine_died``), which stops the engine's client too;
        otherwise nothing more is read from it and it is stopped with the others. Off
        the bound loop's thread, the engine clients' stops (which close the channels
        the loop watches) are queued to the loop; a loop that is not running (idle
        between two ``run_until_complete`` calls) may not turn for a long while, so the
        other engines' processes are told to stop at once (``stop_engine``) and only
        the closing of their channels waits for the loop's turn (or ``shutdown()``)."""
        if not self._death_seen(pos, err):
            return
        loop = self._loop
        read = self._forwarded[pos] and loop is not None and not loop.is_closed()
        positions = [i for i in range(len(self.engines)) if i != pos or not read]
        if loop is not None and not loop.is_closed() and _running_loop() is not loop:
            # Off the loop that watches their channels: the loop stops watching them
            # first (``_stop_engines`` there), or a descriptor closed meanwhile could be
            # the number of the app's next socket, whose reader the loop's queued
            # unwatch would then remove.
            try:
                loop.call_soon_threadsafe(self._stop_engines, positions, _DEATH_STOP_TIMEOUT_S)
            except RuntimeError:  # closed meanwhile: nothing watches them any more
                pass
            else:
                if not loop.is_running():
                    for i in positions:
                        stop = getattr(self.engines[i], "stop_engine", None)
                        if i != pos and stop is not None:
                            stop()
                return
        self._stop_engines(positions, _DEATH_STOP_TIMEOUT_S)

    def _engine_died(self, pos: int, err: BaseException) -> None:
        """In the loop, once engine ``pos`` is gone and what it wrote before went to
        ``_take``: the client is dead (vLLM's rule): fail every waiter and pending call,
        take nothing more from the others, and stop every engine (in threads: their
        shutdown blocks): the others, if their stop has not begun yet, and the dead
        one's client, nothing more being read from it."""
        if self._dead_reason is not None or self._closed:
            return
        first = self._death
        if first is not None and first[0] != pos and self._forwarded[first[0]]:
            # Stopped for the death of ``first``, whose own report comes after its last
            # outputs.
            return
        self._death_seen(pos, err)
        if self._death is None:  # shut down meanwhile
            return
        self._dead_reason = self._death[1]
        self._fail_in_loop()
        self._stop_engines(range(len(self.engines)), _DEATH_STOP_TIMEOUT_S)

    def _fail_in_loop(self) -> None:
        self._halted = True
        if self._dead_fut is not None and not self._dead_fut.done():
            self._dead_fut.set_result(None)
        self._parking.wake()

    # -- the merged output stream ----------------------------------------------------
    def _take(self, pos: int, outs: EngineCoreOutputs) -> None:
        """The one dispatch of every engine's batches (in the loop, from its reader):
        stamped with the engine's rank, its load noted, into the merged stream."""
        if self._halted:
            return
        outs.engine_index = self.engine_ranks[pos]
        if outs.scheduler_stats is not None:
            self.lb_engines[pos] = outs.scheduler_stats
        fin = outs.finished_requests
        # An engine core that leaves finished_requests unset (vLLM's engines set it only
        # under data parallelism; a third-party core may not) still finishes requests.
        done = [o.request_id for o in outs.outputs if o.finish_reason is not None]
        if fin or done:
            flight = self.reqs_in_flight
            for rid in (*fin, *done) if fin else done:
                entry = flight.get(rid)
                if entry is not None and entry[0] == pos:
                    del flight[rid]
                    self.engine_inflight[pos] -= 1
                    self.engine_work[pos] -= entry[1]
        self._outputs.append(outs)

    async def get_output_async(self, timeout: float | None = None) -> EngineCoreOutputs:
        """The next output batch of any engine (``engine_index`` says which), in the
        order the batches arrived; waits without blocking the loop. ``timeout``: raise
        ``PeerNotProducingError`` (a ``TimeoutError``) after that many seconds with
        nothing (None: wait as long as it takes; InvalidRequestError for anything but
        None or a number >= 0, as ``AsyncMPClient``'s). Once an engine died, the batches read
        before come first, then ``EngineDeadError``; also after ``shutdown()``."""
        out = self._outputs
        # A consumer that keeps pace with the engines would find a batch queued at
        # every call and never let the loop run its other tasks: a call yields first
        # when the task has not been suspended for a while (as AsyncMPClient's).
        now = perf_counter()
        if now - self._last_turn > LoopReader.YIELD_EVERY_S:
            self._last_turn = now
            await asyncio.sleep(0)
        if out and not self._closed:
            return out.popleft()
        timeout = check_timeout("get_output_async", timeout)
        loop = self._bind()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            if self._closed:  # shut down: what was queued is not handed out any more
                raise self._dead_error()
            if out:
                return out.popleft()
            # Not ``is_dead``: what a dead engine wrote before dying comes first, and its
            # reader has forwarded all of it by the time it reports the death.
            if self._dead_reason is not None:
                raise self._dead_error()
            if deadline is not None and loop.time() >= deadline:
                raise PeerNotProducingError(
                    f"no output from the engines within {timeout} s (they are alive)")
            await self._parking.park(loop, deadline)
            self._last_turn = perf_counter()

    # -- requests --------------------------------------------------------------------
    def get_core_engine_for_request(self, request: EngineCoreRequest) -> int:
        """The position (in ``engines``) of the engine that will serve ``request``.
        Here the one engine; its ``data_parallel_rank`` must be None or this rank."""
        dpr = request.data_parallel_rank
        if dpr is not None and dpr != self.engine_ranks[0]:
            raise InvalidRequestError(
                f"request {request.request_id!r}: data_parallel_rank={dpr!r} is invalid: "
                f"this client serves rank {self.engine_ranks[0]} only")
        return 0

    def _route(self, request: EngineCoreRequest) -> tuple[int, int]:
        """Checks at the door (InvalidRequestError naming the field: the single-engine
        client's, once, before routing reads a field or moves the tie-break rotation;
        the engine's client does not check again), then the engine and the work
        estimate; records the request as in flight on that engine. A request whose
        ``data_parallel_rank`` names an engine is checked against that engine's limits
        (its ``max_model_len``, hidden and vocabulary sizes), any other against the
        group's (the smallest ``max_model_len``; the sizes every engine shares, else this
        client's config's, and the engine's client checks again)."""
        self._ensure_alive()
        dpr = getattr(request, "data_parallel_rank", None)
        max_len, config = (self._limits.get(dpr, self._group_limits) if type(dpr) is int
                           else self._group_limits)
        check_request(request, max_model_len=max_len,
                      hidden_size=config.hidden_size, vocab_size=config.vocab_size)
        rid = request.request_id
        if rid in self.reqs_in_flight:
            raise InvalidRequestError(f"request id {rid!r} is already live")
        pos = self.get_core_engine_for_request(request)
        cost = work_estimate(request)
        self.reqs_in_flight[rid] = (pos, cost)
        self.engine_inflight[pos] += 1
        self.engine_work[pos] += cost
        self.requests_routed[pos] += 1
        return pos, cost

    def _unroute(self, request: EngineCoreRequest, pos: int, cost: int) -> None:
        if self.reqs_in_flight.pop(request.request_id, None) is not None:
            self.engine_inflight[pos] -= 1
            self.engine_work[pos] -= cost
            self.requests_routed[pos] -= 1

    async def add_request_async(self, request: EngineCoreRequest, timeout: float | None = None) -> None:
        """Validate (InvalidRequestError naming the field; nothing is sent), pick the
        engine and queue the request there; yields to other tasks while that engine's
        request ring is full, ``timeout`` seconds at most (None: as long as the engine
        lives), then PeerNotConsumingError (a ``TimeoutError``; the request was not sent
        and may be added again), as ``AsyncMPClient.add_request_async``. EngineDeadError
        once an engine died or after shutdown."""
        timeout = check_timeout("add_request_async", timeout)
        self._bind()
        pos, cost = self._route(request)
        try:
            await self._adds[pos](request, timeout)
        except EngineDeadError as e:
            self._unroute(request, pos, cost)
            raise self._dead_error() from e  # which engine died, or shut down
        except BaseException:
            self._unroute(request, pos, cost)
            raise

    def _aborts_by_engine(self, request_ids: Any) -> dict[int, list[str]]:
        if self._forked:
            raise self._dead_error()
        ids = check_abort_ids(request_ids)
        by_engine: dict[int, list[str]] = {}
        if not ids or self.is_dead:
            return by_engine
        flight = self.reqs_in_flight
        for rid in ids:
            entry = flight.get(rid)
            if entry is not None:
                by_engine.setdefault(entry[0], []).append(rid)
        return by_engine

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        """Abort requests on the engines that own them; unknown or finished ids are
        ignored, [] sends nothing, and so does a dead client. InvalidRequestError for
        anything but a list (or other iterable) of str. Each engine's abort goes after
        what was sent to that engine before it (behind an add still waiting for room
        there), the engines' at once."""
        by_engine = self._aborts_by_engine(request_ids)
        if by_engine:
            await asyncio.gather(*(self.engines[pos].abort_requests_async(ids) for pos, ids in by_engine.items()))

    def dp_engines_running(self) -> bool:
        """Whether any engine has a request of this client in flight (vLLM's DP clients
        answer whether the engines are in a running wave; there are no waves here).
        No engine call."""
        return bool(self.reqs_in_flight)

    # -- lifecycle -------------------------------------------------------------------
    def shutdown(self, timeout: float | None = None) -> None:
        """Stop every engine and free everything. Every engine is told to stop at once
        (each engine client's ``shutdown`` in a thread of its own) and gets ``timeout``
        seconds (None: ``DEFAULT_SHUTDOWN_TIMEOUT_S``) to exit before it is killed
        (SIGTERM, then SIGKILL 2 s later), so one that hangs holds up no other and this
        blocks for about ``timeout`` + 2 s at most, as one engine's shutdown. Pending
        and later calls raise EngineDeadError (``ClientClosedError``). Idempotent;
        interrupted (Ctrl-C), the engines' stops go on, and another call waits for
        them (an engine not yet told is told then). InvalidRequestError for a timeout
        that is not a number >= 0."""
        timeout = shutdown_timeout(timeout)
        if self._forked:
            return
        self._begin_shutdown()
        self._stop_engines(range(len(self.engines)), timeout)
        self._stops.join(timeout, _STOP_GRACE_S)

    async def shutdown_async(self, timeout: float | None = None) -> None:
        """As ``shutdown``, without blocking the loop (the wait for the engines' stops
        runs in a worker thread). Cancelled, the stops go on, and another call waits
        for them."""
        timeout = shutdown_timeout(timeout)
        if self._forked:
            return
        self._begin_shutdown()
        self._stop_engines(range(len(self.engines)), timeout)
        if not self._stops.over():
            await asyncio.to_thread(self._stops.join, timeout, _STOP_GRACE_S)

    def _stop_engines(self, positions: Any, timeout: float) -> None:
        """Start stopping the engines at ``positions`` (``EngineStops``: each in a
        thread of its own). On the bound loop's thread, the loop first stops watching
        their channels, at once: a stop thread could only queue that to the loop, which
        may not turn (a blocking ``shutdown()`` holds it) before the descriptors are
        closed and their numbers reused by readers the loop must keep."""
        positions = list(positions)
        loop = self._loop
        if loop is not None and not loop.is_closed() and _running_loop() is loop:
            for i in positions:
                unwatch = getattr(self.engines[i], "stop_watching", None)
                if unwatch is not None:
                    unwatch()
        self._stops.stop(positions, timeout)

    def _begin_shutdown(self) -> None:
        """Mark the client closed and fail what waits on it (once)."""
        with self._death_lock:
            if self._closed:
                return
            self._closed = True
        loop = self._loop
        if loop is not None and not loop.is_closed():
            if _running_loop() is loop:
                self._fail_in_loop()
            else:
                try:
                    loop.call_soon_threadsafe(self._fail_in_loop)
                except RuntimeError:  # closed meanwhile
                    pass

    async def __aenter__(self) -> "DPAsyncMPClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.shutdown_async()


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _engine_gone(ref: "weakref.ReferenceType[DPAsyncMPClient]", pos: int, err: EngineDeadError) -> None:
    """Engine ``pos``'s ``on_dead`` callback; the engine's resources hold it, so it holds
    the client weakly (a client dropped without ``shutdown`` is still collected). An
    engine client's own shutdown is no death (``AsyncMPClient.on_dead`` never reports
    one; a ready-made engine client that does, with ``ClientClosedError``, is ignored
    here too)."""
    client = ref()
    if client is not None and not isinstance(err, ClientClosedError):
        client._note_death(pos, err)
