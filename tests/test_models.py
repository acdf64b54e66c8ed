"""The tiny torch model through EngineCore: seeded weights, chunked prefill and preemption
give the same tokens, seeded sampling, EOS, pooling, prompt embeds, sleep, checkpoints;
and a CUDA run (``-m cuda``)."""

from __future__ import annotations

import os

import pytest
import torch

from shmclient.config import EngineConfig
from shmclient_engine.core import EngineCore
from shmclient_engine.model import ScheduledChunk, build_model
from shmclient_engine.tiny import TinyModel, sample
from shmclient.errors import InvalidRequestError
from shmclient.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    PoolingParams,
    SamplingParams,
)

TINY = EngineConfig(model="tiny")
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
PROMPTS = {f"r{i}": [(i * 37 + j * 11) % 1000 + 3 for j in range(20 + 9 * i)] for i in range(5)}


def generate(config: EngineConfig, prompts=PROMPTS, sp=GREEDY, **kw):
    """Run every prompt to completion; (tokens, finish reasons, core)."""
    core = EngineCore(config)
    for rid, p in prompts.items():
        core.add_request(EngineCoreRequest(request_id=rid, prompt_token_ids=p,
                                           sampling_params=sp, **kw))
    tokens, finish = {}, {}
    while core.has_unfinished_requests():
        for outs in core.step().values():
            for o in outs.outputs:
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finished:
                    assert o.request_id not in finish
                    finish[o.request_id] = o.finish_reason
    assert core.model.num_cached_requests() == 0  # every KV cache was freed
    assert core.scheduler.num_free_blocks == core.num_gpu_blocks
    return tokens, finish, core


@pytest.fixture(scope="module")
def greedy_reference():
    tokens, finish, _ = generate(TINY)
    assert all(len(t) == 12 for t in tokens.values())
    return tokens


def test_weights_are_seeded_and_leave_global_rng_alone():
    state = torch.random.get_rng_state()
    a, b = TinyModel(TINY), TinyModel(TINY)
    c = TinyModel(TINY.replace(seed=1))
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(a.weights[k], b.weights[k]) for k in a.weights)
    assert not torch.equal(a.weights["wte"], c.weights["wte"])
    assert a.kv_bytes_per_token == 2 * TINY.num_layers * TINY.hidden_size * 4
    assert isinstance(build_model(TINY), TinyModel)


def test_chunked_prefill_matches_unchunked(greedy_reference):
    tokens, _, core = generate(TINY.replace(max_num_batched_tokens=7))
    assert tokens == greedy_reference


def test_preemption_recomputes_to_the_same_tokens(greedy_reference):
    cfg = TINY.replace(num_gpu_blocks=10, block_size=8, max_num_batched_tokens=24)
    tokens, finish, core = generate(cfg)
    assert core.scheduler.num_preemptions > 0
    assert tokens == greedy_reference
    assert set(finish.values()) == {FinishReason.LENGTH}


def test_kv_caches_stay_within_the_blocks_the_scheduler_granted():
    """The tiny model's caches grew by doubling: twelve requests under a 1 MiB KV budget
    held 1.59x that budget while the scheduler counted 60 of its 64 blocks in use (on a
    GPU, memory beyond gpu_memory_utilization's share). They hold at most the positions
    of the blocks in use now, after every step."""
    cfg = TINY.replace(kv_cache_memory_bytes=1 << 20, max_model_len=128)
    core = EngineCore(cfg)
    sp = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    for i in range(12):
        core.add_request(EngineCoreRequest(request_id=f"r{i}", prompt_token_ids=list(range(3, 20)),
                                           sampling_params=sp))
    peak = 0
    while core.has_unfinished_requests():
        core.step()
        held = sum(c.k[0].shape[1] for c in core.model._caches.values())
        granted = (core.num_gpu_blocks - core.scheduler.num_free_blocks) * core.block_size
        assert held <= granted, (held, granted)
        peak = max(peak, held)
    assert peak > core.num_gpu_blocks * core.block_size // 2  # the budget was really used


def test_seeded_sampling_is_reproducible_and_seed_dependent():
    def run(seed, **cfg):
        sp = SamplingParams(max_tokens=12, temperature=1.0, top_k=50, top_p=0.95, seed=seed)
        return generate(TINY.replace(**cfg), sp=sp)[0]

    first = run(7)
    assert run(7) == first
    assert run(7, num_gpu_blocks=10, block_size=8, max_num_batched_tokens=24) == first
    other = run(8)
    assert all(first[r] != other[r] for r in first)
    # Two requests with the same prompt and seed in one core agree.
    sp = SamplingParams(max_tokens=10, temperature=1.0, seed=3)
    same = generate(TINY, prompts={"a": [5, 6, 7], "b": [5, 6, 7]}, sp=sp)[0]
    assert same["a"] == same["b"]


