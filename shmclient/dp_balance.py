"""The data-parallel load balancer's decisions: which engine gets a request, and what a
request weighs.

Middle layer: imports ``messages`` only; never a client, a channel or asyncio. Plain
functions of the numbers the client keeps, so they are tested without engines. The score
and how ties are broken: docs/design.md, "Module notes", ``shmclient.dp_balance``.
"""

from __future__ import annotations

from typing import Sequence

from .messages import EngineCoreRequest, SchedulerStats

__all__ = ["KV_PENALTY_FROM", "KV_PENALTY_SLOPE", "least_loaded", "work_estimate"]

#: vLLM's KV-pressure penalty on waiting requests: 0 at <= 50 % KV use, rising to
#: ``6 * 0.5 = 3`` extra load per waiting request at 100 %.
KV_PENALTY_FROM = 0.5
KV_PENALTY_SLOPE = 6.0


def load(inflight: int, stats: SchedulerStats) -> float:
    """One engine's score (see the module doc)."""
    waiting = stats.num_waiting_reqs
    score = float(max(inflight, waiting + stats.num_running_reqs))
    if waiting:
        score += waiting * KV_PENALTY_SLOPE * max(0.0, stats.kv_cache_usage - KV_PENALTY_FROM)
    return score


def least_loaded(inflight: Sequence[int], work: Sequence[int], stats: Sequence[SchedulerStats],
                 start: int) -> int:
    """The position of the engine with the lowest ``(load, work)``, looking from
    ``start`` round (so equal engines take turns as ``start`` rotates)."""
    n = len(inflight)
    best, best_key = start % n, None
    for k in range(n):
        i = (start + k) % n
        key = (load(inflight[i], stats[i]), work[i])
        if best_key is None or key < best_key:
            best, best_key = i, key
    return best


def work_estimate(request: EngineCoreRequest) -> int:
    """Tokens a request makes its engine process at most: its prompt and, for
    generation, ``max_tokens`` (16 when it has no sampling parameters)."""
    if request.prompt_token_ids is not None:
        prompt = len(request.prompt_token_ids)
    elif request.prompt_embeds is not None:
        prompt = len(request.prompt_embeds)
    else:
        prompt = 0
    if request.pooling_params is not None:
        return prompt
    sp = request.sampling_params
    return prompt + (sp.max_tokens if sp is not None else 16)
