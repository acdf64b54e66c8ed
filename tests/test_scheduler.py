"""Scheduler unit tests, driven with the mock model's rule (no EngineCore, no client).

Chunked prefill and the token budget, block accounting, preemption by recompute, aborts,
the stop rules, and a property test over random add/abort/step sequences.
"""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shmclient.config import EngineConfig
from shmclient_engine.model import MockModel, mock_next_token
from shmclient_engine.request import Request, RequestStatus
from shmclient_engine.scheduler import Scheduler
from shmclient.errors import InvalidRequestError
from shmclient.messages import FinishReason, PoolingParams, SamplingParams

VOCAB, EOS = 1024, 2
MODEL = MockModel(EngineConfig())


def predict(prompt: list[int], n: int) -> list[int]:
    """What the mock model generates after ``prompt``."""
    seq, out = list(prompt), []
    for _ in range(n):
        t = mock_next_token(seq[-1], len(seq) - 1, VOCAB, EOS)
        seq.append(t)
        out.append(t)
    return out


def make(**kw) -> Scheduler:
    args = dict(max_num_seqs=8, max_num_batched_tokens=64, block_size=4, num_gpu_blocks=64,
                max_model_len=256)
    args.update(kw)
    return Scheduler(**args)


def request(rid: str, prompt: list[int], max_tokens: int = 10, eos: int | None = EOS,
            **sp) -> Request:
    return Request(rid, prompt_token_ids=prompt, eos_token_id=eos,
                   sampling_params=SamplingParams(max_tokens=max_tokens, **sp))


def step(s: Scheduler):
    batch = s.schedule()
    changed = s.update(batch, MODEL.execute(batch))
    return batch, changed


def drain(s: Scheduler, limit: int = 10_000) -> dict[str, Request]:
    done = {}
    for _ in range(limit):
        if not s.has_unfinished_requests():
            return done
        for r in step(s)[1]:
            if r.finish_reason is not None:
                assert r.request_id not in done
                done[r.request_id] = r
    raise AssertionError("scheduler did not drain")


def test_chunked_prefill_spans_steps_then_decodes():
    s = make(max_num_batched_tokens=32, num_gpu_blocks=100)
    prompt = list(range(100))
    s.add_request(request("a", prompt, max_tokens=3))
    shapes = []
    while s.has_unfinished_requests():
        batch, _ = step(s)
        (c,) = batch
        shapes.append((c.start_pos, c.num_tokens, c.sample))
    assert shapes == [(0, 32, False), (32, 32, False), (64, 32, False), (96, 4, True),
                      (100, 1, True), (101, 1, True)]
    assert s.num_free_blocks == 100


def test_token_budget_and_max_num_seqs_hold_every_step():
    s = make(max_num_seqs=3, max_num_batched_tokens=20, num_gpu_blocks=200)
    for i in range(6):
        s.add_request(request(f"r{i}", [i + 3] * (5 + 4 * i), max_tokens=4))
    done = {}
    while s.has_unfinished_requests():
        batch, changed = step(s)
        assert sum(c.num_tokens for c in batch) <= 20
        assert len(s.running) <= 3
        s.check_invariants()
        done.update({r.request_id: r for r in changed if r.finish_reason is not None})
    for i in range(6):
        assert done[f"r{i}"].output_token_ids == predict([i + 3] * (5 + 4 * i), 4)
    assert s.num_free_blocks == s.num_gpu_blocks


def test_blocks_follow_tokens():
    s = make(block_size=4, num_gpu_blocks=10, max_model_len=40)
    r = request("a", [5] * 6, max_tokens=5)
    s.add_request(r)
    assert s.num_free_blocks == 10 and r.num_blocks == 0  # nothing held while waiting
    step(s)  # prefill 6 tokens -> 2 blocks
    assert r.num_blocks == 2 and s.num_free_blocks == 8
    step(s)  # position 6 computed -> 7 tokens, still 2 blocks
    step(s)  # 8 tokens
    assert r.num_blocks == 2
    step(s)  # 9 tokens -> 3 blocks
    assert r.num_blocks == 3 and s.num_free_blocks == 7
    drain(s)
    assert s.num_free_blocks == 10


def test_preemption_evicts_latest_and_recomputes_without_duplicates():
    freed = []
    s = make(block_size=4, num_gpu_blocks=6, max_model_len=24, on_free=freed.append)
    a, b = request("a", [7] * 8, max_tokens=12), request("b", [9] * 8, max_tokens=12)
    s.add_request(a)
    s.add_request(b)
    step(s)
    assert [r.request_id for r in s.running] == ["a", "b"] and s.num_free_blocks == 2
    while s.num_preemptions == 0:
        step(s)
    assert b.status is RequestStatus.WAITING and s.waiting[0] is b
    assert b.num_blocks == 0 and b.num_computed_tokens == 0 and "b" in freed
    assert b.num_preemptions == 1 and b.output_token_ids  # keeps what it generated
    done = drain(s)
    assert done["a"].output_token_ids == predict([7] * 8, 12)
    assert done["b"].output_token_ids == predict([9] * 8, 12)
    assert s.num_free_blocks == 6
    s.check_invariants()


