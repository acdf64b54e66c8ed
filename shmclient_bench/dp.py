"""Data parallelism: requests/s with one and two engines, and the balance under a skewed
load, with the mock model and a fixed per-step delay that stands in for a GPU step.

Run ``python -m shmclient_bench.dp [--quick]``; ``run(quick)`` returns a ``DpBench``
(``shmclient_bench.dp_results``).
Each engine runs at most ``max_num_seqs`` requests at once and sleeps ``step_delay_s``
per step, as a saturated GPU would take its step time whatever the host does; the
sleeping engines leave the CPUs to the frontend, so that the scaling from one engine to
two shows on a 2-core host. Throughput: a burst of requests of a fixed length, from the
first add to the last finished output; ``AsyncMPClient`` (one engine), and
``DPLBAsyncMPClient`` with one and with two engines (the first two compare the cost of
the DP layer), measured in alternating rounds; and, with no step delay, 1-token
requests through ``AsyncMPClient`` and a one-engine ``DPLBAsyncMPClient`` (what the DP
layer adds per request). Balance (``DPLBAsyncMPClient``, two
engines): "pinned", a third of the requests name rank 0 and the rest are free (even
shares mean the balancer made up for the skew; round robin would give rank 0 two
thirds); "alternating", long and short requests in turn (round robin would put every
long one on the same engine). Not a test: it asserts nothing, it reports.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
from typing import Any

from shmclient import EngineCoreRequest, SamplingParams, make_async_mp_client
from shmclient.config import EngineConfig

from .dp_results import (BalanceAlternating, BalancePinned, DpBench, Overhead, Rate, RequestRate,
                         Settings)
from .section_results import SectionHost, typed

STEP_DELAY_S = 0.005
MAX_NUM_SEQS = 8


def _config(engines: int, step_delay_s: float = STEP_DELAY_S) -> EngineConfig:
    return EngineConfig(model="mock", max_model_len=512, max_num_seqs=MAX_NUM_SEQS,
                        step_delay_s=step_delay_s, data_parallel_size=engines)


def _req(rid: str, max_tokens: int, rank: int | None = None) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=rid, prompt_token_ids=[1, 2, 3, 4], data_parallel_rank=rank,
        sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0))


async def _burst(client: Any, reqs: list[EngineCoreRequest]) -> dict[str, Any]:
    """Add every request at once, wait for all to finish: elapsed seconds, and the
    requests and tokens each engine served (by ``engine_index``)."""
    t0 = time.perf_counter()
    for r in reqs:
        await client.add_request_async(r)
    left = {r.request_id for r in reqs}
    requests: dict[int, int] = {}
    tokens: dict[int, int] = {}
    while left:
        outs = await asyncio.wait_for(client.get_output_async(), 60)
        e = outs.engine_index
        for o in outs.outputs:
            tokens[e] = tokens.get(e, 0) + len(o.new_token_ids)
            if o.finished:
                left.discard(o.request_id)
                requests[e] = requests.get(e, 0) + 1
    return {"elapsed_s": time.perf_counter() - t0, "requests": requests, "tokens": tokens}


def _shares(counts: dict[int, int]) -> tuple[float, float]:
    """The shares of rank 0 and rank 1 in ``counts``."""
    total = sum(counts.values()) or 1
    return counts.get(0, 0) / total, counts.get(1, 0) / total


def run(quick: bool = False) -> DpBench:
    n_req, tokens, rounds = (64, 16, 2) if quick else (256, 32, 3)
    configs = {
        "async_1_engine": (_config(1), False),
        "dp_lb_1_engine": (_config(1), True),
        "dp_lb_2_engines": (_config(2), True),
    }
    settings = Settings(requests=n_req, max_tokens=tokens, rounds=rounds, step_delay_s=STEP_DELAY_S,
                        max_num_seqs=MAX_NUM_SEQS)

    async def main() -> tuple[dict[str, Rate], BalancePinned, BalanceAlternating]:
        from shmclient.client_dp import DPLBAsyncMPClient

        clients: dict[str, Any] = {}
        try:
            for name, (cfg, dp) in configs.items():
                clients[name] = DPLBAsyncMPClient(cfg) if dp else make_async_mp_client(cfg)
            rates: dict[str, list[float]] = {k: [] for k in clients}
            for name, c in clients.items():  # warm-up
                await _burst(c, [_req(f"warm-{name}-{i}", 2) for i in range(8)])
            for r in range(rounds):
                order = list(clients) if r % 2 == 0 else list(reversed(clients))
                for name in order:
                    got = await _burst(clients[name],
                                       [_req(f"t{r}-{name}-{i}", tokens) for i in range(n_req)])
                    rates[name].append(n_req / got["elapsed_s"])
            throughput = {
                k: Rate(requests_per_s=statistics.median(v), tokens_per_s=statistics.median(v) * tokens,
                        rounds=tuple(v))
                for k, v in rates.items()
            }
            lb = clients["dp_lb_2_engines"]
            pinned = [_req(f"pin-{i}", tokens, rank=0 if i % 3 == 0 else None) for i in range(n_req)]
            got = await _burst(lb, pinned)
            share0 = sum(1 for r in pinned if r.data_parallel_rank == 0) / n_req
            balance_pinned = BalancePinned(
                pinned_to_rank_0=share0,
                request_share=_shares(got["requests"]),
                token_share=_shares(got["tokens"]),
                round_robin_request_share=(share0 + (1 - share0) / 2, (1 - share0) / 2),
                elapsed_s=got["elapsed_s"],
            )
            alt = [_req(f"alt-{i}", tokens * 4 if i % 2 == 0 else 2) for i in range(n_req)]
            got = await _burst(lb, alt)
            balance_alternating = BalanceAlternating(
                long_tokens=tokens * 4, short_tokens=2,
                request_share=_shares(got["requests"]),
                token_share=_shares(got["tokens"]),
                round_robin_token_share=((tokens * 4) / (tokens * 4 + 2), 2 / (tokens * 4 + 2)),
                elapsed_s=got["elapsed_s"],
            )
            return throughput, balance_pinned, balance_alternating
        finally:
            for c in clients.values():
                c.shutdown()

    async def overhead() -> Overhead:
        """The DP layer's own cost: 1-token requests, no step delay, one engine."""
        from shmclient.client_dp import DPLBAsyncMPClient

        clients: dict[str, Any] = {}
        try:
            clients["async_1_engine"] = make_async_mp_client(_config(1, 0.0))
            clients["dp_lb_1_engine"] = DPLBAsyncMPClient(_config(1, 0.0))
            rates: dict[str, list[float]] = {k: [] for k in clients}
            for name, c in clients.items():  # warm-up
                await _burst(c, [_req(f"warm-{name}-{i}", 1) for i in range(32)])
            for r in range(rounds):
                order = list(clients) if r % 2 == 0 else list(reversed(clients))
                for name in order:
                    got = await _burst(clients[name],
                                       [_req(f"o{r}-{name}-{i}", 1) for i in range(n_req * 16)])
                    rates[name].append(n_req * 16 / got["elapsed_s"])
            plain, dp = (RequestRate(requests_per_s=statistics.median(rates[k]), rounds=tuple(rates[k]))
                         for k in ("async_1_engine", "dp_lb_1_engine"))
            return Overhead(requests=n_req * 16, async_1_engine=plain, dp_lb_1_engine=dp,
                            us_per_request_added=1e6 * (1 / dp.requests_per_s - 1 / plain.requests_per_s))
        finally:
            for c in clients.values():
                c.shutdown()

    throughput, balance_pinned, balance_alternating = asyncio.run(main())
    added = asyncio.run(overhead())
    return DpBench(
        settings=settings,
        throughput=throughput,
        speedup_2_vs_1_engine=(throughput["dp_lb_2_engines"].requests_per_s
                               / throughput["async_1_engine"].requests_per_s),
        dp_layer_cost=(throughput["dp_lb_1_engine"].requests_per_s
                       / throughput["async_1_engine"].requests_per_s),
        balance_pinned=balance_pinned,
        balance_alternating=balance_alternating,
        overhead_no_delay=added,
        machine=SectionHost(cpus=os.cpu_count(), load_1m=os.getloadavg()[0]),
    )


