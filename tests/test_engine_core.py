"""EngineCore with the mock model: the output stream, aborts, stops, validation, pooling,
capacity sizing and the utility methods. No client, no transport."""

from __future__ import annotations

import os
import sys

import msgspec
import pytest
import torch

from shmclient.config import EngineConfig
from shmclient_engine.core import UTILITY_METHODS, EngineCore
from shmclient_engine.request import derive_seed
from shmclient_engine.model import mock_next_token
from shmclient.errors import ConfigError, DuplicateRequestError, InvalidRequestError
from shmclient.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    LoRARequest,
    PoolingParams,
    SamplingParams,
    UtilityRequest,
)
from shmclient.channel import REQ_UTILITY

CFG = EngineConfig()


def predict(prompt: list[int], n: int, embeds_rows: int = 0) -> list[int]:
    """Tokens the mock generates after ``prompt`` (or after ``embeds_rows`` embedding rows)."""
    last, pos = (0, embeds_rows - 1) if embeds_rows else (prompt[-1], len(prompt) - 1)
    out = []
    for _ in range(n):
        last = mock_next_token(last, pos, CFG.vocab_size, CFG.eos_token_id)
        pos += 1
        out.append(last)
    return out


def req(rid: str, prompt=(1, 2, 3), max_tokens: int = 20, client_index: int = 0,
        **kw) -> EngineCoreRequest:
    sp = kw.pop("sampling_params", SamplingParams(max_tokens=max_tokens))
    return EngineCoreRequest(request_id=rid, prompt_token_ids=list(prompt) if prompt else None,
                             sampling_params=sp, client_index=client_index, **kw)


class Run:
    """Collects everything step() emits, checking each request finishes exactly once."""

    def __init__(self, core: EngineCore):
        self.core = core
        self.tokens: dict[str, list[int]] = {}
        self.outputs: dict[str, list] = {}
        self.finish: dict[str, FinishReason] = {}
        self.steps = 0

    def step(self) -> dict[int, EngineCoreOutputs]:
        res = self.core.step()
        self.steps += 1
        for client, outs in res.items():
            for o in outs.outputs:
                assert o.request_id not in self.finish, f"output after finish: {o}"
                self.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                self.outputs.setdefault(o.request_id, []).append((client, o))
                if o.finished:
                    self.finish[o.request_id] = o.finish_reason
                    assert o.request_id in outs.finished_requests
        return res

    def drain(self, limit: int = 10_000) -> "Run":
        while self.core.has_unfinished_requests():
            self.step()
            assert self.steps < limit
        return self


@pytest.fixture
def core():
    c = EngineCore(CFG)
    yield c
    c.shutdown()


def test_ten_requests_get_exactly_max_tokens(core):
    for i in range(10):
        core.add_request(req(f"r{i}", [5, i + 1]))
    run = Run(core).drain()
    for i in range(10):
        assert run.tokens[f"r{i}"] == predict([5, i + 1], 20)
        assert run.finish[f"r{i}"] is FinishReason.LENGTH
        *first, (_, last) = run.outputs[f"r{i}"]
        assert last.finished and not any(o.finished for _, o in first)
    assert run.steps == 20
    assert core.step() == {}  # nothing to do: nothing to report


def test_abort_every_second_request(core):
    for i in range(10):
        core.add_request(req(f"r{i}"))
        if i % 2:
            core.abort_requests([f"r{i}"])
    run = Run(core)
    run.step()
    core.abort_requests(["r0"])  # running now
    run.drain()
    for i in range(1, 10, 2):
        assert run.finish[f"r{i}"] is FinishReason.ABORT and run.tokens[f"r{i}"] == []
    assert run.finish["r0"] is FinishReason.ABORT and len(run.tokens["r0"]) == 1
    for i in range(2, 10, 2):
        assert run.finish[f"r{i}"] is FinishReason.LENGTH and len(run.tokens[f"r{i}"]) == 20
    # Aborting finished and unknown requests is harmless and emits nothing.
    core.abort_requests(["r2", "r1", "nope"])
    core.abort_requests([])
    assert not core.has_unfinished_requests() and core.step() == {}
    assert core.scheduler.num_free_blocks == core.num_gpu_blocks


def test_abort_twice_emits_once_and_blocks_id_reuse_until_reported(core):
    core.add_request(req("a"))
    core.abort_requests(["a", "a"])
    core.abort_requests(["a"])
    with pytest.raises(InvalidRequestError, match="already live"):
        core.add_request(req("a"))
    assert core.has_unfinished_requests()
    out = core.step()[0]
    assert [(o.request_id, o.finish_reason) for o in out.outputs] == [("a", FinishReason.ABORT)]
    core.add_request(req("a", max_tokens=2))  # reported: the id is free again
    assert Run(core).drain().tokens["a"] == predict([1, 2, 3], 2)


