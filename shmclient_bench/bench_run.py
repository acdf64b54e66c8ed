"""One run of ``python -m shmclient_bench`` once its arguments are read: ``_run``.

It makes the run's private temporary folder, runs the client sections
(``shmclient_bench.clients``) and then each section in a child process of its own
(``external``), judges the load throughout, and, interrupted or not, stops what is
left, cleans up, writes samples.json, the plots and results.json (``_write_files``)
and prints the report. It owns the results dict of the run and its folder
(``new_results_dir``); the command line is ``cli``'s, the entry point ``__main__``'s.
"""

from __future__ import annotations

import argparse
import datetime
import os
import secrets
import shutil
import sys
import tempfile
import time
from typing import Any

import psutil

from . import clients, machine, plots, report, results_files, stats, stopping
from .cli import EXTERNAL, _prog
from .external import _external
from .load import LoadMonitor
from .progress import Progress


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
