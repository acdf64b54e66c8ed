"""The engines of a data-parallel group: each rank's configuration, starting them
together, stopping the survivors once one died.

Client layer, under ``client_dp``: imports config (and ``client_async``, inside
``start_engines``, for the engine clients it starts); never the launcher, the channels or
the rings. Each engine is one ``AsyncMPClient`` with its own process and ring pair.
"""

from __future__ import annotations

import concurrent.futures
import logging
from typing import Any

from .config import EngineConfig

__all__ = ["engine_config", "start_engines", "stop_all"]

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


def stop_all(clients: list[Any]) -> None:
    """Shut each engine client down, giving it 1 s; logs what fails. Blocks."""
    for c in clients:
        try:
            c.shutdown(timeout=1.0)
        except Exception:  # noqa: BLE001 - best effort: the client is dead already
            logger.exception("stopping a data-parallel engine failed")
