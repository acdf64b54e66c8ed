"""Round trips on a busy host: shm against zmq, sync and async clients, over a matrix of
host states, in one run.

Run ``python -m shmclient_bench.contention [--quick]``; ``run(quick)`` returns a
``Contention`` (``shmclient_bench.contention_results``). The states: 0, 1, 2, 3 busy processes (and, on a bigger host, as many as there are
CPUs and one more), each a plain ``while True: pass`` process running for the whole cell;
and a 1-CPU CPU quota (``cpu.cfs_quota_us`` = period on cgroup v1, ``cpu.max`` on v2) over
this process and every engine, when this runs as root with that controller (otherwise
skipped with a note). Four clients (sync-shm, sync-zmq, async-shm, async-zmq), each with
its own engine, live for the whole run; in every cell they are measured in alternating
rounds, so that shm and zmq see the same load. Round trip = ``add_request`` of a 1-token
request to its finished output, mock model.

Per cell the report says whether the target holds: shm p50 <= zmq p50 and shm p99 <= 1.1
x zmq p99, sync and async apart. Not a test: it asserts nothing, it reports.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from typing import Any, Iterator

import numpy as np

from .client_configs import ConfigSpec
from .contention_results import Cell, Contention, RoundTrips
from .section_results import SectionHost, typed
from .session import Session
from . import stopping

KINDS = ("sync-shm", "sync-zmq", "async-shm", "async-zmq")
#: Target: shm p99 at most this times zmq's p99 in the same cell.
P99_SLACK = 1.1


def busy_counts(ncpu: int) -> list[int]:
    """The busy-process counts of the matrix: 0-3, and ncpu, ncpu + 1."""
    return sorted({0, 1, 2, 3, ncpu, ncpu + 1})


# -- the CPU quota cell -------------------------------------------------------------


def _cgroup_cpu_root() -> tuple[str, str] | None:
    """(version, mount point) of a writable cgroup CPU controller, or None."""
    if os.geteuid() != 0:
        return None
    if os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
        try:
            with open("/sys/fs/cgroup/cgroup.controllers", encoding="ascii") as f:
                if "cpu" in f.read().split():
                    return ("v2", "/sys/fs/cgroup")
        except OSError:
            return None
        return None
    for p in ("/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpu,cpuacct"):
        if os.path.exists(os.path.join(p, "cpu.cfs_quota_us")):
            return ("v1", p)
    return None


def _write(path: str, text: str) -> None:
    with open(path, "w", encoding="ascii") as f:
        f.write(text)


def _own_cgroup(version: str) -> str:
    """This process's cgroup path (relative), for the CPU controller."""
    with open("/proc/self/cgroup", encoding="ascii") as f:
        for line in f:
            _, ctrls, path = line.rstrip("\n").split(":", 2)
            if (version == "v2" and ctrls == "") or (version == "v1" and "cpu" in ctrls.split(",")):
                return path
    return "/"


@contextlib.contextmanager
def cpu_quota(pids: list[int], cpus: float = 1.0) -> Iterator[str]:
    """Run ``pids`` (whole processes, with their threads) under a CPU quota of ``cpus``
    for the block; they go back to where they were afterwards and the cgroup is removed.
    Raises OSError (or RuntimeError: no controller) when it cannot be set up."""
    root = _cgroup_cpu_root()
    if root is None:
        raise RuntimeError("no writable cgroup CPU controller (needs root and cgroup v1 cpu or v2)")
    version, mount = root
    home = os.path.join(mount, _own_cgroup(version).lstrip("/"))
    path = os.path.join(mount, f"shmclient-bench-{os.getpid()}")
    os.mkdir(path)
    period = 100_000
    try:
        if version == "v2":
            _write(os.path.join(path, "cpu.max"), f"{int(cpus * period)} {period}")
        else:
            _write(os.path.join(path, "cpu.cfs_period_us"), str(period))
            _write(os.path.join(path, "cpu.cfs_quota_us"), str(int(cpus * period)))
        moved: list[int] = []
        try:
            for pid in pids:
                _write(os.path.join(path, "cgroup.procs"), str(pid))
                moved.append(pid)
            yield path
        finally:
            for pid in moved:
                with contextlib.suppress(OSError):  # (a process that has exited)
                    _write(os.path.join(home, "cgroup.procs"), str(pid))
    finally:
        deadline = time.monotonic() + 5
        while True:
            try:
                os.rmdir(path)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)  # (a task still leaving the group)


# -- measuring ------------------------------------------------------------------------


@contextlib.contextmanager
def busy(n: int) -> Iterator[list[subprocess.Popen]]:
    hogs = [stopping.busy_process() for _ in range(n)]
    try:
        yield hogs
    finally:
        for h in hogs:
            h.kill()
        for h in hogs:
            h.wait()


