"""Event-loop fairness of AsyncMPClient: how late a concurrent task's 1 ms sleep wakes up
while the client waits for output, with the engine idle and busy, shm against zmq.

Run ``python -m shmclient_bench.fairness [--quick]``; ``run(quick)`` returns a
``Fairness`` (``shmclient_bench.fairness_results``). One event loop per configuration runs a "ticker" task (``await asyncio.sleep(1 ms)``
in a loop, recording how late each wake-up is) beside the client:

* ``loop alone``: no client at all, the floor of this host's timer and scheduler;
* ``idle``: a task awaits ``get_output_async()`` with nothing running in the engine;
* ``busy``: four streams of long requests are read as they come, the mock model taking
  ``STEP_S`` per step (standing in for a GPU step: an engine step of no time at all
  floods the output ring faster than any frontend reads it), so the client's reader runs
  between the ticker's sleeps all the time.

The figure is the overshoot (wake-up time − 1 ms) at p50 / p99 / max. A client that
spins or blocks in the loop shows up here directly. Not a test: it asserts nothing.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
from typing import Any

import msgspec

from shmclient import AsyncMPClient, EngineCoreRequest, SamplingParams
from shmclient.config import EngineConfig

from .fairness_results import Fairness, Lateness
from .stats import quantile
from .section_results import SectionHost, typed

TICK_S = 0.001
STEP_S = 0.0005


def _pct(xs: list[float], q: float) -> float:
    return quantile(xs, q)


async def _ticks(n: int) -> list[float]:
    loop = asyncio.get_running_loop()
    late = []
    for _ in range(n):
        t = loop.time()
        await asyncio.sleep(TICK_S)
        late.append((loop.time() - t - TICK_S) * 1e6)
    return late


async def _idle_waiter(client: AsyncMPClient) -> None:
    try:
        await client.get_output_async()
    except Exception:  # the client shutting down at the end
        pass


async def _streams(client: AsyncMPClient, stop: asyncio.Event) -> int:
    sp = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    live: set[str] = set()
    k = 0
    outputs = 0
    while not stop.is_set():
        while len(live) < 4:
            rid = f"s{k}"
            k += 1
            live.add(rid)
            await client.add_request_async(
                EngineCoreRequest(request_id=rid, prompt_token_ids=[1, 2, 3], sampling_params=sp))
        batch = await client.get_output_async(timeout=30)
        outputs += 1
        for o in batch.outputs:
            if o.finished:
                live.discard(o.request_id)
    if live:
        await client.abort_requests_async(sorted(live))
    return outputs


async def _measure(transport: str | None, mode: str, n: int) -> Lateness:
    if transport is None:
        late = await _ticks(n)
        return _summary(late)
    cfg = EngineConfig(model="mock", transport=transport,
                       fault_injection=f"step_delay:{STEP_S}" if mode == "busy" else None)
    client = await AsyncMPClient.create(cfg)
    async with client:
        await client.echo_async("warm-up")
        if mode == "idle":
            waiter = asyncio.ensure_future(_idle_waiter(client))
            await asyncio.sleep(0.05)
            late = await _ticks(n)
            waiter.cancel()
            out = _summary(late)
        else:
            stop = asyncio.Event()
            streams = asyncio.ensure_future(_streams(client, stop))
            await asyncio.sleep(0.2)
            late = await _ticks(n)
            stop.set()
            batches = await streams
            out = msgspec.structs.replace(_summary(late), output_batches=batches)
    return out


def _summary(late: list[float]) -> Lateness:
    return Lateness(p50_us=statistics.median(late), p99_us=_pct(late, 0.99), max_us=max(late),
                    n=len(late))


def run(quick: bool = False) -> Fairness:
    n = 1500 if quick else 5000
    loop_alone = asyncio.run(_measure(None, "", n))
    got = {f"{t}_{m}": asyncio.run(_measure(t, m, n)) for t in ("shm", "zmq") for m in ("idle", "busy")}
    return Fairness(tick_ms=TICK_S * 1e3, step_ms=STEP_S * 1e3, loop_alone=loop_alone,
                    shm_idle=got["shm_idle"], shm_busy=got["shm_busy"], zmq_idle=got["zmq_idle"],
                    zmq_busy=got["zmq_busy"],
                    machine=SectionHost(cpus=os.cpu_count(), load_1m=os.getloadavg()[0]))


def report(res: Fairness | dict[str, Any]) -> str:
    """The section's table; ``res`` a ``Fairness`` or its JSON form."""
    res = typed(res, Fairness)
    lines = [f"a concurrent task's {res.tick_ms:g} ms sleep: how late it wakes (µs), AsyncMPClient"
             f" (busy: engine step {res.step_ms:g} ms)",
             "", f"{'while the client':>22} | {'p50':>7} {'p99':>7} {'max':>8}"]
    for label, r in res.rows():
        lines.append(f"{label:>22} | {r.p50_us:7.0f} {r.p99_us:7.0f} {r.max_us:8.0f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from .sections import section_main

    return section_main(argv, __doc__, run, report, "1,500 ticks per configuration (~15 s)")

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