def test_a_live_or_aborted_id_is_refused_as_a_duplicate_before_any_other_check(core):
    """The serving loop drops a DuplicateRequestError without an answer and answers any
    other refusal with ERROR under the request's id: an invalid request under a live id
    (or one aborted whose ABORT output is not out) must be refused as a duplicate, else
    that id is finished at the frontend while it goes on (or finishes twice)."""
    core.add_request(req("a"))
    core.add_request(req("b"))
    core.abort_requests(["b"])
    for rid in ("a", "b"):
        with pytest.raises(DuplicateRequestError, match="already live"):
            core.add_request(req(rid, prompt=[CFG.vocab_size]))
    with pytest.raises(InvalidRequestError) as e:  # a free id: the other check speaks
        core.add_request(req("c", prompt=[CFG.vocab_size]))
    assert type(e.value) is InvalidRequestError and "vocabulary" in str(e.value)


def test_outputs_are_routed_by_client_index(core):
    core.add_request(req("x", client_index=0, max_tokens=2))
    core.add_request(req("y", client_index=3, max_tokens=2))
    res = core.step()
    assert sorted(res) == [0, 3]
    assert [o.request_id for o in res[3].outputs] == ["y"]
    core.abort_requests(["y"])
    res = core.step()
    assert res[3].outputs[0].finish_reason is FinishReason.ABORT
    assert res[3].finished_requests == {"y"} and res[0].finished_requests == {"x"}


def test_stop_tokens_and_eos(core):
    seq = predict([1, 2, 3], 20)
    core.add_request(req("stop", sampling_params=SamplingParams(
        max_tokens=20, stop_token_ids=[seq[4]])))
    core.add_request(req("eos", eos_token_id=seq[6]))
    core.add_request(req("ign", eos_token_id=seq[6], sampling_params=SamplingParams(
        max_tokens=20, ignore_eos=True)))
    run = Run(core).drain()
    assert run.tokens["stop"] == seq[:5] and run.finish["stop"] is FinishReason.STOP
    assert run.outputs["stop"][-1][1].stop_reason == seq[4]
    assert run.tokens["eos"] == seq[:7] and run.finish["eos"] is FinishReason.STOP
    assert run.outputs["eos"][-1][1].stop_reason is None
    assert run.tokens["ign"] == seq and run.finish["ign"] is FinishReason.LENGTH


def test_mock_never_emits_config_eos():
    # (31 * 0 + 7 * pos + 11) % 1024 == 2 for no pos, so look for a colliding case directly.
    last = next(t for t in range(1024) if (31 * t + 11) % 1024 == CFG.eos_token_id)
    assert mock_next_token(last, 0, 1024, CFG.eos_token_id) == CFG.eos_token_id + 1


def test_max_model_len_finishes_with_length():
    c = EngineCore(CFG.replace(max_model_len=16))
    c.add_request(req("a", list(range(10)), max_tokens=100))
    run = Run(c).drain()
    assert len(run.tokens["a"]) == 6 and run.finish["a"] is FinishReason.LENGTH


def test_chunked_prefill_spans_steps_and_matches_big_budget():
    prompt = [(i * 13) % 1000 + 3 for i in range(300)]
    results = {}
    for budget in (64, 8192):
        c = EngineCore(CFG.replace(max_num_batched_tokens=budget))
        c.add_request(req("long", prompt, max_tokens=5))
        c.add_request(req("short", [4, 5], max_tokens=5))
        run = Run(c)
        first = run.step()
        results[budget] = (run.drain().tokens, run.steps)
        if budget == 64:
            assert first == {}  # the long prompt uses the whole budget of the first step
    assert results[64][0] == results[8192][0]
    assert results[64][1] > results[8192][1] == 5


def test_preemption_keeps_tokens_identical():
    prompts = {f"r{i}": [i + 3] * (10 + i) for i in range(6)}
    runs = []
    for blocks in (None, 6):
        c = EngineCore(CFG.replace(num_gpu_blocks=blocks, block_size=8) if blocks
                       else CFG.replace(block_size=8))
        for rid, p in prompts.items():
            c.add_request(req(rid, p, max_tokens=25))
        runs.append((Run(c).drain(), c.scheduler.num_preemptions))
    (plain, n0), (tight, n1) = runs
    assert n0 == 0 and n1 > 0
    assert plain.tokens == tight.tokens
    assert all(r is FinishReason.LENGTH for r in tight.finish.values())


