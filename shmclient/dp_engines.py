"""The engines of a data-parallel group: each rank's configuration, starting them
together, stopping them together (at shutdown, or once one died).

Client layer, under ``client_dp``: imports config (and ``client_async``, inside
``start_engines``, for the engine clients it starts); never the launcher, the channels or
the rings. Each engine is one ``AsyncMPClient`` with its own process and ring pair.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import Any, Iterable, Sequence

from .config import EngineConfig

__all__ = ["EngineStops", "engine_config", "start_engines"]

logger = logging.getLogger("shmclient")


def _async_client_class() -> type:
    from .client_async import AsyncMPClient

    return AsyncMPClient


def engine_config(config: EngineConfig, rank: int) -> EngineConfig:
    """The config of the engine of ``rank``: ``data_parallel_rank=rank`` and, when one
    client starts every rank on this host (the internal load balancer) with
    ``device="cuda"`` (no index), the GPU of that rank, ``"cuda:<rank>"`` (one GPU per
    rank, as vLLM places DP ranks; ``"cuda:N"`` keeps every rank on GPU N; behind an
    external load balancer each rank's process picks its GPU as it likes, e.g. with
    ``CUDA_VISIBLE_DEVICES``). A remote rank (``EngineConfig.rank_is_remote``: not
    started here, awaited over tcp) gets ``transport="zmq"``, the one transport that
    reaches another host, and keeps the device it names (its host places it). Nothing is
    started; raises nothing for a valid config."""
    changes: dict[str, Any] = {"data_parallel_rank": rank}
    if config.rank_is_remote(rank):
        changes["transport"] = "zmq"
    elif (config.device == "cuda" and config.data_parallel_size > 1
            and not config.data_parallel_external_lb):
        changes["device"] = f"cuda:{rank}"
    return config.replace(**changes)


def start_engines(config: EngineConfig, ranks: list[int],
                  abandon: threading.Event | None = None) -> list[Any]:
    """Start one ``AsyncMPClient`` per rank, concurrently (one thread each, so start-up
    takes about as long as one engine's), each with ``engine_config(config, rank)``.
    Blocks until all are ready. If any fails, the starts still under way give up (a
    remote rank no longer waits out its ready timeout), the others are shut down and the
    first failure is raised as the client raised it (``ConfigError``,
    ``PeerNotProducingError``, ``EngineDeadError``). Interrupted (a KeyboardInterrupt
    while it waits), it tells the starts under way to give up, waits for them, shuts
    down every engine that started and re-raises; interrupted again meanwhile, each
    start still under way shuts its engine down when it completes. ``abandon``: set by
    another thread (a cancelled ``create``), every start still under way gives up as
    for a failure, ``PeerNotProducingError``; this call sets it too when a start failed
    (None: an Event of its own)."""
    cls = _async_client_class()
    configs = [engine_config(config, r) for r in ranks]
    if abandon is None:
        abandon = threading.Event()
    if len(configs) == 1:
        return [cls(configs[0], _abandon=abandon)]
    pool = concurrent.futures.ThreadPoolExecutor(len(configs), thread_name_prefix="dp-start")
    futs: list[concurrent.futures.Future] = []
    first_failed: list[concurrent.futures.Future] = []
    all_over = False
    try:
        try:
            for c in configs:
                futs.append(pool.submit(cls, c, _abandon=abandon))
            done, _ = concurrent.futures.wait(futs, return_when=concurrent.futures.FIRST_EXCEPTION)
            first_failed = [f for f in futs if f in done and f.exception() is not None]
            if first_failed:
                abandon.set()  # the others give up (within a poll slice), not at their timeout
            concurrent.futures.wait(futs)
            all_over = True
        except BaseException:
            # Nothing will own the engines that start: each is shut down as its start
            # completes, whatever interrupts the wait below; the starts still under way
            # are told first, then those done are stopped (here: a second Ctrl-C may
            # land in one of those stops, which goes on in its own thread). And they give
            # up waiting for their engines (a remote rank would be awaited up to its
            # ready timeout; a start submitted but not yet recorded here ends too).
            abandon.set()
            done = [f for f in futs if f.done()]
            for f in futs:
                if f not in done:
                    f.add_done_callback(_stop_started)
            _stop_each(done)
            concurrent.futures.wait(futs)
            all_over = True
            raise
    finally:
        # (Interrupted again in that wait: the caller goes now; the starts' threads end
        # as the starts do, each stopping its engine.)
        pool.shutdown(wait=all_over)
    started = [f.result() for f in futs if f.exception() is None]
    errors = [f.exception() for f in first_failed or futs if f.exception() is not None]
    if errors:
        for c in started:
            c.shutdown(timeout=0.0)
        raise errors[0]  # (one that failed first, not one abandoned for it)
    return started


def _stop_each(futs: list[concurrent.futures.Future]) -> None:
    """``_stop_started`` for each of ``futs``: one interrupted (a Ctrl-C; its stop goes
    on in its own thread) does not skip those after it."""
    if futs:
        try:
            _stop_started(futs[0])
        finally:
            _stop_each(futs[1:])


def _stop_started(fut: concurrent.futures.Future) -> None:
    """Shut down the engine client ``fut`` started, if it did (its start was abandoned)."""
    if fut.cancelled() or fut.exception() is not None:
        return
    try:
        fut.result().shutdown(timeout=0.0)
    except Exception:  # noqa: BLE001 - best effort: log and go on with the others
        logger.exception("stopping a data-parallel engine whose start was abandoned failed")


class EngineStops:
    """The stopping of a group's engine clients: each engine's ``shutdown(timeout)``
    runs in a thread of its own, so every engine is told to stop at once and one that
    hangs holds up no other (vLLM's process manager signals every engine first, then
    waits against one deadline). Each engine is stopped once: ``stop`` starts nothing
    for an engine already being stopped. ``join`` waits for the stops started; an
    interrupted ``join`` leaves them running, and a later one waits for them again
    (each stop says it is over with an Event: an interrupted ``Thread.join`` can leave
    the thread looking stopped while it runs, bpo-45274's fix in Python 3.11).

    A stop is recorded before its thread starts. A ``stop`` interrupted while it
    starts a thread (Ctrl-C in ``Thread.start``, which may or may not have started it)
    leaves the stop recorded but not known to run; the next ``stop`` starts another
    thread for it, and whichever thread comes first runs the engine's shutdown (the
    other does nothing), so ``join`` waits for the shutdown itself. Where no thread can
    be started (``Thread.start`` raises RuntimeError: Python 3.12.0/3.12.1 at
    interpreter shutdown, e.g. from an ``atexit`` handler), the engine's shutdown runs
    in the calling thread instead."""

    def __init__(self, clients: Sequence[Any]) -> None:
        self._clients = clients
        self._over: dict[int, _Stop] = {}
        self._lock = threading.Lock()

    def stop(self, positions: Iterable[int], timeout: float) -> None:
        """Start stopping the engines at ``positions`` (in ``clients``) not being
        stopped yet, each with ``shutdown(timeout)`` in its own thread (inline where no
        thread can be started). Never waits for an engine otherwise; any thread."""
        with self._lock:
            inline = []
            for pos in positions:
                job = self._over.get(pos)
                if job is None:
                    job = self._over[pos] = _Stop(self._clients[pos], timeout)
                elif job.started or job.claimed:
                    continue
                try:
                    threading.Thread(target=job.run, name=f"dp-stop-engine-{pos}").start()
                except RuntimeError:  # no new thread at interpreter shutdown (3.12.0/1)
                    inline.append(job)
                else:
                    job.started = True
        for job in inline:
            job.run()

    def join(self, timeout: float, grace: float = 0.0) -> bool:
        """Wait for every stop started: ``timeout + grace`` seconds, or, for a stop
        started earlier with a longer timeout (a retry with a shorter one after Ctrl-C),
        until that stop's own timeout and ``grace`` have passed. True once all are over
        (a stop still running after that is logged)."""
        deadline = time.monotonic() + timeout + grace
        with self._lock:
            stops = list(self._over.items())
        for _, job in stops:
            until = max(deadline, job.begun + job.timeout + grace)
            job.over.wait(max(0.0, until - time.monotonic()))
        left = [str(pos) for pos, job in stops if not job.over.is_set()]
        if left:
            logger.warning("the stop of data-parallel engine(s) at position %s is still "
                           "running after %.1f s", ", ".join(left), timeout + grace)
        return not left

    def over(self) -> bool:
        """Whether every stop started is over."""
        with self._lock:
            return all(job.over.is_set() for job in self._over.values())


class _Stop:
    """One engine client's stop: ``run`` (in whichever thread claims it first) calls its
    ``shutdown(timeout)`` and sets ``over``; a later ``run`` does nothing."""

    __slots__ = ("client", "timeout", "begun", "over", "started", "claimed", "_claim")

    def __init__(self, client: Any, timeout: float) -> None:
        self.client = client
        self.timeout = timeout
        #: When the stop was asked for (``monotonic``).
        self.begun = time.monotonic()
        self.over = threading.Event()
        #: A thread to run it was started (``Thread.start`` returned).
        self.started = False
        #: A thread is running it, or ran it.
        self.claimed = False
        self._claim = threading.Lock()

    def run(self) -> None:
        with self._claim:
            if self.claimed:
                return
            self.claimed = True
        try:
            self.client.shutdown(self.timeout)
        except Exception:  # noqa: BLE001 - best effort: the others are stopped all the same
            logger.exception("stopping a data-parallel engine failed")
        finally:
            self.over.set()
