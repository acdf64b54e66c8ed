"""The data-parallel balancer's decisions, as plain functions of the client's numbers (no
engines): vLLM's score, the work tie-break, the rotation, the work estimate."""

from __future__ import annotations

import torch

from shmclient.dp_balance import least_loaded, load, work_estimate
from shmclient.messages import EngineCoreRequest, PoolingParams, SamplingParams, SchedulerStats

IDLE = SchedulerStats()


def test_another_frontends_running_requests_count():
    stats = [SchedulerStats(num_running_reqs=5), IDLE]
    assert least_loaded([0, 0], [0, 0], stats, start=0) == 1


def test_waiting_requests_on_a_full_kv_cache_weigh_more_than_running_ones():
    # 4 waiting at 100 % KV use count 4 + 4 * 6 * 0.5 = 16 against 10 running
    full = SchedulerStats(num_waiting_reqs=4, kv_cache_usage=1.0)
    busy = SchedulerStats(num_running_reqs=10, kv_cache_usage=0.2)
    assert load(0, full) == 16.0 and load(0, busy) == 10.0
    assert least_loaded([0, 0], [0, 0], [full, busy], start=0) == 1
    # at or below half the cache, no penalty
    assert load(0, SchedulerStats(num_waiting_reqs=4, kv_cache_usage=0.5)) == 4.0


def test_the_exact_in_flight_count_wins_over_a_stale_lower_snapshot():
    assert least_loaded([3, 1], [0, 0], [IDLE, IDLE], start=0) == 1
    assert load(3, SchedulerStats(num_running_reqs=1)) == 3.0


def test_equal_loads_go_to_less_work_then_to_the_rotation():
    assert least_loaded([2, 2], [400, 10], [IDLE, IDLE], start=0) == 1
    assert [least_loaded([1, 1, 1], [5, 5, 5], [IDLE] * 3, start=s) for s in range(4)] == [0, 1, 2, 0]


def test_work_estimate_is_prompt_plus_max_tokens():
    gen = EngineCoreRequest(request_id="g", prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(max_tokens=50))
    emb = EngineCoreRequest(request_id="e", prompt_embeds=torch.zeros(7, 4), sampling_params=SamplingParams(max_tokens=1))
    pool = EngineCoreRequest(request_id="p", prompt_token_ids=[1] * 9, pooling_params=PoolingParams())
    assert (work_estimate(gen), work_estimate(emb), work_estimate(pool)) == (53, 8, 9)