def test_unseeded_sampling_derives_from_config_seed_and_request_id():
    sp = SamplingParams(max_tokens=10, temperature=1.0)
    a = generate(TINY, sp=sp)[0]
    assert generate(TINY, sp=sp)[0] == a
    assert generate(TINY.replace(seed=5), sp=sp)[0] != a
    assert len({tuple(t) for t in a.values()}) == len(a)


def test_config_eos_stops_and_ignore_eos_continues(greedy_reference):
    seq = greedy_reference["r1"]
    k = next(i for i in range(2, 12) if seq[i] not in seq[:i])
    cfg = TINY.replace(eos_token_id=seq[k])
    tokens, finish, _ = generate(cfg, prompts={"r1": PROMPTS["r1"]})
    assert tokens["r1"] == seq[:k + 1] and finish["r1"] is FinishReason.STOP
    ign = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tokens, finish, _ = generate(cfg, prompts={"r1": PROMPTS["r1"]}, sp=ign)
    assert tokens["r1"] == seq and finish["r1"] is FinishReason.LENGTH


def test_sampler_top_k_top_p():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(100, generator=g)
    best = int(logits.argmax())
    top3 = set(torch.topk(logits, 3).indices.tolist())
    assert sample(logits, SamplingParams(temperature=0.0), None) == best
    assert sample(logits, SamplingParams(temperature=1.0, top_k=1), g) == best
    assert sample(logits, SamplingParams(temperature=1.0, top_p=1e-6), g) == best
    draws = {sample(logits, SamplingParams(temperature=2.0, top_k=3), g) for _ in range(200)}
    assert draws == top3
    draws = {sample(logits, SamplingParams(temperature=5.0), g) for _ in range(200)}
    assert len(draws) > 20


@pytest.mark.parametrize("sp", [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
                                SamplingParams(temperature=1.0, top_k=3, top_p=0.5)])
def test_sampler_gives_a_token_for_logits_that_are_not_finite(sp):
    """Finite embeddings can still overflow to NaN or inf logits: a token comes out (the
    highest finite one, or an inf), never an error that would end the engine's step."""
    g = torch.Generator().manual_seed(0)
    nan = float("nan")
    assert sample(torch.tensor([nan, 1.0, 3.0, nan]), sp, g) == 2 if sp.temperature == 0.0 else \
        sample(torch.tensor([nan, 1.0, 3.0, nan]), sp, g) in (1, 2)
    assert sample(torch.tensor([nan, nan, nan]), sp, g) in (0, 1, 2)
    assert sample(torch.tensor([1.0, float("inf"), nan]), sp, g) == 1
    assert sample(torch.tensor([float("-inf"), 0.5, float("-inf")]), sp, g) == 1


@pytest.mark.parametrize("sp", [SamplingParams(temperature=0.5), SamplingParams(temperature=1e-4),
                                SamplingParams(temperature=0.5, top_k=2, top_p=0.9)])
def test_sampler_gives_the_top_token_where_a_temperature_below_1_would_overflow(sp):
    """An inf logit wins at any temperature, and finite logits near float32's maximum
    divided by a temperature below 1 overflow: either way the highest comes out, where
    softmax of an inf used to give NaN and multinomial raised (ending the engine's step)."""
    g = torch.Generator().manual_seed(0)
    inf, nan = float("inf"), float("nan")
    assert sample(torch.tensor([inf, 0.0, 1.0]), sp, g) == 0
    assert sample(torch.tensor([0.0, 1.0, inf, nan]), sp, g) == 2
    assert sample(torch.tensor([nan, 3e38, 1.0]), sp, g) == 1
    assert sample(torch.tensor([-3e38, 1.0, 3e38]), sp, g) == 2
    assert {sample(torch.tensor([3e38, 3e38, -inf]), sp, g) for _ in range(20)} <= {0, 1}


def test_a_huge_prompt_embedding_is_served_not_fatal():
    """Finite values so large that the model's arithmetic overflows: the request is
    served (whatever its tokens), the engine goes on."""
    core = EngineCore(TINY)
    huge = torch.full((3, TINY.hidden_size), 3e38)
    for i, temperature in enumerate((0.0, 1.0)):
        core.add_request(EngineCoreRequest(request_id=f"h{i}", prompt_embeds=huge,
                                           sampling_params=SamplingParams(max_tokens=3, temperature=temperature)))
    done: dict = {}
    for _ in range(20):
        for out in core.step().values():
            for o in out.outputs:
                done.setdefault(o.request_id, []).extend(o.new_token_ids)
        if not core.has_work():
            break
    assert sorted(done) == ["h0", "h1"] and all(len(t) == 3 for t in done.values()), done


def test_prompt_embeds_of_the_token_embeddings_match_ids(greedy_reference):
    core = EngineCore(TINY)
    emb = core.model.weights["wte"][torch.tensor(PROMPTS["r2"])].clone()
    tokens, _, _ = generate(TINY.replace(max_num_batched_tokens=16),
                            prompts={"r2": None}, prompt_embeds=emb)
    assert tokens["r2"] == greedy_reference["r2"]