# Checked in one test (the autouse leak check costs ~0.1 s a test).
BAD_REQUESTS = [
    (lambda: req("e", prompt=()), "empty prompt"),
    (lambda: req("e", prompt=list(range(3000))), "max_model_len"),
    (lambda: req("e", sampling_params=SamplingParams(max_tokens=0)), "max_tokens"),
    (lambda: req("e", sampling_params=SamplingParams(temperature=-1.0)), "temperature"),
    (lambda: req("e", sampling_params=SamplingParams(top_p=0.0)), "top_p"),
    (lambda: req("e", sampling_params=SamplingParams(top_k=-2)), "top_k"),
    (lambda: req("e", sampling_params=SamplingParams(seed=2**70)), "seed"),
    (lambda: req("e", prompt=[1, 1024]), r"prompt_token_ids\[1\]=1024"),
    (lambda: req("e", prompt=[-1]), "outside the vocabulary"),
    (lambda: req("e", prompt=None, prompt_embeds=torch.zeros(3, 32)), "expected hidden size 64"),
    (lambda: req("e", prompt=None, prompt_embeds=torch.zeros(64)), r"\[num_tokens, 64\]"),
    (lambda: req("e", prompt=None, prompt_embeds=torch.zeros(0, 64)), "empty prompt"),
    (lambda: req("e", prompt=None, prompt_embeds=torch.zeros(2, 64, dtype=torch.long)),
     "floating point"),
    (lambda: req("e", prompt=None, prompt_embeds=[[0.0] * 64]), "torch.Tensor"),
    (lambda: req("e", prompt_embeds=torch.zeros(2, 64)), "not both"),
    (lambda: req("e", pooling_params=PoolingParams()), "not both"),
    (lambda: req("e", sampling_params=None, pooling_params=PoolingParams(task="classify")),
     "not supported"),
    (lambda: req("", ), "request_id"),
    (lambda: req("e", client_index=-1), "client_index"),
    (lambda: req("live"), "already live"),
]


def test_invalid_requests_are_rejected_alone():
    for make, match in BAD_REQUESTS:
        core = EngineCore(CFG)
        core.add_request(req("live", max_tokens=3))
        run = Run(core)
        run.step()
        before = (dict(core.scheduler.requests), core.scheduler.num_free_blocks)
        with pytest.raises(InvalidRequestError, match=match):
            core.add_request(make())
        assert (dict(core.scheduler.requests), core.scheduler.num_free_blocks) == before
        core.add_request(req("after", max_tokens=3))
        run.drain()
        assert len(run.tokens["live"]) == 3 and len(run.tokens["after"]) == 3, match
        assert "e" not in run.outputs


def test_default_sampling_params_when_none_given(core):
    core.add_request(EngineCoreRequest(request_id="d", prompt_token_ids=[7]))
    run = Run(core).drain()
    assert len(run.tokens["d"]) == SamplingParams().max_tokens


def test_prompt_embeds_generate_by_documented_rule(core):
    core.add_request(req("emb", prompt=None, prompt_embeds=torch.randn(5, 64), max_tokens=4))
    assert Run(core).drain().tokens["emb"] == predict([], 4, embeds_rows=5)


def test_float8_prompt_embeds_that_torch_cannot_check_directly_are_taken():
    """torch has no isfinite for float8_e4m3fn: the check runs in float32 (it raised a
    bare NotImplementedError, no field named)."""
    core = EngineCore(CFG)
    emb = torch.randn(3, 64).to(torch.float8_e4m3fn)
    core.add_request(req("f8", prompt=None, prompt_embeds=emb, max_tokens=2))
    assert len(Run(core).drain().tokens["f8"]) == 2


def test_pooling_with_ids_and_embeds():
    c = EngineCore(CFG.replace(max_num_batched_tokens=16))
    emb = torch.randn(40, 64, dtype=torch.bfloat16)
    c.add_request(req("ids", [3, 1, 4], sampling_params=None, pooling_params=PoolingParams()))
    c.add_request(req("emb", prompt=None, prompt_embeds=emb, sampling_params=None,
                      pooling_params=PoolingParams()))
    c.add_request(req("norm", [3, 4], sampling_params=None,
                      pooling_params=PoolingParams(normalize=True)))
    run = Run(c).drain()
    outs = {rid: o for rid, [(_, o)] in run.outputs.items()}  # exactly one output each
    assert all(o.finish_reason is FinishReason.STOP and o.new_token_ids == []
               for o in outs.values())
    assert torch.equal(outs["emb"].pooling_output, emb.float().mean(0))
    assert torch.equal(outs["ids"].pooling_output,
                       torch.tensor([float([3, 1, 4][j % 3]) for j in range(64)]))
    assert torch.allclose(outs["norm"].pooling_output.norm(), torch.tensor(1.0))
    assert run.steps == 3  # the 40 embedding rows were chunked by the 16-token budget


