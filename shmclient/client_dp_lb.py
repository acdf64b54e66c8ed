"""``DPLBAsyncMPClient``: every data-parallel rank behind one client that balances the
load between them, as vLLM's.

Top layer: imports client_dp (whose ``DPAsyncMPClient`` it extends with its own ranks and
routing), config, dp_balance, errors and messages; never the engine, the launcher, the
channels or the rings. ``data_parallel_size=N``, ``data_parallel_external_lb=False``:
starts engines of ranks 0..N-1 and balances requests between them. With
``data_parallel_size_local=L`` only ranks 0..L-1 are started here (over the configured
transport); ranks L..N-1 are remote: each is awaited over tcp on ``data_parallel_address``
(port ``data_parallel_rpc_port + rank - L``) until an engine started apart (``python -m
shmclient_engine --connect tcp://HOST:PORT``, possibly on another host) connects, and is
then one more engine of the group (its tensors travel inline, as zmq frames). Ranks start
concurrently, so the group is ready once the last remote engine is.
"""

from __future__ import annotations

from typing import Any

from .client_dp import DPAsyncMPClient
from .config import EngineConfig
from .dp_balance import least_loaded
from .errors import ConfigError, InvalidRequestError
from .messages import EngineCoreRequest

__all__ = ["DPLBAsyncMPClient"]


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
    Capacity: ``num_gpu_blocks`` is the engines' sum, ``max_model_len`` their minimum
    (a request that names a rank is held to that engine's own ``max_model_len``).
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
