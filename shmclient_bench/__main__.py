"""``python -m shmclient_bench``: every benchmark of shmclient in one run.

Sections (``--only`` picks some): ``latency`` (round trip of one max_tokens=1 request),
``streaming`` (N concurrent requests x M tokens), ``idle`` (idle CPU of client and
engine), ``tensors`` (shmclient_bench.tensors' transfer sweep), ``ring`` (shmclient_bench.ring's raw ring
against pyzmq ipc) and ``contention`` (shmclient_bench.contention: sync and async clients over shm and
over zmq with 0 to 3 unrelated busy-loop processes, and under a 1-CPU quota), ``fairness`` (shmclient_bench.fairness:
how late a concurrent asyncio task's 1 ms sleep wakes while the async client waits, engine
idle and busy, shm and zmq), ``dp`` (shmclient_bench.dp: requests/s
with one and two data-parallel engines, and their balance under a skewed load), ``vllm`` (shmclient_bench.vllm: stock vLLM
against vLLM over the rings, tiny dummy model; skipped with a note without vLLM) and ``serving``
(shmclient_bench.serving: vLLM's OpenAI server, stock and with the plug-in, under vLLM's own
serving benchmark; skipped with a note without vLLM). Configurations (``--configs``): inproc, sync-shm, sync-zmq,
async-shm, async-zmq, each with the mock model and (latency only, by default) the tiny
model as a realism check. Progress goes to stderr; the tables to stdout; results.json,
samples.json and the PNG plots to a folder of the run's own (``--out``, which must not
exist yet, or ``results/<timestamp>-<random>/``).

Every block is judged for load from other processes (``shmclient_bench.load``): noisy blocks are
marked in the JSON and the tables, and a noisy run says so in the first line of its
report. SIGINT or SIGTERM at any point stops every engine and child process, removes
what they left in /dev/shm and the temporary folder, saves what finished and exits 130.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Sequence

import psutil

from . import clients, machine, plots, report, results_files, sections, stats, stopping
from .load import THRESHOLD_CORES, LoadMonitor

SECTIONS = ("latency", "streaming", "idle", "tensors", "ring", "contention", "fairness", "dp", "vllm",
            "serving")
#: Sections that run in a child process of their own (``_external``).
EXTERNAL = ("tensors", "ring", "contention", "fairness", "dp", "vllm", "serving")

#: How long runs take on a 2-vCPU VM (2026-12-03; see the README).
QUICK_DURATION = "fewer samples, fewer vLLM engines and servers"
FULL_DURATION = ("about 28 minutes on a 2-vCPU VM with vLLM installed (2026-12-03: 22 for a full "
                 "run before the vllm section's data-parallel part, 6 for that part alone)")

#: Defaults per run kind; every one can be overridden on the command line.
DEFAULTS = {
    "quick": {
        "samples": 1000,
        "tiny_samples": 1000,
        "rounds": 2,
        "warmup": 50,
        "streams": "1,16",
        "tokens": 64,
        "idle_settle": 2.0,
        "idle_window": 1.5,
        "configs": "all",
        # The tiny model's realism check, shortened: no async clients.
        "tiny_configs": "inproc,sync-shm,sync-zmq",
        "section_timeout": 180.0,
        # vLLM's section starts ten engines (~40 s each), four of them beside busy processes
        "vllm_timeout": 900.0,
        # four vLLM servers one after another (~30-40 s to start each), two benchmark
        # runs against each
        "serving_timeout": 900.0,
    },
    "full": {
        "samples": 3000,
        "tiny_samples": 2100,
        "rounds": 3,
        "warmup": 200,
        "streams": "1,16,256",
        "tokens": 64,
        "idle_settle": 5.0,
        "idle_window": 5.0,
        "configs": "all",
        "tiny_configs": "all",
        "section_timeout": 900.0,
        "vllm_timeout": 2400.0,
        "serving_timeout": 1800.0,
    },
}


def _ints(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def _sections(text: str) -> tuple[str, ...]:
    vals = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [v for v in vals if v not in SECTIONS]
    if bad or not vals:
        raise argparse.ArgumentTypeError(
            f"unknown section(s) {', '.join(bad) or '(none)'}; expected some of {', '.join(SECTIONS)}"
        )
    return vals


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m shmclient_bench",
        description="shmclient benchmarks: client latency, streaming, idle CPU, tensor "
        f"transfer and raw ring, shm against the zmq baseline in one run. A full run "
        f"(the default) takes {FULL_DURATION}, --quick {QUICK_DURATION}; more on a busy "
        "host, whose figures the run marks noisy. Ctrl-C stops it cleanly (exit 130), "
        "keeping what finished.",
    )
    p.add_argument("--quick", action="store_true", help=f"a short run ({QUICK_DURATION})")
    p.add_argument(
        "--out",
        help="results folder, created by this run: it must not exist yet "
        "(default results/<timestamp>-<random>/)",
    )
    p.add_argument(
        "--configs",
        help="comma-separated configurations: "
        + ", ".join(clients.KINDS)
        + "; 'kind@model' for one model only; 'all' for every kind (default: every kind "
        "for every model; in a quick run the tiny model only for inproc, sync-shm, sync-zmq)",
    )
    p.add_argument(
        "--models",
        default=None,
        help="models for plain kinds in --configs: mock, tiny, tiny-cuda (default mock,tiny; "
        "tiny-cuda added when a GPU is visible)",
    )
    p.add_argument("--only", type=_sections, default=SECTIONS, help="sections: " + ",".join(SECTIONS))
    p.add_argument("--samples", type=int, help="round trips per latency figure (quick 1000, full 3000)")
    p.add_argument(
        "--tiny-samples", type=int, help="round trips per tiny-model latency figure (quick 1000, full 2100)"
    )
    p.add_argument("--rounds", type=int, help="rounds in rotation (quick 2, full 3)")
    p.add_argument("--warmup", type=int, help="warm-up round trips per block, excluded (quick 50, full 200)")
    p.add_argument("--streams", type=_ints, help="concurrent requests N (quick 1,16; full 1,16,256)")
    p.add_argument("--tokens", type=int, help="tokens per streamed request M (64)")
    p.add_argument(
        "--stream-models", default="mock", help="models the streaming section runs for (mock)"
    )
    p.add_argument("--idle-settle", type=float, help="seconds idle before measuring (quick 2, full 5)")
    p.add_argument("--idle-window", type=float, help="seconds measured idle (quick 1.5, full 5)")
    p.add_argument(
        "--set",
        metavar="FIELD=VALUE",
        action="append",
        default=[],
        help="an EngineConfig field for every configuration, e.g. --set spin_us=100 "
        "(repeatable; transport, model and device are set per configuration)",
    )
    p.add_argument(
        "--section-timeout",
        type=float,
        help="seconds each section run in a child process may take (quick 180, full 900; "
        "the vllm section 900 / 2400, the serving section 900 / 1800)",
    )
    p.add_argument(
        "--noisy-above",
        type=float,
        default=THRESHOLD_CORES,
        metavar="CORES",
        help="mark a block noisy when other processes used more than this many cores on "
        f"average during it ({THRESHOLD_CORES:g})",
    )
    p.add_argument("--no-plots", action="store_true", help="write no PNG")
    # Internal: the child process that runs one external section.
    p.add_argument("--run-section", choices=EXTERNAL, help=argparse.SUPPRESS)
    p.add_argument("--section-json", help=argparse.SUPPRESS)
    return p


def _cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def _base_config(items: Sequence[str]) -> Any:
    """EngineConfig() with the ``--set FIELD=VALUE`` changes (values read as Python
    literals where they parse, else as strings); None without changes."""
    if not items:
        return None
    import ast

    from shmclient.config import EngineConfig, unknown_field_message

    changes: dict[str, Any] = {}
    for item in items:
        field, sep, text = item.partition("=")
        field = field.strip()
        if not sep:
            raise ValueError(f"expected FIELD=VALUE with an EngineConfig field, got {item!r}")
        if field not in EngineConfig.__struct_fields__:
            raise ValueError(unknown_field_message(
                "EngineConfig", field, EngineConfig.__struct_fields__))
        if field in ("transport", "model", "device"):
            raise ValueError(f"{field} is set per configuration (use --configs / --models)")
        try:
            changes[field] = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError):
            changes[field] = text.strip()
    return EngineConfig().replace(**changes)


class Progress:
    """Progress lines on stderr, each stamped with the seconds since the run began.

    ``start_ticker()`` adds, when the stream is a terminal, a line every ``every_s``
    seconds that nothing else was printed (a long block is still running); it prints
    nothing when the stream is a file or a pipe.
    """

    def __init__(self, stream: Any = None, every_s: float = 10.0) -> None:
        self.t0 = time.perf_counter()
        self.stream = stream if stream is not None else sys.stderr
        self.every_s = every_s
        self.phase = ""
        self._last = self.t0
        self._phase_t = self.t0
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        self._lock = threading.Lock()

    def __call__(self, msg: str) -> None:
        now = time.perf_counter()
        with self._lock:
            self.phase, self._phase_t, self._last = msg, now, now
            print(f"[bench {now - self.t0:6.1f}s] {msg}", file=self.stream, flush=True)

    def is_terminal(self) -> bool:
        try:
            return bool(self.stream.isatty())
        except (AttributeError, ValueError):
            return False

    def start_ticker(self) -> None:
        if self._ticker is not None or not self.is_terminal():
            return
        self._ticker = threading.Thread(target=self._tick, name="bench-progress", daemon=True)
        self._ticker.start()

    def _tick(self) -> None:
        while not self._stop.wait(min(1.0, self.every_s / 2)):
            now = time.perf_counter()
            with self._lock:
                if now - self._last < self.every_s or not self.phase:
                    continue
                self._last = now
                print(
                    f"[bench {now - self.t0:6.1f}s] ... still at: {self.phase} "
                    f"({now - self._phase_t:.0f} s)",
                    file=self.stream,
                    flush=True,
                )

    def stop(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(5)
            self._ticker = None


# -- the external sections -----------------------------------------------------------


def _external(
    name: str,
    quick: bool,
    progress: Progress,
    res: dict[str, Any],
    timeout_s: float,
    monitor: Any,
    tmpdir: str,
    pids: set[int],
) -> None:
    """Run ``bench.<name>.run(quick)`` if that module is there; note why not otherwise.

    It runs in a child process of its own (a fresh interpreter, none of this run's
    clients or threads) in its own session and process group, with ``tmpdir`` as its
    temporary folder. The group is stopped (SIGTERM, then SIGKILL) if the section takes
    longer than ``timeout_s`` or this run is interrupted; shared-memory entries its
    processes leave are removed either way. ``pids`` collects the group's pids.
    """
    try:
        mod = importlib.import_module(f"shmclient_bench.{name}")
    except ImportError as e:
        res["skipped"].append(f"{name}: shmclient_bench.{name} is not importable ({e})")
        progress(f"{name}: skipped, shmclient_bench.{name} is not importable ({e})")
        return
    if not callable(getattr(mod, "run", None)):
        res["skipped"].append(f"{name}: shmclient_bench.{name} has no run(quick)")
        return
    progress(f"{name}: running shmclient_bench.{name}.run(quick={quick}) in a child process")
    t0 = time.perf_counter()
    path = os.path.join(tmpdir, f"bench-{name}.json")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env["TMPDIR"] = tmpdir
    env["SHMCLIENT_BENCH_NOISY_ABOVE"] = str(monitor.threshold_cores)
    cmd = [sys.executable, "-m", "shmclient_bench", "--run-section", name, "--section-json", path]
    if quick:
        cmd.append("--quick")
    got: sections.SectionOutput[Any] | None = None
    rc: int | None = None
    proc: subprocess.Popen | None = None
    try:
        with monitor.block(name) as blk:
            proc = subprocess.Popen(
                cmd, env=env, stdin=subprocess.DEVNULL, stdout=sys.stderr, start_new_session=True
            )
            deadline = time.monotonic() + timeout_s
            while rc is None:
                try:
                    rc = proc.wait(0.5)
                except subprocess.TimeoutExpired:
                    pids.update(stopping.group_pids(proc.pid))
                    if time.monotonic() > deadline:
                        break
        if rc is None:
            stopping.stop_group(proc, pids)
            msg = f"{name}: shmclient_bench.{name}.run() did not finish within {timeout_s:g} s; killed"
            res["errors"].append(msg)
            progress(msg)
            return
        got = sections.read_output(name, path)
    finally:
        if proc is not None:
            if proc.poll() is None:
                stopping.stop_group(proc, pids)
            # The group's processes may not have lived to unlink what they created.
            stopping.sweep_shm(pids | {proc.pid})
        try:
            os.unlink(path)
        except OSError:
            pass
    if rc != 0 or got is None or got.result is None:
        err = (got.error if got is not None else None) or f"the child process exited with status {rc}"
        res["errors"].append(f"{name}: {err}")
        if got is not None and got.traceback:
            res.setdefault("tracebacks", {})[name] = got.traceback
        progress(f"{name}: failed: {err}")
        return
    res[name] = got.result
    if got.skipped is not None:
        res["skipped"].append(f"{name}: {got.skipped}")
    res.setdefault("section_load", {})[name] = blk.as_dict()
    if got.table:
        res.setdefault("tables", {})[name] = got.table
    if got.note:
        res["notes"].append(got.note)
    noisy = f" [noisy: other processes used {blk.other_cores:.2f} cores]" if blk.noisy else ""
    progress(f"{name}: done in {time.perf_counter() - t0:.1f} s{noisy}")


# -- the run ---------------------------------------------------------------------------


def new_results_dir(base: str = "results", now: datetime.datetime | None = None) -> str:
    """Create and return a fresh folder ``base/<YYYYmmdd-HHMMSS>-<6 hex digits>``; never
    one that exists (two runs started in the same second get two folders)."""
    stamp = (now or datetime.datetime.now()).strftime("%Y%m%d-%H%M%S")
    os.makedirs(base, exist_ok=True)
    for _ in range(100):
        path = os.path.join(base, f"{stamp}-{secrets.token_hex(3)}")
        try:
            os.mkdir(path)
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"no free results folder name under {base!r} for {stamp}")


def _run_tmpdir() -> str:
    """A fresh private temporary folder for the run, in the usual temporary folder, or
    in /tmp where that path is too long for the unix sockets made inside it (108
    bytes in all, and shmclient_bench.ring / shmclient_bench.tensors add up to ~30)."""
    path = tempfile.mkdtemp(prefix="bench-run-")
    if len(path) > 70 and os.path.isdir("/tmp"):
        os.rmdir(path)
        path = tempfile.mkdtemp(prefix="bench-run-", dir="/tmp")
    return path


def _prog() -> str:
    return "shmclient-bench" if os.path.basename(sys.argv[0] or "") == "shmclient-bench" else "python -m shmclient_bench"


def main(argv: Sequence[str] | None = None) -> int:
    """The benchmark's command line (``python -m shmclient_bench``, ``shmclient-bench``): returns
    the exit status (0 done, 1 a section failed, 2 bad arguments, 130 interrupted)."""
    signals = stopping.Signals()
    signals.install()
    try:
        return _main(argv, signals)
    except KeyboardInterrupt:
        # Before the run had a folder (parsing the arguments, importing).
        print(
            f"{_prog()}: interrupted ({signals.received or 'SIGINT'}) before the run began",
            file=sys.stderr,
        )
        return 130
    finally:
        signals.restore()


def _main(argv: Sequence[str] | None, signals: stopping.Signals) -> int:
    parser = build_parser()
    parser.prog = _prog()
    args = parser.parse_args(argv)
    args._argv = list(argv) if argv is not None else sys.argv[1:]
    if args.run_section:
        signals.restore()
        return sections.run_child(args.run_section, args.quick, args.section_json)
    prog = parser.prog
    d = DEFAULTS["quick" if args.quick else "full"]
    if not args.noisy_above > 0:
        print(f"{prog}: --noisy-above must be > 0, got {args.noisy_above}", file=sys.stderr)
        return 2
    models = args.models or ("mock,tiny,tiny-cuda" if _cuda() else "mock,tiny")
    try:
        if args.configs is not None:
            specs = clients.parse_configs(args.configs, models)
        else:
            names = [m.strip() for m in models.split(",") if m.strip()]
            specs = clients.parse_configs(d["configs"], [m for m in names if m == "mock"])
            tiny = [m for m in names if m != "mock"]
            if tiny:
                specs += clients.parse_configs(d["tiny_configs"], tiny)
    except ValueError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    try:
        base_config = _base_config(args.set)
    except (ValueError, Exception) as e:
        print(f"{prog}: --set: {e}", file=sys.stderr)
        return 2
    stream_models = tuple(m.strip() for m in args.stream_models.split(",") if m.strip())
    opts = clients.Options(
        sections=tuple(s for s in args.only if s in clients.SECTIONS),
        samples=args.samples if args.samples is not None else d["samples"],
        tiny_samples=(
            args.tiny_samples
            if args.tiny_samples is not None
            else args.samples if args.samples is not None else d["tiny_samples"]
        ),
        rounds=args.rounds if args.rounds is not None else d["rounds"],
        warmup=args.warmup if args.warmup is not None else d["warmup"],
        streams=args.streams or _ints(d["streams"]),
        tokens=args.tokens if args.tokens is not None else d["tokens"],
        stream_models=stream_models,
        idle_settle_s=args.idle_settle if args.idle_settle is not None else d["idle_settle"],
        idle_window_s=args.idle_window if args.idle_window is not None else d["idle_window"],
        base_config=base_config,
    )
    if opts.samples < 1 or (opts.tiny_samples or 1) < 1 or opts.rounds < 1 or opts.warmup < 0 or opts.tokens < 1:
        print(f"{prog}: --samples, --rounds, --tokens must be >= 1, --warmup >= 0", file=sys.stderr)
        return 2
    try:
        if args.out:
            out = args.out
            os.makedirs(out, exist_ok=False)
        else:
            out = new_results_dir()
    except FileExistsError:
        print(
            f"{prog}: results folder {args.out!r} already exists: every run writes a "
            "folder of its own (name another --out, or leave it out)",
            file=sys.stderr,
        )
        return 2
    except OSError as e:
        print(f"{prog}: cannot create the results folder: {e}", file=sys.stderr)
        return 2
    return _run(args, d, specs, opts, out, signals)


def _run(
    args: argparse.Namespace,
    d: dict[str, Any],
    specs: list[clients.ConfigSpec],
    opts: clients.Options,
    out: str,
    signals: stopping.Signals,
) -> int:
    t_start = time.perf_counter()
    try:
        kids_before = {p.pid for p in psutil.Process().children(recursive=True)}
    except psutil.Error:
        kids_before = set()
    progress = Progress()
    monitor = LoadMonitor(args.noisy_above)
    section_pids: set[int] = set()
    old_tempdir, old_env = tempfile.tempdir, os.environ.get("TMPDIR")
    run_tmp: str | None = None
    res: dict[str, Any] = {
        "args": {
            "quick": args.quick,
            "argv": list(args._argv),
            "sections": list(args.only),
            "configs": [s.name for s in specs],
            "options": {k: v for k, v in vars(opts).items() if k != "base_config"},
        },
        "skipped": [],
        "errors": [],
        "notes": [],
    }
    section = "start-up"
    interrupted = False
    try:
        progress.start_ticker()
        # Everything this run and its children put in a temporary folder goes in one of
        # its own, removed at the end whatever happens.
        run_tmp = _run_tmpdir()
        tempfile.tempdir = run_tmp
        os.environ["TMPDIR"] = run_tmp
        progress(f"results folder: {out}")
        res["machine"] = machine.machine_facts()
        try:
            from shmclient.config import EngineConfig

            cfg = opts.base_config if opts.base_config is not None else EngineConfig()
            res["engine_config"] = {f: getattr(cfg, f) for f in EngineConfig.__struct_fields__}
        except Exception:
            pass
        if opts.sections:
            section = "/".join(opts.sections)
            got: dict[str, Any] = {}
            try:
                clients.run(specs, opts, progress, monitor, res=got)
            finally:
                res["skipped"] += got.pop("skipped", [])
                res["errors"] += got.pop("errors", [])
                res["notes"] += got.pop("notes", [])
                res.update({k: v for k, v in got.items() if v or k.endswith("_meta")})
                if res.get("latency"):
                    res["latency_ratios"] = stats.latency_ratios(res["latency"])
        for name in EXTERNAL:
            if name in args.only:
                section = name
                _external(
                    name,
                    args.quick,
                    progress,
                    res,
                    args.section_timeout or d.get(f"{name}_timeout", d["section_timeout"]),
                    monitor,
                    run_tmp,
                    section_pids,
                )
    except KeyboardInterrupt:
        interrupted = True
        res["interrupted"] = {"signal": signals.received or "SIGINT", "during": section}
    finally:
        signals.hold = True  # a signal from here on is recorded, the clean-up runs on
        try:
            if interrupted:
                stopped = stopping.stop_descendants(kids_before)
                stopping.sweep_shm(monitor.seen_pids | section_pids | stopped | {os.getpid()})
            tempfile.tempdir = old_tempdir
            if old_env is None:
                os.environ.pop("TMPDIR", None)
            else:
                os.environ["TMPDIR"] = old_env
            if run_tmp is not None:
                shutil.rmtree(run_tmp, ignore_errors=True)
        finally:
            progress.stop()
    if signals.received and not interrupted:
        interrupted = True
        res["interrupted"] = {"signal": signals.received, "during": "the end of the run"}
    res["duration_s"] = time.perf_counter() - t_start
    res.setdefault("machine", {})
    try:
        res["machine"]["load_average_end"] = list(os.getloadavg())
    except OSError:
        pass
    res["load"] = monitor.summary()
    res["run_label"] = plots.run_label(res)
    files = _write_files(res, out, args.no_plots)

    if interrupted:
        print(
            f"{_prog()}: interrupted ({res['interrupted']['signal']}) during "
            f"{res['interrupted']['during']}; "
            f"what finished is in {out}",
            file=sys.stderr,
        )
        return 130
    if res["load"]["noisy"]:
        progress("warning: " + report.noisy_line(res["load"]))
    print(report.format_report(res))
    print()
    print(f"results: {files['results']}")
    if files.get("samples"):
        print(f"samples: {files['samples']}")
    for p in files.get("plots", []):
        print(f"plot:    {p}")
    if res["errors"]:
        print("errors:")
        for e in res["errors"]:
            print(f"  {e}")
    progress(f"done in {res['duration_s']:.1f} s")
    if signals.received:
        # While the complete results were being saved or printed: they are all there.
        print(
            f"{_prog()}: interrupted ({signals.received}) at the end; the run is complete in {out}",
            file=sys.stderr,
        )
        return 130
    return 1 if res["errors"] else 0


def _write_files(res: dict[str, Any], out: str, no_plots: bool) -> dict[str, Any]:
    """samples.json (large), the plots, then results.json (every summary); returns the
    paths, also kept in res['files']."""
    samples = res.get("latency_samples_ns") or {}
    files: dict[str, Any] = {}
    if samples:
        files["samples"] = results_files.write_json(os.path.join(out, "samples.json"),
                                                    results_files.samples_file(samples))
    if not no_plots:
        label = res.get("run_label")
        drawn = []
        by_model: dict[str, dict[str, Any]] = {}
        for cfg, s in samples.items():
            by_model.setdefault(cfg.partition("@")[2] or "mock", {})[cfg] = s
        for model, group in by_model.items():
            r = plots.plot_latency_cdf(
                group,
                os.path.join(out, f"latency_cdf_{model}.png"),
                f"Round trip, max_tokens=1, {model} model",
                label=label,
            )
            drawn.append(r)
        if res.get("tensors") is not None:
            drawn.append(
                plots.plot_transfer(
                    res["tensors"].points(),
                    os.path.join(out, "tensor_transfer.png"),
                    label=label,
                )
            )
        notes = sorted({p for p in drawn if p.startswith("plots skipped")})
        res["skipped"] += [n for n in notes if n not in res["skipped"]]
        files["plots"] = [p for p in drawn if not p.startswith("plots skipped")]
    files["results"] = os.path.join(out, "results.json")
    res["files"] = files
    results_files.write_json(files["results"], {k: v for k, v in res.items() if k != "latency_samples_ns"})
    return files


if __name__ == "__main__":
    sys.exit(main())