def report(res: DpBench | dict[str, Any]) -> str:
    """The section's table; ``res`` a ``DpBench`` or its JSON form."""
    res = typed(res, DpBench)
    s = res.settings
    lines = [
        f"{s.requests} requests x {s.max_tokens} tokens at once, mock model, "
        f"{s.step_delay_s * 1e3:g} ms per step, max_num_seqs={s.max_num_seqs} per engine",
        "",
        f"{'client':>16} | {'requests/s':>10} {'tokens/s':>9}",
    ]
    for name, t in res.throughput.items():
        lines.append(f"{name:>16} | {t.requests_per_s:10.1f} {t.tokens_per_s:9.0f}")
    lines.append(f"2 engines vs 1: {res.speedup_2_vs_1_engine:.2f}x; "
                 f"DP layer over AsyncMPClient, 1 engine: {res.dp_layer_cost:.2f}x")
    o = res.overhead_no_delay
    if o:
        lines.append(
            f"no step delay, {o.requests} 1-token requests, 1 engine: AsyncMPClient "
            f"{o.async_1_engine.requests_per_s:.0f}/s, DPLBAsyncMPClient "
            f"{o.dp_lb_1_engine.requests_per_s:.0f}/s "
            f"({o.us_per_request_added:+.1f} us per request)")
    p, a = res.balance_pinned, res.balance_alternating
    lines.append("")
    lines.append("balance, 2 engines (share of rank 0 / rank 1):")
    lines.append(f"  pinned ({p.pinned_to_rank_0:.0%} name rank 0): requests "
                 f"{p.request_share[0]:.2f} / {p.request_share[1]:.2f} "
                 f"(round robin {p.round_robin_request_share[0]:.2f} / "
                 f"{p.round_robin_request_share[1]:.2f})")
    lines.append(f"  alternating {a.long_tokens} and {a.short_tokens} tokens: tokens "
                 f"{a.token_share[0]:.2f} / {a.token_share[1]:.2f} "
                 f"(round robin, and vLLM's score alone: {a.round_robin_token_share[0]:.2f} / "
                 f"{a.round_robin_token_share[1]:.2f}), requests "
                 f"{a.request_share[0]:.2f} / {a.request_share[1]:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from .sections import section_main

    return section_main(argv, __doc__, run, report, "fewer and shorter requests (~15 s)")

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