def test_add_rejections_change_nothing():
    s = make(block_size=4, num_gpu_blocks=4, max_model_len=16)
    s.add_request(request("a", [1, 2, 3]))
    for bad, match in [(request("a", [4]), "already live"),
                       (request("b", [1] * 17), "max_model_len")]:
        with pytest.raises(InvalidRequestError, match=match):
            s.add_request(bad)
    assert list(s.requests) == ["a"] and len(s.waiting) == 1
    s.check_invariants()


def test_prompt_that_never_fits_is_rejected():
    # The scheduler alone (without the core fitting max_model_len) refuses it too.
    s = make(block_size=4, num_gpu_blocks=4, max_model_len=16)
    s.max_model_len = 100
    with pytest.raises(InvalidRequestError, match="never fit"):
        s.add_request(request("big", [1] * 17))


def test_max_model_len_must_fit_in_cache():
    with pytest.raises(ValueError, match="max_model_len"):
        make(block_size=4, num_gpu_blocks=4, max_model_len=17)


def test_finish_requests_waiting_running_unknown_and_twice():
    freed = []
    s = make(max_num_seqs=1, on_free=freed.append)
    s.add_request(request("run", [1, 2]))
    s.add_request(request("wait", [3, 4]))
    step(s)
    assert [r.request_id for r in s.running] == ["run"]
    done = s.finish_requests(["wait", "nope", "run", "run"], FinishReason.ABORT)
    assert [r.request_id for r in done] == ["wait", "run"]
    assert all(r.finish_reason is FinishReason.ABORT for r in done)
    assert not s.has_unfinished_requests() and s.num_free_blocks == s.num_gpu_blocks
    assert sorted(freed) == ["run", "wait"]
    assert s.finish_requests(["run"], FinishReason.ABORT) == []


def test_finish_requests_of_a_mixed_subset_keeps_the_rest_in_order():
    freed = []
    s = make(max_num_seqs=2, on_free=freed.append)
    for rid in "abcdefgh":
        s.add_request(request(rid, [ord(rid), 5]))
    step(s)
    assert [r.request_id for r in s.running] == ["a", "b"]
    held = s.running[0].num_blocks + s.running[1].num_blocks
    assert s.num_free_blocks == s.num_gpu_blocks - held
    done = s.finish_requests(["g", "b", "nope", "c", "g", "e"], FinishReason.ABORT)
    assert [r.request_id for r in done] == ["g", "b", "c", "e"]
    assert all(r.finish_reason is FinishReason.ABORT and r.status is RequestStatus.FINISHED
               for r in done)
    assert freed == ["g", "b", "c", "e"]
    assert [r.request_id for r in s.running] == ["a"]
    assert [r.request_id for r in s.waiting] == ["d", "f", "h"]
    assert s.stats()["num_waiting"] == 3 and s.stats()["num_running"] == 1
    assert s.num_free_blocks == s.num_gpu_blocks - s.running[0].num_blocks
    s.check_invariants()
    rest = drain(s)
    assert sorted(rest) == ["a", "d", "f", "h"]
    for rid in rest:
        assert rest[rid].output_token_ids == predict([ord(rid), 5], 10)
    assert s.num_free_blocks == s.num_gpu_blocks


class _CountingDeque(deque):
    """A deque that counts the elements its scans visit: those ``remove`` passes over
    (up to the one it removes) and those iteration yields."""

    def __init__(self, *args):
        super().__init__(*args)
        self.visits = 0

    def remove(self, value):
        self.visits += self.index(value) + 1
        super().remove(value)

    def __iter__(self):
        for item in super().__iter__():
            self.visits += 1
            yield item


def test_aborting_many_queued_requests_scans_the_queue_once():
    # One abort of k of n queued requests, newest first: removing them one by one scans
    # the deque once per id (about n*k/2 visits here), which stalled the engine for
    # seconds at tens of thousands of requests. A single pass visits about n.
    n = 2000
    s = make(max_num_seqs=1)
    s.waiting = _CountingDeque()
    for i in range(n):
        s.add_request(request(f"r{i}", [1, 2]))
    ids = [f"r{i}" for i in reversed(range(n)) if i % 4 != 0]
    done = s.finish_requests(ids, FinishReason.ABORT)
    assert [r.request_id for r in done] == ids
    visits = s.waiting.visits
    assert visits <= 2 * n, visits
    assert [r.request_id for r in s.waiting] == [f"r{i}" for i in range(0, n, 4)]
    s.check_invariants()