def test_prompt_embeds_wrong_width_is_rejected():
    core = EngineCore(TINY)
    bad = EngineCoreRequest(request_id="x", prompt_embeds=torch.zeros(4, 48))
    with pytest.raises(InvalidRequestError, match=r"expected hidden size 64.*\[4, 48\]"):
        core.add_request(bad)
    assert not core.has_unfinished_requests()


def test_pooling_mean_of_hidden_states_chunked_or_not():
    pp = PoolingParams()
    outs = {}
    for budget in (5, 8192):
        core = EngineCore(TINY.replace(max_num_batched_tokens=budget))
        core.add_request(EngineCoreRequest(request_id="p", prompt_token_ids=PROMPTS["r1"],
                                           pooling_params=pp))
        core.add_request(EngineCoreRequest(request_id="n", prompt_token_ids=PROMPTS["r1"],
                                           pooling_params=PoolingParams(normalize=True)))
        got = {}
        while core.has_unfinished_requests():
            for o in core.step().get(0, EngineCoreOutputs()).outputs:
                assert o.request_id not in got and o.finish_reason is FinishReason.STOP
                got[o.request_id] = o.pooling_output
        assert core.model.num_cached_requests() == 0
        outs[budget] = got
    assert outs[5]["p"].shape == (64,) and outs[5]["p"].dtype == torch.float32
    assert torch.allclose(outs[5]["p"], outs[8192]["p"], atol=1e-5)
    assert torch.allclose(outs[5]["n"].norm(), torch.tensor(1.0))
    assert torch.allclose(outs[5]["n"], outs[5]["p"] / outs[5]["p"].norm(), atol=1e-6)


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_wake_keeps_outputs(greedy_reference, level):
    core = EngineCore(TINY)
    core.add_request(EngineCoreRequest(request_id="r0", prompt_token_ids=PROMPTS["r0"],
                                       sampling_params=GREEDY))
    got = []
    for _ in range(3):
        got += core.step()[0].outputs[0].new_token_ids
    core.sleep(level, "keep")  # kept, recomputed after wake-up
    if level == 2:
        assert core.model.weights is None
    assert core.step() == {} and core.model.num_cached_requests() == 0
    core.wake_up()
    while core.has_unfinished_requests():
        for o in core.step()[0].outputs:
            got += o.new_token_ids
    assert got == greedy_reference["r0"]


def test_save_sharded_state_round_trips(tmp_path):
    core = EngineCore(TINY)
    core.save_sharded_state(str(tmp_path), max_size=100_000)
    files = sorted(os.listdir(tmp_path))
    assert len(files) > 1 and files[0] == "model-rank-0-part-0.pt"
    loaded = {}
    for f in files:
        loaded.update(torch.load(tmp_path / f))
    state = core.model.state_dict()
    assert loaded.keys() == state.keys()
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    assert core.collective_rpc("num_cached_requests") == [0]


def test_execute_refuses_a_chunk_that_skips_positions():
    model = TinyModel(TINY)
    chunk = ScheduledChunk("a", [1, 2], None, 5, True, GREEDY, None)
    with pytest.raises(RuntimeError, match="starts at 5"):
        model.execute([chunk])


@pytest.mark.cuda
def test_tiny_model_on_cuda(greedy_reference):
    if not torch.cuda.is_available():
        pytest.skip("torch.cuda.is_available() is False")
    cfg = TINY.replace(device="cuda", gpu_memory_utilization=0.05)
    tokens, finish, core = generate(cfg)
    free, _ = torch.cuda.mem_get_info()
    assert 0 < core.num_gpu_blocks and core.max_model_len == min(
        cfg.max_model_len, core.num_gpu_blocks * cfg.block_size)
    assert core.model.weights["wte"].is_cuda
    assert tokens == greedy_reference
    # Seeded sampling on a CUDA generator is reproducible; pooling stays on the GPU.
    sp = SamplingParams(max_tokens=8, temperature=1.0, seed=1)
    assert generate(cfg, sp=sp)[0] == generate(cfg, sp=sp)[0]
    core = EngineCore(cfg.replace(num_gpu_blocks=10, block_size=8, max_num_batched_tokens=24))
    emb = torch.randn(30, 64, device="cuda")
    core.add_request(EngineCoreRequest(request_id="p", prompt_embeds=emb,
                                       pooling_params=PoolingParams()))
    out = None
    while core.has_unfinished_requests():
        for o in core.step().get(0, EngineCoreOutputs()).outputs:
            out = o.pooling_output
    assert out.is_cuda and out.shape == (64,)
    core.sleep(1)
    assert core.model.weights is None
    core.wake_up()
    assert core.model.weights["wte"].is_cuda
    core.shutdown()