def test_capacity_from_memory_budget_and_fitted_max_model_len():
    c = EngineCore(CFG)
    per_token = 2 * CFG.num_layers * CFG.hidden_size * 4
    assert c.num_gpu_blocks == CFG.kv_cache_memory_bytes // (per_token * CFG.block_size)
    assert c.max_model_len == 2048 and c.block_size == 16
    small = EngineCore(CFG.replace(kv_cache_memory_bytes=per_token * 16 * 10 + 5))
    assert small.num_gpu_blocks == 10 and small.max_model_len == 160
    given = EngineCore(CFG.replace(num_gpu_blocks=3, block_size=4, max_model_len=100))
    assert (given.num_gpu_blocks, given.max_model_len) == (3, 12)
    with pytest.raises(InvalidRequestError, match="max_model_len=12"):
        given.add_request(req("x", list(range(13))))
    with pytest.raises(ConfigError, match="kv_cache_memory_bytes"):
        EngineCore(CFG.replace(kv_cache_memory_bytes=100))


def test_cuda_device_without_cuda_is_a_config_error():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(ConfigError, match="device"):
        EngineCore(CFG.replace(device="cuda"))


# --------------------------------------------------------------------- utilities

def test_utility_methods_exist_and_unknown_ones_fail(core):
    for name in UTILITY_METHODS:
        assert callable(getattr(core, name))
    for bad in ("nope", "step", "add_request", "shutdown", "__init__", "_make_request"):
        with pytest.raises(ValueError, match=f"unknown utility method '{bad}'"):
            core.call_utility(bad, ())
    core.add_request(req("still", max_tokens=2))
    assert len(Run(core).drain().tokens["still"]) == 2


def test_echo_and_simple_utilities(core):
    t = torch.arange(6).reshape(2, 3)
    assert core.call_utility("echo", (t,)) is t
    assert core.call_utility("echo", ({"a": [1, None]},)) == {"a": [1, None]}
    assert core.call_utility("echo", (None,)) is None
    assert core.call_utility("get_supported_tasks", ()) == ("generate", "embed")
    assert core.call_utility("reset_prefix_cache", ()) is True
    assert core.call_utility("profile", (True,)) is None and core.profiling
    core.call_utility("profile", (False,))
    assert not core.profiling
    assert core.call_utility("execute_dummy_batch", ()) is None
    assert core.call_utility("collective_rpc", ("num_cached_requests",)) == [0]
    with pytest.raises(ValueError):
        core.collective_rpc("_caches")
    with pytest.raises(AttributeError):
        core.collective_rpc("no_such_method")
    # The methods the core drives the model with: called behind its back, the next
    # step failed and the engine process died (a sleeping model, a freed cache).
    core.add_request(req("live", max_tokens=3))
    core.step()
    with pytest.raises(ValueError, match="call the sleep utility"):
        core.collective_rpc("sleep", None, (2,))
    with pytest.raises(ValueError, match="abort the request"):
        core.collective_rpc("free", args=("live",))
    assert len(Run(core).drain().tokens["live"]) == 2  # (one came with the step above)


@pytest.mark.parametrize("mode", ["abort", "keep"])
def test_sleep_and_wake_up(core, mode):
    core.add_request(req("a", max_tokens=5))
    run = Run(core)
    run.step()
    core.call_utility("sleep", (1, mode))
    assert core.is_sleeping()
    if mode == "abort":
        run.step()
        assert run.finish["a"] is FinishReason.ABORT and not core.has_unfinished_requests()
    else:
        for _ in range(3):
            run.step()  # nothing scheduled while asleep
        assert run.tokens["a"] == predict([1, 2, 3], 1) and "a" not in run.finish
    assert core.wake_up(["weights"]) is False
    assert core.is_sleeping()
    assert core.wake_up(["kv_cache"]) is True
    assert not core.is_sleeping()
    core.add_request(req("b", max_tokens=3))
    run.drain()
    assert len(run.tokens["b"]) == 3
    if mode == "keep":  # resumed (recomputed) after wake-up, no token lost or repeated
        assert run.tokens["a"] == predict([1, 2, 3], 5)


