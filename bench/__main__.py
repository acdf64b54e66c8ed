"""``python -m bench``: every benchmark of shmclient in one run.

Sections (``--only`` picks some): ``latency`` (round trip of one max_tokens=1 request),
``streaming`` (N concurrent requests x M tokens), ``idle`` (idle CPU of client and
engine), ``tensors`` (bench.tensors' transfer sweep) and ``ring`` (bench.ring's raw ring
ping-pong against pyzmq ipc). Configurations (``--configs``): inproc, sync-shm, sync-zmq,
async-shm, async-zmq, each with the mock model and (latency only, by default) the tiny
model as a realism check. Progress goes to stderr; the tables to stdout; results.json,
samples.json and the PNG plots to ``--out`` (default ``results/<timestamp>/``).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Sequence

from . import clients, report

SECTIONS = ("latency", "streaming", "idle", "tensors", "ring")

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
        prog="python -m bench",
        description="shmclient benchmarks: client latency, streaming, idle CPU, tensor "
        "transfer and raw ring, shm against the zmq baseline in one run.",
    )
    p.add_argument("--quick", action="store_true", help="a short run (under a minute)")
    p.add_argument("--out", help="results folder (default results/<timestamp>/)")
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
        help="seconds the tensors and ring sections may take each (quick 180, full 900)",
    )
    p.add_argument("--no-plots", action="store_true", help="write no PNG")
    # Internal: the child process that runs one external section.
    p.add_argument("--run-section", choices=("tensors", "ring"), help=argparse.SUPPRESS)
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

    from engine.config import EngineConfig

    changes: dict[str, Any] = {}
    for item in items:
        field, sep, text = item.partition("=")
        field = field.strip()
        if not sep or field not in EngineConfig.__struct_fields__:
            raise ValueError(f"expected FIELD=VALUE with an EngineConfig field, got {item!r}")
        if field in ("transport", "model", "device"):
            raise ValueError(f"{field} is set per configuration (use --configs / --models)")
        try:
            changes[field] = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError):
            changes[field] = text.strip()
    return EngineConfig().replace(**changes)


class Progress:
    def __init__(self, stream: Any = None) -> None:
        self.t0 = time.perf_counter()
        self.stream = stream if stream is not None else sys.stderr

    def __call__(self, msg: str) -> None:
        print(f"[bench {time.perf_counter() - self.t0:6.1f}s] {msg}", file=self.stream, flush=True)


def _external(
    name: str, quick: bool, progress: Progress, res: dict[str, Any], timeout_s: float
) -> None:
    """Run ``bench.<name>.run(quick)`` if that module is there; note why not otherwise.

    It runs in a child process of its own (a fresh interpreter, none of this run's
    clients or threads) in its own session, killed with everything it started if it
    takes longer than ``timeout_s``: a hang there must not hang the whole benchmark.
    """
    try:
        mod = importlib.import_module(f"bench.{name}")
    except ImportError as e:
        res["skipped"].append(f"{name}: bench.{name} is not importable ({e})")
        progress(f"{name}: skipped, bench.{name} is not importable ({e})")
        return
    if not callable(getattr(mod, "run", None)):
        res["skipped"].append(f"{name}: bench.{name} has no run(quick)")
        return
    progress(f"{name}: running bench.{name}.run(quick={quick}) in a child process")
    t0 = time.perf_counter()
    fd, path = tempfile.mkstemp(prefix=f"bench-{name}-", suffix=".json")
    os.close(fd)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "bench", "--run-section", name, "--section-json", path]
    if quick:
        cmd.append("--quick")
    try:
        proc = subprocess.Popen(
            cmd, env=env, stdin=subprocess.DEVNULL, stdout=sys.stderr, start_new_session=True
        )
        try:
            rc = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            msg = f"{name}: bench.{name}.run() did not finish within {timeout_s:g} s; killed"
            res["errors"].append(msg)
            progress(msg)
            return
        try:
            with open(path, encoding="utf-8") as f:
                got = json.load(f)
        except (OSError, ValueError):
            got = {}
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    if rc != 0 or "result" not in got:
        err = got.get("error") or f"the child process exited with status {rc}"
        res["errors"].append(f"{name}: {err}")
        if got.get("traceback"):
            res.setdefault("tracebacks", {})[name] = got["traceback"]
        progress(f"{name}: failed: {err}")
        return
    res[name] = got["result"]
    if got.get("table"):
        res.setdefault("tables", {})[name] = got["table"]
    if got.get("note"):
        res["notes"].append(got["note"])
    progress(f"{name}: done in {time.perf_counter() - t0:.1f} s")


def _run_section(name: str, quick: bool, path: str) -> int:
    """In the child: run ``bench.<name>.run(quick)``, write {result, table} or {error,
    traceback} as JSON to ``path``."""
    out: dict[str, Any] = {}
    rc = 0
    try:
        mod = importlib.import_module(f"bench.{name}")
        out["result"] = mod.run(quick)
    except Exception as e:
        out = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        rc = 1
    else:
        render = getattr(mod, "report", None) or getattr(mod, "table", None)
        if callable(render):
            try:
                text = render(out["result"])
                if isinstance(text, str):
                    out["table"] = text
            except Exception as e:
                out["note"] = f"{name}: bench.{name}'s table failed: {type(e).__name__}: {e}"
    report.write_json(path, out)
    return rc


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.run_section:
        return _run_section(args.run_section, args.quick, args.section_json)
    d = DEFAULTS["quick" if args.quick else "full"]
    progress = Progress()
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
        print(f"python -m bench: {e}", file=sys.stderr)
        return 2
    try:
        base_config = _base_config(args.set)
    except (ValueError, Exception) as e:
        print(f"python -m bench: --set: {e}", file=sys.stderr)
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
        print("python -m bench: --samples, --rounds, --tokens must be >= 1, --warmup >= 0", file=sys.stderr)
        return 2
    out = args.out or os.path.join(
        "results", datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    )
    os.makedirs(out, exist_ok=True)

    t_start = time.perf_counter()
    progress(f"results folder: {out}")
    res: dict[str, Any] = {
        "args": {
            "quick": args.quick,
            "argv": list(argv) if argv is not None else sys.argv[1:],
            "sections": list(args.only),
            "configs": [s.name for s in specs],
            "options": {k: v for k, v in vars(opts).items() if k != "base_config"},
        },
        "machine": report.machine_facts(),
        "skipped": [],
        "errors": [],
        "notes": [],
    }
    load = res["machine"].get("load_average")
    if load and os.cpu_count() and load[0] > 0.5 * os.cpu_count():
        msg = (
            f"the machine is busy (load average {load[0]:.2f} on {os.cpu_count()} CPUs): "
            "expect noisy figures, tails above all"
        )
        res["notes"].append(msg)
        progress("warning: " + msg)
    try:
        from engine.config import EngineConfig

        cfg = base_config if base_config is not None else EngineConfig()
        res["engine_config"] = {f: getattr(cfg, f) for f in EngineConfig.__struct_fields__}
    except Exception:
        pass

    if opts.sections:
        got = clients.run(specs, opts, progress)
        res["skipped"] += got.pop("skipped")
        res["errors"] += got.pop("errors")
        res["notes"] += got.pop("notes")
        res.update({k: v for k, v in got.items() if v or k.endswith("_meta")})
        if res.get("latency"):
            res["latency_ratios"] = report.latency_ratios(res["latency"])
    for name in ("tensors", "ring"):
        if name in args.only:
            _external(name, args.quick, progress, res, args.section_timeout or d["section_timeout"])
    res["duration_s"] = time.perf_counter() - t_start
    try:
        res["machine"]["load_average_end"] = list(os.getloadavg())
    except OSError:
        pass

    # Files: samples apart (large), summaries in results.json, then the plots.
    samples = res.pop("latency_samples_ns", {}) or {}
    files: dict[str, str] = {}
    if samples:
        files["samples"] = report.write_json(os.path.join(out, "samples.json"), samples)
    if not args.no_plots:
        plots = []
        by_model: dict[str, dict[str, Any]] = {}
        for cfg, s in samples.items():
            by_model.setdefault(cfg.partition("@")[2] or "mock", {})[cfg] = s
        for model, group in by_model.items():
            r = report.plot_latency_cdf(
                group,
                os.path.join(out, f"latency_cdf_{model}.png"),
                f"Round trip, max_tokens=1, {model} model",
            )
            plots.append(r)
        if res.get("tensors") is not None:
            plots.append(
                report.plot_transfer(
                    report.transfer_series(res["tensors"]), os.path.join(out, "tensor_transfer.png")
                )
            )
        notes = sorted({p for p in plots if p.startswith("plots skipped")})
        res["skipped"] += notes
        files["plots"] = [p for p in plots if not p.startswith("plots skipped")]  # type: ignore[assignment]
    files["results"] = os.path.join(out, "results.json")
    res["files"] = files
    report.write_json(files["results"], res)

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
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
