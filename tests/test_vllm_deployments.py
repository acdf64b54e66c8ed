"""Which vLLM deployments the plug-in's async client factory puts on the rings, and the
reason it gives for the others (no vLLM needed: the decision reads vLLM's parallel
config only)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from shmclient.vllm import _not_on_rings, local_only, local_ranks


def parallel(dp: int = 1, local: int | None = None, **kw) -> SimpleNamespace:
    fields = dict(data_parallel_size=dp, data_parallel_size_local=dp if local is None else local,
                  data_parallel_rank=0,
                  data_parallel_external_lb=False, data_parallel_hybrid_lb=False,
                  data_parallel_backend="mp", enable_elastic_ep=False)
    fields.update(kw)
    return SimpleNamespace(**fields)


@pytest.mark.parametrize("config, local", [(parallel(1), [0]), (parallel(2), [0, 1]), (parallel(4), [0, 1, 2, 3]),
                                           (parallel(4, local=2), [0, 1]), (parallel(2, local=1), [0])])
def test_one_engine_and_internal_data_parallelism_started_here_take_the_rings(config, local):
    """With engines on other nodes (``--data-parallel-size-local`` below the DP size on
    the head node), the engines started here take the rings; the others keep ZMQ."""
    assert _not_on_rings(config, None) is None
    assert local_ranks(config) == local


@pytest.mark.parametrize("config, local", [
    (parallel(4, local=2, data_parallel_hybrid_lb=True), [0, 1]),
    (parallel(4, local=2, data_parallel_hybrid_lb=True, data_parallel_rank=2), [2, 3]),
])
def test_hybrid_load_balancing_takes_the_rings_for_this_nodes_engines(config, local):
    """Each API server talks to the engines of its own node only, whatever its first
    rank: all of them on the rings."""
    assert _not_on_rings(config, None) is None
    assert local_ranks(config) == local and local_only(config)
    assert not local_only(parallel(4, local=2))


@pytest.mark.parametrize("config, addresses, words", [
    (parallel(1), {"input_address": "ipc://x"}, "handed no shared-memory channels"),
    (parallel(2), {"input_address": "ipc://x"}, "handed no shared-memory channels"),
    (parallel(2, local=0), None, "no engine core started by this frontend on this node"),
    (parallel(2, local=1, data_parallel_external_lb=True), None, "external load balancing"),
    (parallel(2, local=1, data_parallel_external_lb=True, data_parallel_rank=1), None, "external load balancing"),
    (parallel(2, local=0, data_parallel_hybrid_lb=True), None, "no engine core started by this frontend"),
    (parallel(4, local=2, data_parallel_rank=2), None, "2 local from rank 2"),
    (parallel(2, data_parallel_backend="ray"), None, "'ray' backend"),
    (parallel(2, enable_elastic_ep=True), None, "elastic EP"),
])
def test_the_others_keep_zmq_with_the_reason(config, addresses, words):
    reason = _not_on_rings(config, addresses)
    assert reason is not None and words in reason


def handed(*engines: int) -> list[SimpleNamespace]:
    return [SimpleNamespace(engine_index=e) for e in engines]


@pytest.mark.parametrize("config, specs", [(parallel(1), handed(0)), (parallel(2), handed(0, 1)),
                                           (parallel(4, local=2), handed(0, 1))])
def test_an_api_server_of_several_takes_the_rings_the_launcher_handed_it(config, specs):
    assert _not_on_rings(config, {"input_address": "ipc://x"}, specs) is None


@pytest.mark.parametrize("config, specs, words", [
    (parallel(2), handed(0), "handed channels to engines [0], its engines on this node are [0, 1]"),
    (parallel(1), handed(1), "handed channels to engines [1], its engines on this node are [0]"),
    (parallel(4, local=2), handed(0, 1, 2, 3), "handed channels to engines [0, 1, 2, 3], its engines on this node"),
    (parallel(4, local=2, data_parallel_hybrid_lb=True), handed(0, 1, 2, 3), "its engines on this node are [0, 1]"),
    (parallel(4, local=2, data_parallel_hybrid_lb=True, data_parallel_rank=2), handed(0, 1),
     "its engines on this node are [2, 3]"),
])
def test_an_api_server_handed_the_wrong_channels_keeps_zmq(config, specs, words):
    reason = _not_on_rings(config, {"input_address": "ipc://x"}, specs)
    assert reason is not None and words in reason