def test_sleep_wait_is_refused_in_process_as_vllm():
    # vLLM's in-process EngineCore raises ValueError for "wait": nothing would step it.
    c = EngineCore(CFG)
    try:
        with pytest.raises(ValueError, match="in-process"):
            c.sleep(1, "wait")
        with pytest.raises(ValueError, match="in-process"):
            c.pause_scheduler("wait")
        assert not c.is_sleeping()
    finally:
        c.shutdown()


def test_sleep_wait_drains_running_requests_then_sleeps_when_a_loop_steps_the_engine():
    # The engine process's loop (supports_wait) keeps stepping: the requests that came
    # before the sleep (running, or still queued) finish, one added after it stays
    # queued, then the model sleeps.
    c = EngineCore(CFG, supports_wait=True)
    try:
        c.add_request(req("running", max_tokens=6))
        run = Run(c)
        run.step()
        c.add_request(req("before", max_tokens=3))
        fut = c.sleep(1, "wait")
        assert fut is not None and not fut.done() and c.is_scheduler_paused()
        c.add_request(req("queued", max_tokens=2))
        while not fut.done():
            assert c.has_work()
            run.step()
            assert run.steps < 50
        assert fut.result() is None
        assert run.tokens["running"] == predict([1, 2, 3], 6)
        assert run.finish["running"] is FinishReason.LENGTH
        assert run.tokens["before"] == predict([1, 2, 3], 3)
        assert "queued" not in run.tokens and c.is_sleeping() and not c.has_work()
        assert c.wake_up() is True
        run.drain()
        assert run.tokens["queued"] == predict([1, 2, 3], 2)
        # Nothing running: the pause completes at once.
        assert c.pause_scheduler("wait") is None and c.is_scheduler_paused()
        c.resume_scheduler()
        assert not c.is_scheduler_paused()
    finally:
        c.shutdown()


def test_wake_up_during_a_wait_sleep_still_draining_keeps_the_engine_awake():
    """wake_up() during a "wait" sleep still draining returned True, then the drain's
    end put the model to sleep anyway and later requests never ran. The wake-up (its
    resume) ends that sleep: its call fails saying so, the model stays awake."""
    c = EngineCore(CFG, supports_wait=True)
    try:
        c.add_request(req("running", max_tokens=4))
        run = Run(c)
        run.step()
        fut = c.sleep(1, "wait")
        assert not fut.done()
        assert c.wake_up() is True
        with pytest.raises(RuntimeError, match="resumed .* before the running requests had drained"):
            fut.result(timeout=0)
        c.add_request(req("after", max_tokens=2))
        run.drain()
        assert not c.is_sleeping()
        assert run.tokens["running"] == predict([1, 2, 3], 4)
        assert run.tokens["after"] == predict([1, 2, 3], 2)
    finally:
        c.shutdown()


def test_resume_during_a_wait_pause_ends_the_pause_call():
    """A resume_scheduler() during a "wait" pause left that pause's call waiting for an
    idle engine, which steady traffic may never give; it ends with an error now."""
    c = EngineCore(CFG, supports_wait=True)
    try:
        c.add_request(req("running", max_tokens=4))
        run = Run(c)
        run.step()
        fut = c.pause_scheduler("wait")
        c.resume_scheduler()
        assert not c.is_scheduler_paused()
        with pytest.raises(RuntimeError, match="this pause ended there"):
            fut.result(timeout=0)
        run.drain()
        assert run.tokens["running"] == predict([1, 2, 3], 4)
    finally:
        c.shutdown()


def test_pause_scheduler_keep_schedules_nothing_and_keeps_request_state(core):
    core.add_request(req("kept", max_tokens=8))
    run = Run(core)
    run.step()
    run.step()
    assert core.pause_scheduler("keep", clear_cache=False) is None
    assert core.is_scheduler_paused() and core.is_sleeping()
    core.add_request(req("new", max_tokens=2))
    for _ in range(3):
        assert run.step() == {} and not core.has_work()
    assert core.scheduler.requests["kept"].num_computed_tokens > 0  # its KV is kept
    core.resume_scheduler()
    run.drain()
    assert run.tokens["kept"] == predict([1, 2, 3], 8)
    assert run.tokens["new"] == predict([1, 2, 3], 2)
    assert core.scheduler.num_preemptions == 0


