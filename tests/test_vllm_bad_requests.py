"""Requests that decode but cannot be handled, sent on the plug-in's request ring: each is
refused alone (a request-scoped error or a utility failure reply on the ring it came
by) and the engine keeps serving. vLLM decodes only ADD with a type; stock vLLM's input
thread or busy loop dies on a wrong-shaped ABORT or UTILITY, or on the engine's own
sentinels sent as requests.

Run with ``python -m pytest -m vllm`` (see README); skipped when vLLM is not importable.
"""

from __future__ import annotations

import time
from concurrent.futures import Future

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

pytest.importorskip("vllm")

import msgspec  # noqa: E402
from vllm.v1.engine import EngineCoreRequest, EngineCoreRequestType, FinishReason  # noqa: E402

from shmclient import waiting  # noqa: E402

from .test_vllm import greedy, make_llm, model_dir, plugin_loaded, run  # noqa: E402,F401

ADD, ABORT, UTILITY = (t.value[0] for t in (EngineCoreRequestType.ADD, EngineCoreRequestType.ABORT,
                                            EngineCoreRequestType.UTILITY))
EXECUTOR_FAILED, START_DP_WAVE = EngineCoreRequestType.EXECUTOR_FAILED.value[0], \
    EngineCoreRequestType.START_DP_WAVE.value[0]


@pytest.fixture(scope="module")
def llms(model_dir):  # noqa: F811
    stock = make_llm(model_dir, shm=False)
    shm = None
    try:
        shm = make_llm(model_dir, shm=True)
        yield stock, shm
    finally:
        for llm in (shm, stock):
            if llm is not None:
                llm.llm_engine.engine_core.shutdown()


def _request(rid: str, prompt: list[int], client_index: int = 0) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=rid, prompt_token_ids=prompt, mm_features=None, sampling_params=greedy(40),
                             pooling_params=None, arrival_time=time.time(), lora_request=None, cache_salt=None,
                             data_parallel_rank=None, client_index=client_index)


def _send(client, rtype: int, payload) -> None:
    waiting.send(client._link.channel, rtype, msgspec.msgpack.encode(payload), timeout=10)


def _utility_reply(client, call_id: int, payload) -> Future:
    """Send a UTILITY record ``payload`` whose reply resolves the future of ``call_id``."""
    future: Future = Future()
    client.utility_results[call_id] = future
    _send(client, UTILITY, payload)
    client._reader.wait(future.done, time.monotonic() + 30)
    return future


def test_wrong_shaped_requests_are_refused_and_the_engine_keeps_serving(llms):
    from vllm.v1.fault_tolerance.engine_core_sentinel import FT_UTILITY_METHOD

    stock, shm = llms
    client = shm.llm_engine.engine_core
    # A request in flight (sent past LLM's bookkeeping: this test reads its outputs):
    # neither the bad ABORTs nor the rest may finish it.
    client.add_request(_request("inflight", [5, 6, 7, 8]))

    _send(client, ABORT, None)  # vLLM: the busy loop dies, or finish_requests(None) ends all
    _send(client, ABORT, 5)  # vLLM: TypeError in the busy loop, the engine dies
    _send(client, ABORT, [[1]])
    _send(client, UTILITY, [0, 1, "x"])  # vLLM: the input thread dies unpacking it
    _send(client, EXECUTOR_FAILED, None)  # the engine's own sentinel: its busy loop would raise
    _send(client, START_DP_WAVE, [1, 0])  # the DP coordinator's, not a frontend's

    # Readable call ids get a failure reply on this ring.
    bad_method = _utility_reply(client, 9001, [0, 9001, 123, []])
    assert "refused" in str(bad_method.exception()), bad_method.exception()
    other_client = _utility_reply(client, 9002, [1, 9002, "is_sleeping", []])
    assert "client_index 1" in str(other_client.exception()), other_client.exception()
    no_args = _utility_reply(client, 9003, [0, 9003, FT_UTILITY_METHOD, []])  # vLLM: IndexError, engine dies
    assert "failed" in str(no_args.exception()), no_args.exception()

    # An ADD claiming another frontend's index gets its error here (vLLM would send
    # its outputs to a frontend that never asked).
    client.add_request(_request("other-client", [9, 9], client_index=1))

    finished = {}
    deadline = time.monotonic() + 60
    while not {"inflight", "other-client"} <= finished.keys():
        assert time.monotonic() < deadline, finished
        for out in client.get_output().outputs:
            if out.finish_reason is not None:
                finished[out.request_id] = out.finish_reason
    assert finished["inflight"] == FinishReason.LENGTH, finished
    assert finished["other-client"] == FinishReason.ERROR, finished
    assert client.call_utility("is_sleeping") is False
    assert run(shm, [[5, 6, 7, 8], [1, 2, 3]], 6) == run(stock, [[5, 6, 7, 8], [1, 2, 3]], 6)