def test_stop_rules():
    prompt = [11, 12, 13]
    seq = predict(prompt, 8)
    s = make()
    s.add_request(request("eos", prompt, max_tokens=8, eos=seq[3]))
    s.add_request(request("ign", prompt, max_tokens=8, eos=seq[3], ignore_eos=True))
    s.add_request(request("stop", prompt, max_tokens=8, stop_token_ids=[seq[5], seq[6]]))
    s.add_request(request("len", prompt, max_tokens=8))
    s.add_request(request("both", prompt, max_tokens=4, eos=seq[3]))
    s.add_request(request("noeos", prompt, max_tokens=8, eos=None))
    d = drain(s)
    assert (d["eos"].output_token_ids, d["eos"].finish_reason) == (seq[:4], FinishReason.STOP)
    assert d["eos"].stop_reason is None
    assert (d["ign"].output_token_ids, d["ign"].finish_reason) == (seq, FinishReason.LENGTH)
    assert d["stop"].output_token_ids == seq[:6] and d["stop"].stop_reason == seq[5]
    assert d["stop"].finish_reason is FinishReason.STOP
    assert (d["len"].output_token_ids, d["len"].finish_reason) == (seq, FinishReason.LENGTH)
    # EOS on the last allowed token: the stop token wins over the length cap.
    assert d["both"].finish_reason is FinishReason.STOP and len(d["both"].output_token_ids) == 4
    assert d["noeos"].output_token_ids == seq


def test_max_model_len_caps_total_tokens():
    s = make(max_model_len=20, block_size=4, num_gpu_blocks=5)
    s.add_request(request("a", [1] * 15, max_tokens=100))
    s.add_request(request("full", [1] * 20, max_tokens=100))
    d = drain(s)
    assert d["a"].num_tokens == 20 and d["a"].finish_reason is FinishReason.LENGTH
    # A prompt of exactly max_model_len still gets its one token.
    assert len(d["full"].output_token_ids) == 1 and d["full"].finish_reason is FinishReason.LENGTH


def test_pooling_request_is_chunked_and_finishes_once():
    s = make(max_num_batched_tokens=8)
    s.add_request(Request("p", prompt_token_ids=list(range(20)), pooling_params=PoolingParams()))
    seen = []
    while s.has_unfinished_requests():
        batch, changed = step(s)
        seen += [(c.num_tokens, c.sample, c.pool_done) for c in batch]
        for r in changed:
            assert r.finish_reason is FinishReason.STOP and not r.output_token_ids
    assert seen == [(8, False, False), (8, False, False), (4, False, True)]


# --------------------------------------------------------------------- property test

ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 16), st.integers(1, 16)),
        st.tuples(st.just("add"), st.integers(8, 16), st.integers(8, 16)),
        st.tuples(st.just("abort"), st.integers(0, 40)),
        st.tuples(st.just("step"), st.integers(1, 4)),
    ),
    min_size=4,
    max_size=40,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, budget=st.integers(1, 24), capacity=st.integers(16, 40),
       block_size=st.sampled_from([1, 2, 4, 8]), max_num_seqs=st.integers(1, 6))
def test_random_arrivals_and_aborts(ops, budget, capacity, block_size, max_num_seqs):
    blocks = capacity // block_size
    max_model_len = min(24, blocks * block_size)
    freed = []
    s = Scheduler(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                  block_size=block_size, num_gpu_blocks=blocks, max_model_len=max_model_len,
                  on_free=freed.append)
    prompts, limits, tokens, finished = {}, {}, {}, {}
    n = 0

    def one_step():
        batch, changed = step(s)
        assert sum(c.num_tokens for c in batch) <= budget
        for r in changed:
            assert r.request_id not in finished
            tokens[r.request_id] = list(r.output_token_ids)
            if r.finish_reason is not None:
                finished[r.request_id] = r.finish_reason
        s.check_invariants()

    for op in ops:
        if op[0] == "add":
            rid = f"r{n}"
            n += 1
            prompt = [(n * 7 + i) % VOCAB for i in range(min(op[1], max_model_len))]
            prompts[rid], limits[rid] = prompt, op[2]
            s.add_request(request(rid, prompt, max_tokens=op[2]))
        elif op[0] == "abort":
            rid = f"r{op[1]}"
            for r in s.finish_requests([rid], FinishReason.ABORT):
                assert r.request_id not in finished
                finished[r.request_id] = FinishReason.ABORT
        else:
            for _ in range(op[1]):
                one_step()
        s.check_invariants()
    for _ in range(5000):
        if not s.has_unfinished_requests():
            break
        one_step()
    assert not s.has_unfinished_requests()
    assert set(finished) == set(prompts)  # every request finished exactly once
    assert s.num_free_blocks == blocks  # no leaked blocks
    for rid, prompt in prompts.items():
        got = tokens.get(rid, [])
        assert len(got) <= limits[rid]
        assert got == predict(prompt, len(got))  # no duplicate or skipped tokens
        if finished[rid] is not FinishReason.ABORT:
            assert finished[rid] is FinishReason.LENGTH
            assert len(got) == limits[rid] or len(prompt) + len(got) >= max_model_len
    assert set(freed) >= set(prompts)