def _pct(ns: list[int], q: float) -> float:
    return float(np.percentile(np.asarray(ns, dtype=np.float64), q)) / 1e3


#: How long the 1-CPU quota cell warms up once its processes are in the cgroup: every
#: process's spin gate reads the quota again at most once a second (GATE_QUOTA_S in
#: shmclient/_spin_gate.h), so a shorter warm-up measured mostly waiters that spun as
#: if there were none (the gate saw it after ~0.69 s; the quick cell lasts ~0.8 s).
QUOTA_SETTLE_S = 1.5


def _cell(sessions: dict[str, Session], n: int, rounds: int, warm: int, settle_s: float = 0.0) -> Cell:
    """Round trips of every session, ``rounds`` times ``n`` in alternating order, after
    ``warm`` each, repeated until ``settle_s`` has passed."""
    lat: dict[str, list[int]] = {k: [] for k in sessions}
    settled = time.monotonic() + settle_s
    while True:
        for k, s in sessions.items():
            s.latency_block(warm, 0)
        if time.monotonic() >= settled:
            break
    t0 = time.perf_counter()
    for r in range(rounds):
        order = list(sessions) if r % 2 == 0 else list(reversed(sessions))
        for k in order:
            lat[k] += sessions[k].latency_block(n, 0)
    wall_s = time.perf_counter() - t0
    trips = {k: RoundTrips(p50_us=_pct(v, 50), p99_us=_pct(v, 99), n=len(v)) for k, v in lat.items()}

    def met(mode: str) -> bool:
        shm, zmq = trips[f"{mode}-shm"], trips[f"{mode}-zmq"]
        return bool(shm.p50_us <= zmq.p50_us and shm.p99_us <= P99_SLACK * zmq.p99_us)

    return Cell(sync_shm=trips["sync-shm"], sync_zmq=trips["sync-zmq"], async_shm=trips["async-shm"],
                async_zmq=trips["async-zmq"], wall_s=wall_s, sync_target_met=met("sync"),
                async_target_met=met("async"))


def run(quick: bool = False) -> Contention:
    n, rounds, warm = (200, 4, 50) if quick else (500, 6, 100)
    ncpu = os.cpu_count() or 1
    cells: dict[str, Cell] = {}
    notes: list[str] = []
    sessions: dict[str, Session] = {}
    try:
        for k in KINDS:
            sessions[k] = Session(ConfigSpec(k, "mock"))
        for b in busy_counts(ncpu):
            with busy(b):
                cells[f"busy_{b}"] = _cell(sessions, n, rounds, warm)
        pids = [os.getpid()] + [s.engine_pid for s in sessions.values() if s.engine_pid]
        try:
            with cpu_quota(pids, 1.0):
                cells["quota_1cpu"] = _cell(sessions, n, rounds, warm, settle_s=QUOTA_SETTLE_S)
        except (OSError, RuntimeError) as e:
            notes.append(f"1-CPU quota cell skipped: {e}")
    finally:
        for s in sessions.values():
            s.close()
    return Contention(
        cells=cells, notes=notes, machine=SectionHost(cpus=ncpu, load_1m=os.getloadavg()[0]),
        all_targets_met=all(c.target_met(m) for c in cells.values() for m in ("sync", "async")),
    )


def _label(cell: str) -> str:
    if cell == "quota_1cpu":
        return "1-CPU quota"
    return f"{cell.split('_')[1]} busy"


def report(res: Contention | dict[str, Any]) -> str:
    """The section's table; ``res`` a ``Contention`` or its JSON form."""
    res = typed(res, Contention)
    lines = [
        "round trip of a 1-token request (µs), mock model, shm vs zmq in the same run; target: "
        f"shm p50 <= zmq p50 and shm p99 <= {P99_SLACK} x zmq p99",
        "",
        f"{'host':>12} | {'sync shm p50':>12} {'p99':>8} | {'zmq p50':>8} {'p99':>8} | {'target':>6} |"
        f" {'async shm p50':>13} {'p99':>8} | {'zmq p50':>8} {'p99':>8} | {'target':>6}",
    ]
    for cell, c in res.cells.items():
        row = f"{_label(cell):>12} |"
        for mode, w in (("sync", 12), ("async", 13)):
            s, z = c.pair(mode)
            ok = "met" if c.target_met(mode) else "NOT met"
            row += (
                f" {s.p50_us:{w}.1f} {s.p99_us:8.1f} | {z.p50_us:8.1f} {z.p99_us:8.1f} |"
                f" {ok:>6}" + (" |" if mode == "sync" else "")
            )
        lines.append(row)
    lines += [f"note: {x}" for x in res.notes]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from .sections import section_main

    return section_main(argv, __doc__, run, report, "fewer round trips per cell (~1 min)")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
