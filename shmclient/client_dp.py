"""Data-parallel clients: several engine cores behind one asyncio client, as vLLM's.

Top layer, beside ``client_async``: imports client, client_async, config, messages,
errors and validate, and uses ``AsyncMPClient`` only through its public async API (one
``AsyncMPClient`` per engine, each with its own engine process and its own ring pair, so
every ring stays single-producer single-consumer); it must not import the engine, the
launcher, the channels or the rings. It owns the routing of requests to engines, the
request → engine map (aborts go to the owner), the merged output stream (one reader task
per engine), the fan-out of utility calls and the capacity the engines report together.

* ``DPLBAsyncMPClient`` (``data_parallel_size=N``, ``data_parallel_external_lb=False``):
  starts engines of ranks 0..N-1 and balances requests between them. With
  ``data_parallel_size_local=L`` only ranks 0..L-1 are started here (over the configured
  transport); ranks L..N-1 are remote: each is awaited over tcp on
  ``data_parallel_address`` (port ``data_parallel_rpc_port + rank - L``) until an engine
  started apart (``python -m shmclient_engine --connect tcp://HOST:PORT``, possibly on
  another host) connects, and is then one more engine of the group (its tensors travel
  inline, as zmq frames). Ranks start concurrently, so the group is ready once the last
  remote engine is.
* ``DPAsyncMPClient`` (``data_parallel_external_lb=True``): an external load balancer
  runs one client per rank; this client starts and talks to its own rank only.

``make_async_mp_client`` (``shmclient.client``) picks between them and ``AsyncMPClient``
with vLLM's rules.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
from typing import Any

from .config import EngineConfig
from . import forksafe
from .client_utilities import DP_RULES, AsyncUtilities
from .client import EngineCoreClient, check_abort_ids, check_request, check_utility_call
from .errors import (
    ClientClosedError,
    ConfigError,
    EngineDeadError,
    ForkedError,
    InvalidRequestError,
    PeerNotProducingError,
    UsageError,
    UtilityCallError,
)
from .dp_balance import least_loaded, work_estimate
from .messages import EngineCoreOutputs, EngineCoreRequest, SchedulerStats

logger = logging.getLogger("shmclient")

_NO_STATS = SchedulerStats()


def _async_client_class() -> type:
    from .client_async import AsyncMPClient

    return AsyncMPClient


def engine_config(config: EngineConfig, rank: int) -> EngineConfig:
    """The config of the engine of ``rank``: ``data_parallel_rank=rank`` and, when one
    client starts every rank on this host (the internal load balancer) with
    ``device="cuda"`` (no index), the GPU of that rank, ``"cuda:<rank>"`` (one GPU per
    rank, as vLLM places DP ranks; ``"cuda:N"`` keeps every rank on GPU N; behind an
    external load balancer each rank's process picks its GPU as it likes, e.g. with
    ``CUDA_VISIBLE_DEVICES``). A remote rank (``rank >= data_parallel_size_local``:
    not started here, awaited over tcp) gets ``transport="zmq"``, the one transport that
    reaches another host, and keeps the device it names (its host places it). Nothing is
    started; raises nothing for a valid config."""
    changes: dict[str, Any] = {"data_parallel_rank": rank}
    local = config.data_parallel_size_local
    remote = local is not None and rank >= local
    if remote:
        changes["transport"] = "zmq"
    elif (config.device == "cuda" and config.data_parallel_size > 1
            and not config.data_parallel_external_lb):
        changes["device"] = f"cuda:{rank}"
    return config.replace(**changes)


def start_engines(config: EngineConfig, ranks: list[int]) -> list[Any]:
    """Start one ``AsyncMPClient`` per rank, concurrently (one thread each, so start-up
    takes about as long as one engine's), each with ``engine_config(config, rank)``.
    Blocks until all are ready. If any fails, the others are shut down and the first
    failure is raised as the client raised it (``ConfigError``,
    ``PeerNotProducingError``, ``EngineDeadError``)."""
    cls = _async_client_class()
    configs = [engine_config(config, r) for r in ranks]
    if len(configs) == 1:
        return [cls(configs[0])]
    pool = concurrent.futures.ThreadPoolExecutor(len(configs), thread_name_prefix="dp-start")
    try:
        futs = [pool.submit(cls, c) for c in configs]
    finally:
        pool.shutdown(wait=True)  # also when interrupted: every start is then accounted for
    started = [f.result() for f in futs if f.exception() is None]
    errors = [f.exception() for f in futs if f.exception() is not None]
    if errors:
        for c in started:
            c.shutdown(timeout=0.0)
        raise errors[0]
    return started


class DPAsyncMPClient(AsyncUtilities, EngineCoreClient):
    """One data-parallel rank behind an external load balancer (vLLM's
    ``DPAsyncMPClient``): ``make_client(True, True, config)`` with
    ``data_parallel_size > 1`` and ``data_parallel_external_lb=True``.

    ``config.data_parallel_rank`` names this client's rank (``ConfigError`` when None:
    an external load balancer runs one client per rank). The engine is started with
    that rank and every output batch carries it as ``engine_index``. A request's
    ``data_parallel_rank`` must be None or this rank (``InvalidRequestError``).

    Construction blocks until the engine(s) are ready and raises what ``AsyncMPClient``
    raises. Use the ``*_async`` methods from one event loop (the first that calls one
    binds the client; another loop gets ``UsageError``); none blocks the loop. As
    ``AsyncMPClient``, it has no blocking forms. When an engine dies, every pending and
    later call raises ``EngineDeadError`` naming it, and the engines still alive are
    stopped, as vLLM does.
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
        self._outputs: list[EngineCoreOutputs] = []
        self._out_head = 0
        self._waiters: set[asyncio.Future] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._readers: list[asyncio.Task] = []
        self._dead_fut: asyncio.Future | None = None
        self._dead_reason: str | None = None
        self._closed = False
        self._stopper: threading.Thread | None = None
        self._pid = os.getpid()
        forksafe.register(self)

    #: True in a process forked from the one that built the client (see forksafe).
    _forked = False

    def _forget_after_fork(self) -> None:
        """In a forked child: the engines are the parent's (each engine client forgets
        its own too). Every call raises ForkedError from here on; ``shutdown()`` does
        nothing. What the parent had queued is dropped from the child's copy."""
        self._forked = True
        self._closed = True
        self._outputs.clear()
        self._out_head = 0

    @classmethod
    async def create(cls, config: EngineConfig | None = None) -> "DPAsyncMPClient":
        """Build the client from a running loop without blocking it: the engines start
        in a thread (each in one of its own, at once). Raises what the constructor
        raises."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, cls, config)

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
        """Bind to the running loop on first use and start one reader task per engine."""
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return loop
        if self._loop is not None and not self._loop.is_closed():
            raise UsageError(f"this {type(self).__name__} is already used by another event loop")
        self._ensure_alive()
        self._loop = loop
        self._dead_fut = loop.create_future()
        self._readers = [
            loop.create_task(self._read(i, e), name=f"dp-reader-{self.engine_ranks[i]}")
            for i, e in enumerate(self.engines)
        ]
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
        if self._dead_reason is None:
            dead = [self.engine_ranks[i] for i, e in enumerate(self.engines) if e.is_dead]
            if dead:
                return EngineDeadError(f"data-parallel engine {dead[0]} is dead")
        return EngineDeadError(self._dead_reason)

    def _ensure_alive(self) -> None:
        if self.is_dead:
            raise self._dead_error()

    def _engine_died(self, pos: int, err: BaseException) -> None:
        """In the loop, once engine ``pos`` is gone: the client is dead (vLLM's rule):
        fail every waiter and pending call, stop the other readers, and stop the engines
        still alive in a thread (their shutdown blocks)."""
        if self._dead_reason is not None or self._closed:
            return
        rank = self.engine_ranks[pos]
        self._dead_reason = (f"data-parallel engine {rank} (pid {self.engine_pids[pos]}) "
                             f"died: {err}")
        logger.error("%s; stopping the other engines", self._dead_reason)
        self._fail_in_loop(skip=pos)
        survivors = [e for i, e in enumerate(self.engines) if i != pos]
        self._stopper = threading.Thread(
            target=_stop_all, args=(survivors,), name="dp-stop-engines", daemon=True)
        self._stopper.start()

    def _fail_in_loop(self, skip: int | None = None) -> None:
        if self._dead_fut is not None and not self._dead_fut.done():
            self._dead_fut.set_result(None)
        for i, t in enumerate(self._readers):
            if i != skip:
                t.cancel()
        self._wake()

    def _wake(self) -> None:
        for w in self._waiters:
            if not w.done():
                w.set_result(None)

    # -- the merged output stream ----------------------------------------------------
    async def _read(self, pos: int, engine: Any) -> None:
        """One engine's reader: its batches, stamped with its rank, into the stream."""
        rank = self.engine_ranks[pos]
        flight = self.reqs_in_flight
        inflight, work, stats = self.engine_inflight, self.engine_work, self.lb_engines
        out = self._outputs
        try:
            while True:
                outs = await engine.get_output_async()
                outs.engine_index = rank
                if outs.scheduler_stats is not None:
                    stats[pos] = outs.scheduler_stats
                fin = outs.finished_requests
                if fin:
                    for rid in fin:
                        entry = flight.get(rid)
                        if entry is not None and entry[0] == pos:
                            del flight[rid]
                            inflight[pos] -= 1
                            work[pos] -= entry[1]
                out.append(outs)
                if self._waiters:
                    self._wake()
        except EngineDeadError as e:
            if not self._closed:
                self._engine_died(pos, e)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a reader must not die silently
            logger.exception("data-parallel engine %d: reading its outputs failed", rank)
            self._engine_died(pos, e)

    async def get_output_async(self, timeout: float | None = None) -> EngineCoreOutputs:
        """The next output batch of any engine (``engine_index`` says which), in the
        order the batches arrived; waits without blocking the loop. ``timeout``: raise
        ``PeerNotProducingError`` (a ``TimeoutError``) after that many seconds with
        nothing (None: wait as long as it takes). Once an engine died, the batches read
        before come first, then ``EngineDeadError``; also after ``shutdown()``."""
        out = self._outputs
        if self._out_head < len(out):
            return self._pop()
        loop = self._bind()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._out_head < len(out):
                return self._pop()
            # Not ``is_dead``: what a dead engine wrote before dying comes first, and its
            # reader has queued all of it by the time it reports the death.
            if self._closed or self._dead_reason is not None:
                raise self._dead_error()
            waiter = loop.create_future()
            self._waiters.add(waiter)
            try:
                if deadline is None:
                    await waiter
                else:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise PeerNotProducingError(
                            f"no output from the engines within {timeout} s (they are alive)")
                    await asyncio.wait((waiter,), timeout=left)
            finally:
                self._waiters.discard(waiter)

    def _pop(self) -> EngineCoreOutputs:
        out = self._outputs
        item = out[self._out_head]
        self._out_head += 1
        if self._out_head == len(out):
            out.clear()
            self._out_head = 0
        return item

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
        """Checks at the door (InvalidRequestError naming the field), then the engine
        and the work estimate; records the request as in flight on that engine."""
        self._ensure_alive()
        if type(request) is not EngineCoreRequest or type(request.request_id) is not str:
            # The full checks run in the engine's client; these are what routing reads.
            check_request(request, max_model_len=self.max_model_len,
                          hidden_size=self.config.hidden_size, vocab_size=self.config.vocab_size)
        rid = request.request_id
        dpr = request.data_parallel_rank
        if dpr is not None and type(dpr) is not int:
            raise InvalidRequestError(
                f"request {rid!r}: data_parallel_rank={dpr!r} is invalid: must be None or an int")
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

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        """Validate (InvalidRequestError naming the field; nothing is sent), pick the
        engine and queue the request there; yields to other tasks while that engine's
        request ring is full. EngineDeadError once an engine died or after shutdown."""
        self._bind()
        pos, cost = self._route(request)
        try:
            await self.engines[pos].add_request_async(request)
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
        anything but a list (or other iterable) of str. Never waits for an engine."""
        for pos, ids in self._aborts_by_engine(request_ids).items():
            await self.engines[pos].abort_requests_async(ids)

    # -- utilities -------------------------------------------------------------------
    async def _guard(self, aw: Any) -> Any:
        """Await ``aw``, or raise EngineDeadError as soon as any engine died."""
        dead = self._dead_fut
        fut = asyncio.ensure_future(aw)
        try:
            await asyncio.wait((fut, dead), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            fut.cancel()
            raise
        if fut.done():
            return fut.result()
        fut.cancel()
        raise self._dead_error()

    async def call_utility_all_async(self, method: str, *args: Any) -> list[Any]:
        """Call ``method(*args)`` on every engine at once; their results in rank order.
        Raises UtilityCallError when it failed on an engine, InvalidRequestError for a
        ``method`` that is not a non-empty str, SerializationError for arguments that
        cannot cross, EngineDeadError when an engine died (also while waiting)."""
        self._bind()
        self._ensure_alive()
        check_utility_call(method)
        calls = [asyncio.ensure_future(self._call_on(i, method, args))
                 for i in range(len(self.engines))]
        return await self._guard(asyncio.gather(*calls))

    async def _call_on(self, pos: int, method: str, args: tuple) -> Any:
        try:
            return await self.engines[pos].call_utility_async(method, *args)
        except EngineDeadError as e:
            # Its engine's death, said as the client says it (which engine, why).
            if self._closed or self._dead_reason is not None:
                raise self._dead_error() from e
            raise EngineDeadError(
                f"data-parallel engine {self.engine_ranks[pos]} (pid "
                f"{self.engine_pids[pos]}) died: {e}") from e

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        """Call ``method(*args)`` on this client's engine (``DPLBAsyncMPClient``: on
        every engine, returning the first's result, as vLLM). Errors as
        ``call_utility_all_async``."""
        return (await self.call_utility_all_async(method, *args))[0]

    async def call_utility_consensus_async(self, method: str, *args: Any) -> Any:
        """Call ``method(*args)`` on every engine; their common result.
        UtilityCallError when the engines disagree (vLLM raises a RuntimeError, which
        UtilityCallError is), else as ``call_utility_all_async``."""
        results = await self.call_utility_all_async(method, *args)
        if any(r != results[0] for r in results):
            raise UtilityCallError(f"Engines returned different {method} results: {results}")
        return results[0]

    def dp_engines_running(self) -> bool:
        """Whether any engine has a request of this client in flight (vLLM's DP clients
        answer whether the engines are in a running wave; there are no waves here).
        No engine call."""
        return bool(self.reqs_in_flight)

    # -- lifecycle -------------------------------------------------------------------
    def shutdown(self, timeout: float | None = None) -> None:
        """Stop every engine and free everything; each engine gets up to ``timeout``
        seconds (None: ``DEFAULT_SHUTDOWN_TIMEOUT_S``) to exit before it is killed, one
        after the other, so this blocks for at most about N x (``timeout`` + 2) s.
        Pending and later calls raise EngineDeadError (``ClientClosedError``).
        Idempotent. InvalidRequestError for a timeout that is not a number >= 0."""
        from .client import shutdown_timeout

        timeout = shutdown_timeout(timeout)
        if self._begin_shutdown():
            self._join_stopper()
            for e in self.engines:
                e.shutdown(timeout)

    async def shutdown_async(self, timeout: float | None = None) -> None:
        """As ``shutdown``, without blocking the loop: the engines are stopped at once
        (each engine client's ``shutdown_async`` where it has one, else its
        ``shutdown`` in a worker thread), so this takes about one engine's stop."""
        from .client import shutdown_timeout

        timeout = shutdown_timeout(timeout)
        if not self._begin_shutdown():
            return
        if self._stopper is not None:
            await asyncio.to_thread(self._join_stopper)
        stops = []
        for e in self.engines:
            stop = getattr(e, "shutdown_async", None)
            stops.append(stop(timeout) if stop is not None else asyncio.to_thread(e.shutdown, timeout))
        await asyncio.gather(*stops)

    def _begin_shutdown(self) -> bool:
        """Mark the client closed and fail what waits on it; False if it already was."""
        if self._closed:
            return False
        self._closed = True
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is loop:
                self._fail_in_loop()
            else:
                try:
                    loop.call_soon_threadsafe(self._fail_in_loop)
                except RuntimeError:  # closed meanwhile
                    pass
        return True

    def _join_stopper(self) -> None:
        # It gives each engine 1 s, then SIGTERM and SIGKILL: done well within this.
        if self._stopper is not None:
            self._stopper.join(15.0)

    async def __aenter__(self) -> "DPAsyncMPClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.shutdown_async()

    async def _utility(self, method: str, *args: Any) -> Any:
        rule = DP_RULES.get(method)
        if rule == "all":
            return all(await self.call_utility_all_async(method, *args))
        if rule == "consensus":
            return await self.call_utility_consensus_async(method, *args)
        return await self.call_utility_async(method, *args)


class DPLBAsyncMPClient(DPAsyncMPClient):
    """Data-parallel engines of ranks 0..N-1 behind one client that balances the load
    (vLLM's ``DPLBAsyncMPClient``): ``make_client(True, True, config)`` with
    ``data_parallel_size=N > 1`` and ``data_parallel_external_lb=False``.

    Routing: a request's ``data_parallel_rank`` picks its engine when given
    (``InvalidRequestError`` outside 0..N-1); otherwise the engine with the lowest
    score gets it: vLLM's score over the engines' latest ``SchedulerStats`` (every output
    batch carries them) and this client's exact in-flight counts, ties decided by the
    work in flight (so that alternating long and short requests do not all pile up on
    one engine, as under round robin), then by a rotating start (``dp_balance``).

    Utility calls go to every engine: ``call_utility_async`` returns the first
    engine's result (vLLM's rule), ``call_utility_all_async`` every result;
    ``is_sleeping``, ``is_scheduler_paused`` and ``get_weight_version`` answer the
    engines' common result, ``wake_up`` and ``reset_prefix_cache`` whether all did.
    Capacity: ``num_gpu_blocks`` is the engines' sum, ``max_model_len`` their minimum.
    ``config.data_parallel_rank`` must be None or 0 (``ConfigError``). Otherwise as
    ``DPAsyncMPClient``.
    """

    def __init__(self, config: EngineConfig | None = None, *, engines: list[Any] | None = None) -> None:
        super().__init__(config, engines=engines)
        self._start = 0

    @staticmethod
    def _managed_ranks(config: EngineConfig) -> list[int]:
        if config.data_parallel_rank not in (None, 0):
            raise ConfigError(
                f"EngineConfig.data_parallel_rank={config.data_parallel_rank!r} is invalid: "
                "the internal load balancer (data_parallel_external_lb=False) runs every "
                "rank 0..data_parallel_size-1 itself; leave it None")
        return list(range(config.data_parallel_size))

    def get_core_engine_for_request(self, request: EngineCoreRequest) -> int:
        """The engine position for ``request``: its ``data_parallel_rank`` when given,
        else the lowest score (see the class docstring). Changes only the tie-break
        rotation; raises InvalidRequestError for a rank outside 0..N-1."""
        n = len(self.engines)
        dpr = request.data_parallel_rank
        if dpr is not None:
            if not 0 <= dpr < n:
                raise InvalidRequestError(
                    f"request {request.request_id!r}: data_parallel_rank={dpr!r} is invalid: "
                    f"must be None or 0..{n - 1} (data_parallel_size={n})")
            return dpr
        best = least_loaded(self.engine_inflight, self.engine_work, self.lb_engines, self._start)
        self._start = (self._start + 1) % n
        return best


def _stop_all(clients: list[Any]) -> None:
    for c in clients:
        try:
            c.shutdown(timeout=1.0)
        except Exception:  # noqa: BLE001 - best effort: the client is dead already
            logger.exception("stopping a data-parallel engine failed")
