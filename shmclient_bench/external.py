"""A section run in a child process of its own, from the run's side: ``_external``.

The child (``python -m shmclient_bench --run-section NAME``) runs in its own session
and process group with the run's temporary folder; the run waits for it within the
section's time limit, stops the group on a timeout or an interrupt, sweeps what its
processes left in /dev/shm, and files the section's typed result, table, note, error
or skip into the results dict. It imports the section's module only to check it is
there; the measuring happens in the child.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import time
from typing import Any

from . import sections, stopping
from .progress import Progress


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
            else:  # (a child that died leaves its group running: its busy processes)
                stopping.stop_group_left(proc.pid)
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
