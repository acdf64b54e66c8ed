"""Which vLLM deployments the plug-in's async client factory puts on the rings, and the
reason it gives for the others (no vLLM needed: the decision reads vLLM's parallel
config only)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from shmclient.vllm import _not_on_rings


def parallel(dp: int = 1, local: int | None = None, **kw) -> SimpleNamespace:
    fields = dict(data_parallel_size=dp, data_parallel_size_local=dp if local is None else local,
                  data_parallel_external_lb=False, data_parallel_hybrid_lb=False,
                  data_parallel_backend="mp", enable_elastic_ep=False)
    fields.update(kw)
    return SimpleNamespace(**fields)


@pytest.mark.parametrize("config", [parallel(1), parallel(2), parallel(4)])
def test_one_engine_and_internal_data_parallelism_started_here_take_the_rings(config):
    assert _not_on_rings(config, None) is None


@pytest.mark.parametrize("config, addresses, words", [
    (parallel(1), {"input_address": "ipc://x"}, "several API servers"),
    (parallel(2), {"input_address": "ipc://x"}, "several API servers"),
    (parallel(2, data_parallel_external_lb=True), None, "external or hybrid load balancing"),
    (parallel(4, local=2, data_parallel_hybrid_lb=True), None, "external or hybrid load balancing"),
    (parallel(4, local=2), None, "with 2 engines on this node"),
    (parallel(2, data_parallel_backend="ray"), None, "'ray' backend"),
    (parallel(2, enable_elastic_ep=True), None, "elastic EP"),
])
def test_the_others_keep_zmq_with_the_reason(config, addresses, words):
    reason = _not_on_rings(config, addresses)
    assert reason is not None and words in reason