def test_pause_scheduler_abort_aborts_and_queues_later_adds(core):
    core.add_request(req("gone", max_tokens=8))
    run = Run(core)
    run.step()
    core.pause_scheduler("abort")
    core.add_request(req("later", max_tokens=2))
    run.step()
    assert run.finish == {"gone": FinishReason.ABORT}
    assert not core.has_work() and core.has_unfinished_requests()
    core.resume_scheduler()
    run.drain()
    assert run.tokens["later"] == predict([1, 2, 3], 2)


def test_reset_prefix_cache_is_false_while_requests_run_unless_told_to_reset_them(core):
    # vLLM: the reset fails (False) while running requests hold KV blocks;
    # reset_running_requests=True preempts them first and then succeeds.
    assert core.reset_prefix_cache() is True
    core.add_request(req("r", max_tokens=6))
    run = Run(core)
    run.step()
    held = core.scheduler.num_free_blocks
    assert core.call_utility("reset_prefix_cache", (False, False)) is False
    assert core.scheduler.num_free_blocks == held and core.scheduler.num_preemptions == 0
    assert core.call_utility("reset_prefix_cache", (True, True)) is True
    assert core.scheduler.num_free_blocks == core.scheduler.num_gpu_blocks
    assert core.scheduler.num_preemptions == 1
    run.drain()
    assert run.tokens["r"] == predict([1, 2, 3], 6)  # recomputed, nothing lost
    with pytest.raises(ValueError, match="reset_running_requests"):
        core.reset_prefix_cache("yes")


def test_profile_takes_vllm_arguments_and_counts_steps(core):
    core.profile(True, "pfx", delay_iterations=1, max_iterations=3)
    assert core.profiling
    core.add_request(req("p", max_tokens=10))
    run = Run(core)
    for _ in range(6):
        run.step()
    assert not core.profiling  # stopped by itself after max_iterations
    assert core.last_profile["prefix"] == "pfx" and core.last_profile["steps"] == 3
    assert core.last_profile["tokens"] == 3  # one decode token per step after the delay
    core.profile(False)  # stopping with no session is harmless
    with pytest.raises(ValueError, match="max_iterations"):
        core.profile(True, None, None, -1)


def test_weight_version_mm_and_encoder_cache(core):
    assert core.get_weight_version() == "default"  # vLLM's initial value
    core.call_utility("set_weight_version", ("v2",))
    assert core.call_utility("get_weight_version", ()) == "v2"
    with pytest.raises(ValueError, match="weight_version"):
        core.set_weight_version(2)
    assert core.reset_mm_cache() is None and core.reset_encoder_cache() is None


def test_sleep_and_wake_up_reject_bad_arguments(core):
    with pytest.raises(ValueError, match="level"):
        core.sleep(3)
    with pytest.raises(ValueError, match="level"):
        core.sleep(True)
    with pytest.raises(ValueError, match="mode"):
        core.sleep(1, "later")
    with pytest.raises(ValueError, match="tags"):
        core.wake_up(["gpu"])
    assert not core.is_sleeping()


def test_lora_bookkeeping(core):
    assert core.list_loras() == set()
    assert core.add_lora(LoRARequest("a", 1, "/x"))
    # A LoRARequest that crossed the wire as an untyped msgpack array is accepted too.
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(LoRARequest("b", 2)))
    assert core.call_utility("add_lora", (wire,))
    assert core.list_loras() == {1, 2}
    assert core.pin_lora(1) and not core.pin_lora(9)
    assert core.remove_lora(1) and not core.remove_lora(1)
    assert core.list_loras() == {2}


def test_save_sharded_state_writes_model_state(core, tmp_path):
    core.save_sharded_state(str(tmp_path / "ckpt"))
    files = os.listdir(tmp_path / "ckpt")
    assert files == ["model-rank-0-part-0.pt"]
    assert torch.load(tmp_path / "ckpt" / files[0]) == {}


def test_shutdown_is_idempotent():
    c = EngineCore(CFG)
    c.add_request(req("a"))
    c.shutdown()
    c.shutdown()
    assert not c.has_unfinished_requests()
    with pytest.raises(RuntimeError, match="shut down"):
        c.add_request(req("b"))


def test_derived_seed_is_stable_and_request_specific():
    assert derive_seed(0, "a") == derive_seed(0, "a")
    assert len({derive_seed(0, "a"), derive_seed(1, "a"), derive_seed(0, "b")}) == 3
    assert 0 <= derive_seed(123, "x") < 2**63


# --------------------------------------------------------------------- engine loop

