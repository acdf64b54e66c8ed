"""The ``vllm`` section's measuring, in its child process: vLLM's engines, one at a time.

The model (``CONFIG``, a tiny dummy Llama) and the engines' arguments (``ENGINE_KW``), the
configurations of each part (quiet, busy, dp), the sync and async drivers that time the
output hop, TTFT and TPOT of every request (``_bench_sync``, ``_bench_async``), and
``_child``, which runs them all and sums them up as a ``VllmComparison``. vLLM is
imported inside the functions only, so that the constants can be read without it; this
module never imports the section's tables or its command line.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import msgspec

from . import stopping
from .vllm_results import BusyHost, ConfigFigures, DataParallel, Percentiles, VllmComparison

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 1024,
    "max_position_embeddings": 512,
    "torch_dtype": "float32",
}
ENGINE_KW = dict(
    load_format="dummy",
    skip_tokenizer_init=True,
    enforce_eager=True,
    dtype="float32",
    max_model_len=256,
    kv_cache_memory_bytes=64 << 20,
    disable_log_stats=True,
)
CONFIGS = (
    ("sync", "stock"),
    ("sync", "shm"),
    ("sync", "shm-inline"),
    ("sync", "shm-thread"),
    ("async", "stock"),
    ("async", "shm"),
    ("async", "shm-inline"),
    ("async", "shm-noprewake"),
)
#: Measured again with BUSY plain busy-loop processes running (the contention matrix's
#: vLLM cell): stock against the plug-in, sync and async. Each busy process is pinned to
#: its own CPU (round robin over this process's CPUs): left to the scheduler, where they
#: land beside vLLM's own pinned worker decides the step time (about 4 or 14 ms here, at
#: random per engine), which no transport does.
BUSY_CONFIGS = (("sync", "stock"), ("sync", "shm"), ("async", "stock"), ("async", "shm"))
BUSY = 2
#: Pairs of passes of the busy part, by ``quick``.
BUSY_PAIRS = {False: 3, True: 1}
#: Measured again with data parallelism: AsyncLLM with DP engine cores (internal load
#: balancing), stock against the plug-in.
DP = 2
DP_KW = dict(data_parallel_size=DP, gpu_memory_utilization=0.08)
DP_CONFIGS = (("async", "stock"), ("async", "shm"), ("async", "shm-inline"))
PARTS = ("quiet", "busy", "dp")
STREAMS = (1, 16)
#: The whole child: the quiet part's 16 engine starts (about 9 minutes on a 2-vCPU host),
#: the busy part's 12 (3 pairs) and the dp part's 6 (5-9 minutes), with room to spare.
CHILD_TIMEOUT_S = 3000


def _percentiles(values: list[float], scale: float) -> Percentiles:
    if not values:
        return Percentiles(n=0)
    v = sorted(values)

    def q(p: float) -> float:
        k = (len(v) - 1) * p / 100.0
        lo = int(k)
        hi = min(lo + 1, len(v) - 1)
        return (v[lo] + (v[hi] - v[lo]) * (k - lo)) * scale

    return Percentiles(n=len(v), p50=q(50), p90=q(90), p99=q(99), mean=sum(v) / len(v) * scale)


def _prompt(i: int) -> list[int]:
    return [(7 * i + j * 13) % 1000 + 1 for j in range(8)]


class _Timing:
    """Per-request first/last token times and token counts, plus output hops."""

    def __init__(self) -> None:
        self.hops: list[float] = []
        self.ttft: dict[int, list[float]] = {n: [] for n in STREAMS}
        self.tpot: dict[int, list[float]] = {n: [] for n in STREAMS}

    def record(self, streams: int, start: float, first: float, last: float, ntok: int) -> None:
        self.ttft[streams].append(first - start)
        if ntok > 1:
            self.tpot[streams].append((last - first) / (ntok - 1))



def _merge(old: _Timing | None, new: _Timing) -> _Timing:
    """``new``'s timings added to ``old``'s (a configuration's second pass)."""
    if old is None:
        return new
    old.hops += new.hops
    for n in STREAMS:
        old.ttft[n] += new.ttft[n]
        old.tpot[n] += new.tpot[n]
    return old


def _summarise(t: _Timing) -> ConfigFigures:
    hops = t.hops
    return ConfigFigures(
        hop_us=_percentiles(hops, 1e6),
        ttft_ms={n: _percentiles(t.ttft[n], 1e3) for n in STREAMS},
        tpot_ms={n: _percentiles(t.tpot[n], 1e3) for n in STREAMS},
        hops_sample_us=[h * 1e6 for h in hops[:: max(1, len(hops) // 2000)]],
    )


def _set_switch(transport: str) -> None:
    os.environ["SHMCLIENT_VLLM"] = "0" if transport == "stock" else "1"
    if transport in ("shm-thread", "shm-inline", "shm-adaptive"):
        os.environ["SHMCLIENT_VLLM_ENGINE_OUTPUT"] = transport[4:]
    else:
        os.environ.pop("SHMCLIENT_VLLM_ENGINE_OUTPUT", None)
    if transport == "shm-noprewake":
        os.environ["SHMCLIENT_VLLM_PREWAKE"] = "0"
    else:
        os.environ.pop("SHMCLIENT_VLLM_PREWAKE", None)


def _bench_sync(model: str, transport: str, rounds: int, tokens: int) -> _Timing:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    _set_switch(transport)
    llm = LLM(model=model, **ENGINE_KW)
    engine = llm.llm_engine
    client = engine.engine_core
    timing = _Timing()
    recording = [False]
    stock_get = client.get_output

    def get_output():
        out = stock_get()
        if recording[0] and out.outputs:
            timing.hops.append(time.monotonic() - out.timestamp)
        return out

    client.get_output = get_output
    params = SamplingParams(max_tokens=tokens, temperature=0.0, detokenize=False, ignore_eos=True)
    seq = [0]

    def batch(streams: int, record: bool) -> None:
        start: dict[str, float] = {}
        first: dict[str, float] = {}
        for i in range(streams):
            rid = f"r{seq[0]}"
            seq[0] += 1
            start[rid] = time.monotonic()
            engine.add_request(rid, TokensPrompt(prompt_token_ids=_prompt(seq[0])), params)
        deadline = time.monotonic() + 120
        while engine.has_unfinished_requests():
            if time.monotonic() > deadline:
                raise TimeoutError("vLLM did not finish the benchmark's requests within 120 s")
            for out in engine.step():
                now = time.monotonic()
                n = len(out.outputs[0].token_ids)
                if n and out.request_id not in first:
                    first[out.request_id] = now
                if out.finished and record:
                    timing.record(streams, start[out.request_id], first[out.request_id], now, n)

    try:
        batch(16, False)  # warm-up
        recording[0] = True
        for _ in range(rounds):
            for _ in range(4):
                batch(1, True)
            batch(16, True)
    finally:
        client.shutdown()
    return timing


def _bench_async(model: str, transport: str, rounds: int, tokens: int,
                 engine_kw: dict[str, Any] | None = None) -> _Timing:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.async_llm import AsyncLLM

    _set_switch(transport)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, detokenize=False, ignore_eos=True)
    timing = _Timing()

    async def main() -> None:
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=model, **ENGINE_KW, **(engine_kw or {})))
        client = engine.engine_core
        recording = [False]
        stock_get = client.get_output_async

        async def get_output_async():
            out = await stock_get()
            if recording[0] and out.outputs:
                timing.hops.append(time.monotonic() - out.timestamp)
            return out

        client.get_output_async = get_output_async
        seq = [0]

        async def one(streams: int, record: bool) -> None:
            seq[0] += 1
            rid = f"a{seq[0]}"
            start = time.monotonic()
            first = last = None
            n = 0
            async for out in engine.generate(TokensPrompt(prompt_token_ids=_prompt(seq[0])), params, request_id=rid):
                last = time.monotonic()
                n = len(out.outputs[0].token_ids)
                if first is None and n:
                    first = last
            if record and first is not None:
                timing.record(streams, start, first, last, n)

        async def batch(streams: int, record: bool) -> None:
            await asyncio.wait_for(asyncio.gather(*(one(streams, record) for _ in range(streams))), 120)

        try:
            await batch(16, False)
            recording[0] = True
            for _ in range(rounds):
                for _ in range(4):
                    await batch(1, True)
                await batch(16, True)
        finally:
            engine.shutdown()
            await asyncio.sleep(0.1)

    asyncio.run(main())
    return timing


def _child(quick: bool, parts: tuple[str, ...] = PARTS, busy_pairs: int | None = None) -> VllmComparison:
    """Every part of ``parts``, one engine at a time; the busy part in ``busy_pairs`` pairs
    (``BUSY_PAIRS``: 1 quick, 3 in a full run)."""
    import vllm
    from vllm.plugins import load_general_plugins

    os.environ["SHMCLIENT_VLLM"] = "1"  # plug-ins load once per process: load with it on
    load_general_plugins()
    rounds, tokens = (2, 32) if quick else (5, 64)
    if busy_pairs is None:
        busy_pairs = BUSY_PAIRS[quick]
    model = tempfile.mkdtemp(prefix="shmc-vllm-bench-")
    quiet: dict[str, _Timing] = {}
    busy: dict[str, _Timing] = {}
    dp: dict[str, _Timing] = {}
    try:
        with open(os.path.join(model, "config.json"), "w") as f:
            json.dump(CONFIG, f)
        # Full runs measure every configuration twice, the second pass in reverse order,
        # so that a slow spell of a shared machine does not land on one side only.
        order = list(CONFIGS) if quick else list(CONFIGS) + list(reversed(CONFIGS))
        if "quiet" not in parts:
            order = []
        load_before = os.getloadavg()
        for kind, transport in order:
            fn = _bench_sync if kind == "sync" else _bench_async
            t0 = time.monotonic()
            part = fn(model, transport, rounds, tokens)
            name = f"{kind}-{transport}"
            quiet[name] = _merge(quiet.get(name), part)
            print(f"shmclient_bench.vllm: {name} done in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
        load_after = os.getloadavg()
        # The busy part in pairs: one pass of every configuration a pair, the order reversed
        # from one pair to the next. With a busy process on every CPU each engine start
        # lands on its own step time (stock's TPOT moved by a third between engines), so
        # the verdict is taken on the ratio within each pair, over several pairs.
        pairs: list[dict[str, ConfigFigures]] = []
        for p in range(busy_pairs if "busy" in parts else 0):
            pair: dict[str, ConfigFigures] = {}
            for kind, transport in (BUSY_CONFIGS if p % 2 == 0 else tuple(reversed(BUSY_CONFIGS))):
                fn = _bench_sync if kind == "sync" else _bench_async
                hogs = _pinned_busy(BUSY)
                try:
                    t0 = time.monotonic()
                    part = fn(model, transport, rounds, tokens)
                finally:
                    for h in hogs:
                        h.kill()
                        h.wait()
                name = f"{kind}-{transport}"
                pair[name] = msgspec.structs.replace(_summarise(part), hops_sample_us=[])
                busy[name] = _merge(busy.get(name), part)
                print(f"shmclient_bench.vllm: {name} with {BUSY} busy processes (pair {p + 1} of "
                      f"{busy_pairs}) done in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
            pairs.append({name: pair[name] for name in (f"{k}-{t}" for k, t in BUSY_CONFIGS)})
        order = list(DP_CONFIGS) if quick else list(DP_CONFIGS) + list(reversed(DP_CONFIGS))
        if "dp" not in parts:
            order = []
        for kind, transport in order:
            t0 = time.monotonic()
            part = _bench_async(model, transport, rounds, tokens, DP_KW)
            name = f"{kind}-{transport}"
            dp[name] = _merge(dp.get(name), part)
            print(f"shmclient_bench.vllm: {name} with {DP} engine cores done in {time.monotonic() - t0:.0f} s",
                  file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(model, ignore_errors=True)
    return VllmComparison(
        vllm_version=vllm.__version__,
        rounds=rounds,
        tokens=tokens,
        streams=list(STREAMS),
        model=CONFIG,
        configs={name: _summarise(t) for name, t in quiet.items()},
        passes=1 if quick else 2,
        load_before=load_before,
        load_after=load_after,
        busy=BusyHost(processes=BUSY, configs={n: _summarise(t) for n, t in busy.items()}, pairs=pairs)
        if busy else None,
        dp=DataParallel(engines=DP, configs={n: _summarise(t) for n, t in dp.items()}) if dp else None,
    )


def _pinned_busy(n: int) -> list[subprocess.Popen]:
    """``n`` busy-loop processes, the i-th pinned to the i-th of our CPUs (round robin)."""
    cpus = sorted(os.sched_getaffinity(0))
    hogs = []
    try:
        for i in range(n):
            hogs.append(stopping.busy_process())
            os.sched_setaffinity(hogs[-1].pid, {cpus[i % len(cpus)]})
    except BaseException:
        for h in hogs:
            h.kill()
            h.wait()
        raise
    return hogs
