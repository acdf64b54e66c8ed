"""The behaviour suite: written once against the EngineCoreClient API, run unchanged
against InprocClient, SyncMPClient and AsyncMPClient on both transports."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shmclient.config import EngineConfig
from shmclient import (
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    InvalidRequestError,
    PeerNotProducingError,
    PoolingParams,
    SamplingParams,
    ShmClientError,
    UtilityCallError,
)

from .drivers import KINDS, Driver, build, req

MOCK = EngineConfig(model="mock", max_model_len=256, hidden_size=32)
TINY = EngineConfig(
    model="tiny", max_model_len=256, block_size=4, num_gpu_blocks=24, max_num_seqs=8,
    max_num_batched_tokens=64, hidden_size=32, num_layers=2, num_heads=4, vocab_size=97,
)


@pytest.fixture(scope="module", params=KINDS)
def mock_client(request):
    client = build(request.param, MOCK)
    yield Driver(request.param, client)
    client.shutdown()


@pytest.fixture(scope="module", params=KINDS)
def tiny_client(request):
    client = build(request.param, TINY)
    yield Driver(request.param, client)
    client.shutdown()


async def test_ten_requests_get_exactly_max_tokens(mock_client):
    ids = [f"ten-{i}" for i in range(10)]
    for i in ids:
        await mock_client.add(req(i, max_tokens=20))
    res = await mock_client.collect(ids)
    for i in ids:
        assert len(res[i]["tokens"]) == 20
        assert res[i]["reason"] == FinishReason.LENGTH
        assert res[i]["outputs"][-1].finished
        assert res[i]["n_finished"] == 1


async def test_abort_every_second_request(mock_client):
    ids = [f"ab-{i}" for i in range(10)]
    # The mock model computes nothing, so a step takes microseconds: pause the scheduler
    # so that no step can run between an add and its abort. sleep, adds, aborts and
    # wake_up ride one ordered stream, which is what this checks.
    await mock_client.util("sleep", 1)
    for n, i in enumerate(ids):
        await mock_client.add(req(i, max_tokens=20))
        if n % 2:
            await mock_client.abort([i])
    await mock_client.util("wake_up")
    res = await mock_client.collect(ids)
    for n, i in enumerate(ids):
        if n % 2:
            assert res[i]["reason"] == FinishReason.ABORT
            assert str(res[i]["reason"]) == "abort"
            assert len(res[i]["tokens"]) < 20
        else:
            assert res[i]["reason"] == FinishReason.LENGTH
            assert len(res[i]["tokens"]) == 20
    # Aborting finished and unknown requests is harmless, and [] sends nothing.
    await mock_client.abort(ids[:2] + ["never-seen"])
    await mock_client.abort([])
    await mock_client.add(req("after-abort", max_tokens=3))
    res = await mock_client.collect(["after-abort"])
    assert len(res["after-abort"]["tokens"]) == 3


async def test_stop_token_ends_with_stop(mock_client):
    await mock_client.add(req("stop-free", max_tokens=6))
    toks = (await mock_client.collect(["stop-free"]))["stop-free"]["tokens"]
    stop = toks[2]
    await mock_client.add(req("stop-it", max_tokens=6, stop_token_ids=[stop]))
    r = (await mock_client.collect(["stop-it"]))["stop-it"]
    assert r["reason"] == FinishReason.STOP
    assert r["stop_reason"] == stop
    assert r["tokens"][: len(r["tokens"]) - 1] == toks[: len(r["tokens"]) - 1]
    assert len(r["tokens"]) <= 3


async def test_pooling_with_ids_and_embeds(mock_client):
    await mock_client.add(
        EngineCoreRequest(
            request_id="pool-ids", prompt_token_ids=[3, 4, 5], pooling_params=PoolingParams()
        )
    )
    embeds = torch.randn(7, MOCK.hidden_size, dtype=torch.float32)
    await mock_client.add(
        EngineCoreRequest(
            request_id="pool-emb", prompt_embeds=embeds, pooling_params=PoolingParams()
        )
    )
    res = await mock_client.collect(["pool-ids", "pool-emb"])
    for rid in ("pool-ids", "pool-emb"):
        assert res[rid]["reason"] == FinishReason.STOP
        assert len(res[rid]["outputs"]) == 1
    out = res["pool-emb"]["outputs"][0].pooling_output
    assert torch.equal(out, embeds.float().mean(0))
    ids_out = res["pool-ids"]["outputs"][0].pooling_output
    assert ids_out.shape == (MOCK.hidden_size,)
    assert ids_out[:3].tolist() == [3.0, 4.0, 5.0]


async def test_prompt_embeds_generate(mock_client):
    embeds = torch.randn(5, MOCK.hidden_size).to(torch.bfloat16)
    await mock_client.add(
        EngineCoreRequest(
            request_id="emb-gen", prompt_embeds=embeds, sampling_params=SamplingParams(max_tokens=4)
        )
    )
    r = (await mock_client.collect(["emb-gen"]))["emb-gen"]
    assert len(r["tokens"]) == 4 and r["reason"] == FinishReason.LENGTH


@pytest.mark.parametrize(
    "bad, words",
    [
        (EngineCoreRequest(request_id="e1", prompt_token_ids=[]), "empty"),
        (EngineCoreRequest(request_id="e2", prompt_token_ids=[1] * 300), "max_model_len"),
        (req("e3", max_tokens=0), "max_tokens"),
        (
            EngineCoreRequest(request_id="e4", prompt_embeds=torch.zeros(3, 5)),
            "hidden_size",
        ),
        (EngineCoreRequest(request_id="e5", prompt_token_ids=[1, 10**6]), "vocab"),
    ],
)
async def test_bad_input_is_refused_and_others_served(mock_client, bad, words):
    await mock_client.add(req(f"good-{bad.request_id}", max_tokens=5))
    with pytest.raises(InvalidRequestError, match=words):
        await mock_client.add(bad)
    r = await mock_client.collect([f"good-{bad.request_id}"])
    assert len(r[f"good-{bad.request_id}"]["tokens"]) == 5


async def test_duplicate_live_request_id_refused(mock_client):
    await mock_client.add(req("dup", max_tokens=5))
    with pytest.raises(InvalidRequestError, match="dup"):
        await mock_client.add(req("dup", max_tokens=5))
    r = await mock_client.collect(["dup"])
    assert r["dup"]["n_finished"] == 1 and len(r["dup"]["tokens"]) == 5
    # Once finished, the id may be used again.
    await mock_client.add(req("dup", max_tokens=2))
    assert len((await mock_client.collect(["dup"]))["dup"]["tokens"]) == 2


async def test_utilities(mock_client):
    assert await mock_client.util("echo", {"x": [1, 2]}) == {"x": [1, 2]}
    assert await mock_client.util("echo", None) is None
    t = torch.arange(1000, dtype=torch.float32).reshape(10, 100)
    back = await mock_client.util("echo", t)
    assert torch.equal(back, t) and back.dtype == t.dtype
    a = np.asfortranarray(np.arange(600, dtype=np.int16).reshape(20, 30))
    back = await mock_client.util("echo", a)
    assert np.array_equal(back, a) and back.dtype == a.dtype
    assert set(await mock_client.util("get_supported_tasks")) == {"generate", "embed"}
    assert await mock_client.util("is_sleeping") is False
    assert await mock_client.util("list_loras") == set()
    with pytest.raises(UtilityCallError, match="Call to no_such_method method failed"):
        await mock_client.call_utility("no_such_method")
    with pytest.raises(UtilityCallError, match="Call to collective_rpc method failed"):
        await mock_client.util("collective_rpc", "no_such_worker_method")
    # The engine keeps serving, and utility replies never show up as outputs.
    assert await mock_client.util("echo", 7) == 7
    await mock_client.add(req("after-util", max_tokens=2))
    r = await mock_client.collect(["after-util"])
    assert len(r["after-util"]["tokens"]) == 2


async def test_utility_failure_reads_call_to_method_failed_message(mock_client):
    # vLLM: "Call to echo method failed: help!" -- the engine's message, no type prefix.
    with pytest.raises(UtilityCallError) as ei:
        await mock_client.util("sleep", 3)
    assert str(ei.value) == "Call to sleep method failed: sleep level must be 0, 1 or 2, got 3"
    assert await mock_client.util("is_sleeping") is False


async def test_sleep_wake_up(mock_client):
    if mock_client.is_inproc:
        with pytest.raises(ValueError, match="in-process"):
            mock_client.client.sleep(mode="wait")
    await mock_client.util("sleep", 1)
    assert await mock_client.util("is_sleeping") is True
    await mock_client.util("wake_up")
    assert await mock_client.util("is_sleeping") is False


async def test_get_output_when_idle(mock_client):
    """Nothing to read: the in-process client's step returns an empty batch (it never
    blocks), the others time out with a ``TimeoutError`` that is a ``ShmClientError``."""
    client = mock_client.client
    if mock_client.is_inproc:
        out = await mock_client.get_output()
        assert isinstance(out, EngineCoreOutputs) and out.outputs == []
        return
    with pytest.raises(PeerNotProducingError) as ei:
        if mock_client.is_async:
            await client.get_output_async(timeout=0.2)
        else:
            client.get_output(timeout=0.2)
    assert isinstance(ei.value, TimeoutError) and isinstance(ei.value, ShmClientError)


async def test_get_output_with_timeout_zero_reads_what_is_there(mock_client):
    """A poll (timeout 0) looks at the ring once before it gives up: polling gets the
    outputs (it raised at once, never reading, before). The in-process client's call is
    one step, so a poll of it is one step too and never raises."""
    import asyncio
    import time

    client = mock_client.client
    await mock_client.add(req("polled", max_tokens=2))
    tokens: list[int] = []
    deadline = time.monotonic() + 30
    while len(tokens) < 2:
        try:
            if mock_client.is_async:
                out = await client.get_output_async(timeout=0)
            else:
                out = client.get_output(timeout=0)
        except PeerNotProducingError:
            assert not mock_client.is_inproc, "the in-process client's poll raised"
            assert time.monotonic() < deadline, "no output came from polling with timeout 0"
            if mock_client.is_async:
                await asyncio.sleep(0)  # (a turn of the loop, for the reader's callback)
            continue
        tokens += [t for o in out.outputs if o.request_id == "polled" for t in o.new_token_ids]
        assert time.monotonic() < deadline, "polling with timeout 0 never got both tokens"
    assert len(tokens) == 2


def _tiny_requests():
    return [req(f"tiny-{i}", prompt=[(7 * i + j) % 97 for j in range(6 + i)], max_tokens=12,
                temperature=0.0, ignore_eos=True) for i in range(6)]


_REFERENCE: dict[str, list[int]] = {}


def _reference_tokens() -> dict[str, list[int]]:
    """Greedy tokens of the tiny model in process with a KV cache too big to preempt."""
    if not _REFERENCE:
        from shmclient_engine.core import EngineCore

        core = EngineCore(TINY.replace(num_gpu_blocks=4096))
        for r in _tiny_requests():
            core.add_request(r)
        while core.has_unfinished_requests():
            for outs in core.step().values():
                for o in outs.outputs:
                    _REFERENCE.setdefault(o.request_id, []).extend(o.new_token_ids)
        core.shutdown()
    return _REFERENCE


async def test_tiny_greedy_tokens_same_on_every_client_despite_preemption(tiny_client):
    ref = _reference_tokens()
    reqs = _tiny_requests()
    # 6 requests of up to 23 tokens need 36 blocks of 4; the engine has 24: it must preempt.
    assert sum(-(-(len(r.prompt_token_ids) + 12) // 4) for r in reqs) > TINY.num_gpu_blocks
    for r in reqs:
        await tiny_client.add(r)
    res = await tiny_client.collect([r.request_id for r in reqs])
    for r in reqs:
        assert res[r.request_id]["tokens"] == ref[r.request_id], r.request_id
        assert res[r.request_id]["reason"] == FinishReason.LENGTH
    if tiny_client.is_inproc:
        assert tiny_client.client.engine_core.scheduler.num_preemptions > 0


async def test_tiny_seeded_sampling_reproducible(tiny_client):
    toks = []
    for n in range(2):
        await tiny_client.add(req(f"seed-{n}", prompt=[1, 2, 3], max_tokens=10, temperature=1.0, seed=1234))
        toks.append((await tiny_client.collect([f"seed-{n}"]))[f"seed-{n}"]["tokens"])
    assert toks[0] == toks[1]


async def test_get_output_refuses_a_bad_timeout_on_every_client(mock_client):
    """The in-process client took any ``timeout`` (-1, a string) and stepped."""
    from shmclient import InvalidRequestError

    drv = mock_client
    get = drv.client.get_output_async if drv.is_async else drv.client.get_output
    for bad in (-1, "x", float("nan")):
        with pytest.raises(InvalidRequestError, match="timeout"):
            r = get(timeout=bad)
            if drv.is_async:
                await r


async def test_add_request_takes_a_timeout_on_every_client(mock_client):
    """The README: every wait takes a timeout, ``add_request(req, timeout=...)``; the
    in-process client, which never waits, refused the argument with TypeError. Each
    checks it as the others do."""
    from shmclient import InvalidRequestError

    drv = mock_client
    add = drv.client.add_request_async if drv.is_async else drv.client.add_request

    async def call(*args, **kw):
        r = add(*args, **kw)
        return await r if drv.is_async else r

    await call(req("timed", max_tokens=2), timeout=5.0)
    assert len((await drv.collect(["timed"]))["timed"]["tokens"]) == 2
    with pytest.raises(InvalidRequestError, match="timeout"):
        await call(req("bad-timeout", max_tokens=2), timeout=-1)