class _RecordingChannel:
    """Stands in for the engine's channel: records what is sent, never blocks."""

    def __init__(self) -> None:
        self.sent: list[EngineCoreOutputs] = []

    def encode(self, obj):
        return obj

    def send_encoded(self, rtype, payload, *, timeout=None, alive=None) -> None:
        self.sent.append(payload)

    def send_nowait(self, rtype, payload) -> None:  # the sans-IO face the loop uses
        self.sent.append(payload)

    def wait_send(self, timeout, *, spin=None, first=True) -> bool:
        return True

    def abandon(self, payload) -> None:
        pass

    def try_recv(self):
        return []


class _NoControl:
    def poll(self, *a, **k):
        return 0


def test_refused_and_undecodable_requests_are_queued_not_sent_from_handle():
    from shmclient.serve_loop import EngineProc
    from shmclient_engine import make_core
    from shmclient.channel import REQ_ABORT, REQ_ADD, REQ_UTILITY, BadMessage

    channel = _RecordingChannel()
    proc = EngineProc(_NoControl(), os.getppid(), CFG, channel, make_core)
    try:
        proc.handle(REQ_ADD, req("refused", sampling_params=SamplingParams(top_p=0.0)))
        proc.handle(REQ_ADD, BadMessage(REQ_ADD, "Expected `int`, got `float` - at `$[1][0]`",
                                        ["undecodable", [1.5]]))
        proc.handle(REQ_ADD, BadMessage(REQ_ADD, "Expected `str`, got `int` - at `$[0]`", [7]))
        proc.handle(REQ_ABORT, BadMessage(REQ_ABORT, "Expected `str`", [1]))
        proc.handle(REQ_UTILITY, BadMessage(REQ_UTILITY, "Expected `str`", [0, 9, 123, []]))
        # handle() runs while send() waits for ring room: it must never send itself.
        assert channel.sent == []
        proc.flush_rejected()
        (batch,) = channel.sent
        outs = {o.request_id: o for o in batch.outputs}
        assert set(outs) == {"refused", "undecodable"} == batch.finished_requests
        assert all(o.finish_reason is FinishReason.ERROR for o in outs.values())
        assert "top_p" in outs["refused"].stop_reason
        assert "Expected `int`, got `float`" in outs["undecodable"].stop_reason
        (reply,) = proc.replies
        assert reply.utility_output.call_id == 9
        assert "Expected `str`" in reply.utility_output.failure_message
        assert not proc.core.has_unfinished_requests()
    finally:
        proc.core.shutdown()


class _ScriptedChannel(_RecordingChannel):
    """A recording channel that hands the loop one batch of messages on its first read."""

    def __init__(self, messages) -> None:
        super().__init__()
        self.messages = list(messages)

    def try_recv(self):
        got, self.messages = self.messages, []
        return got


def _loop_events(messages, stop_after_steps=None):
    """Run the engine loop over one running request and ``messages`` (read at its first
    turn): what it did, in order: "step", ("out", request ids and finish reasons) and
    ("reply", call_id)."""
    from shmclient.serve_loop import EngineProc
    from shmclient_engine import make_core

    channel = _ScriptedChannel(messages)
    proc = EngineProc(_NoControl(), os.getppid(), CFG, channel, make_core)
    events: list = []
    step = proc.core.step

    def recorded_step():
        events.append("step")
        if events.count("step") == stop_after_steps:
            proc._stop = True
        return step()

    def recorded_send(rtype, payload) -> None:
        if payload.utility_output is not None:
            events.append(("reply", payload.utility_output.call_id))
            if stop_after_steps is None:
                proc._stop = True
        else:
            events.append(("out", [(o.request_id, o.finish_reason) for o in payload.outputs]))

    proc.core.step = recorded_step
    channel.send_nowait = recorded_send
    try:
        proc.core.add_request(req("running", max_tokens=50))
        proc.run()
    finally:
        proc.core.shutdown()
    return events


def test_a_utility_reply_is_sent_before_the_next_step():
    """vLLM's engine puts a utility's reply on its output queue before it steps; the
    loop sent it after the step that followed the call, so a call to a busy engine waited
    for a whole step more (600 ms instead of 300 with steps of 300 ms)."""
    events = _loop_events([(REQ_UTILITY, UtilityRequest(0, 7, "echo", ("x",)))],
                          stop_after_steps=2)
    assert events[:2] == [("reply", 7), "step"], events


def test_a_pause_that_aborts_replies_after_its_abort_outputs_and_before_any_step():
    """The reply before the step keeps vLLM's order for pause_scheduler("abort"): its
    ABORT outputs first (taken from the core without a step), then the reply."""
    events = _loop_events([(REQ_UTILITY, UtilityRequest(0, 8, "pause_scheduler", ("abort",)))])
    assert events == [("out", [("running", FinishReason.ABORT)]), ("reply", 8)], events


def test_a_pause_that_aborts_handled_while_outputs_wait_for_room_replies_after_its_aborts(monkeypatch):
    """A pause_scheduler("abort") handled while the loop waited for room to send a
    step's outputs (send handles requests meanwhile): the replies queued then went out
    after the step without the ABORT outputs the pause decided, which came with the
    next step, after the reply."""
    from shmclient import waiting
    from shmclient.errors import PeerNotConsumingError

    full_once = [True]
    send = waiting.send

    def ring_full_once(channel, rtype, payload, **kw):
        if payload.utility_output is None and full_once[0]:
            full_once[0] = False
            raise PeerNotConsumingError("the output ring is full")
        return send(channel, rtype, payload, **kw)

    class Late(_ScriptedChannel):
        calls = 0

        def try_recv(self):  # the pause arrives on the read send makes while it waits
            Late.calls += 1
            return [(REQ_UTILITY, UtilityRequest(0, 8, "pause_scheduler", ("abort",)))] if Late.calls == 2 else []

    monkeypatch.setattr(waiting, "send", ring_full_once)
    monkeypatch.setattr(sys.modules[__name__], "_ScriptedChannel", Late)
    events = _loop_events([])
    assert events[:4] == ["step", ("out", [("running", None)]), ("out", [("running", FinishReason.ABORT)]),
                          ("reply", 8)], events


# --------------------------------------------------------------------- user utilities

def test_registered_utility_is_called_with_the_core_and_unknown_names_still_fail():
    from shmclient_engine.core import register_utility

    from . import user_utilities

    c = EngineCore(CFG.replace(utility_modules=(user_utilities.MODULE,)))
    try:
        assert c.call_utility("scale", ([1.0, 2.5], 3.0)) == [3.0, 7.5]
        assert c.call_utility("engine_state", ())["paused"] == "UNPAUSED"
        with pytest.raises(ValueError, match="boom"):
            c.call_utility("fail_with", ("boom",))
        with pytest.raises(ValueError, match="unknown utility method 'not_registered'"):
            c.call_utility("not_registered", ())
        with pytest.raises(ValueError, match="built-in"):
            register_utility("sleep")(lambda core: None)
        with pytest.raises(ValueError, match="already registered"):
            register_utility("scale")(lambda core: None)
        with pytest.raises(ValueError, match="public identifier"):
            register_utility("_hidden")(lambda core: None)
        c.add_request(req("served", max_tokens=2))
        assert len(Run(c).drain().tokens["served"]) == 2
    finally:
        c.shutdown()


def test_utility_module_that_does_not_import_is_a_config_error():
    with pytest.raises(ConfigError, match="utility_modules.*'tests.no_such_module'"):
        EngineCore(CFG.replace(utility_modules=("tests.no_such_module",)))


def test_a_wait_pause_of_a_sleeping_engine_with_requests_kept_is_refused():
    """Its requests cannot run before wake_up, which resumes scheduling and so ended the
    pause unfinished: the call waited for wake_up only to fail. Refused at once now,
    nothing changed; a sleep in mode "wait" likewise."""
    c = EngineCore(CFG, supports_wait=True)
    try:
        c.add_request(req("kept", max_tokens=3))
        run = Run(c)
        run.step()
        c.sleep(1, "keep")
        paused = c.is_scheduler_paused()
        for call in (lambda: c.pause_scheduler("wait"), lambda: c.sleep(2, "wait")):
            with pytest.raises(ValueError, match="wait.*sleeps.*wake it up first"):
                call()
            assert c.is_scheduler_paused() == paused and not c.has_work()
        assert c.is_live("kept")
        c.wake_up(["weights", "kv_cache"])
        run.drain()
        assert run.tokens["kept"] == predict([1, 2, 3], 3)
        assert not c.is_sleeping()
    finally:
        c.shutdown()


def test_release_kv_cache_memory_gives_a_cuda_models_freed_blocks_back(monkeypatch):
    """On a CUDA device the tiny model's discarded KV blocks stayed in torch's caching
    allocator (sleep empties it; release_kv_cache_memory did not)."""
    from shmclient_engine.tiny import TinyModel

    emptied: list = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    model = TinyModel.__new__(TinyModel)
    model._caches, model._pool_sums = {"r": object()}, {"r": object()}
    model.device = torch.device("cuda")
    model.discard_kv_cache()
    assert emptied == [1] and not model._caches and not model._pool_sums
    model.device = torch.device("cpu")
    model.discard_kv_cache()
    assert emptied == [1]
