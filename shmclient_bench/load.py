"""Load from other processes during a benchmark run.

A figure measured while another process competes for the CPU says more about that
process than about the transport. ``LoadMonitor`` samples, around each block of a run,
the CPU time the whole machine spent busy (``/proc/stat``: user, nice, system, irq,
softirq and steal, i.e. time taken by the hypervisor for other guests) and the CPU
time of this run (this process and every live descendant, including the children they
have already reaped). The difference is what other processes used; divided by the
block's wall time it is in cores. A block is *noisy* when others used more than
``threshold_cores`` on average, beyond the counters' own resolution (one clock tick,
10 ms, per CPU and per process of the run).

Linux only; elsewhere ``available`` is False and every block reads as not judged.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import asdict, dataclass
from typing import Any, Iterator

import psutil

#: Default threshold: other processes using more than a quarter of a core on average.
THRESHOLD_CORES = 0.25

_TICK_S = 1.0 / (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)


def machine_busy_s() -> float | None:
    """CPU seconds the whole machine has spent busy since boot (all CPUs), or None."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    vals = [int(v) for v in fields[1:]]
    # user nice system idle iowait irq softirq steal [guest guest_nice]; guest time is
    # already counted in user.
    user, nice, system, _idle, _iowait, irq, softirq, steal = (vals + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) * _TICK_S


def _proc_cpu_s(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system + getattr(t, "children_user", 0.0) + getattr(t, "children_system", 0.0)


def run_cpu_s(root: int | None = None) -> tuple[float, list[int]]:
    """(CPU seconds of process ``root`` (default: this one) and its live descendants,
    including their reaped children; the pids counted)."""
    try:
        me = psutil.Process(root)
    except psutil.Error:
        return 0.0, []
    total = 0.0
    pids: list[int] = []
    try:
        procs = [me, *me.children(recursive=True)]
    except psutil.Error:
        procs = [me]
    for p in procs:
        try:
            total += _proc_cpu_s(p)
            pids.append(p.pid)
        except psutil.Error:
            continue  # exited (or a zombie) between the listing and the read
    return total, pids


@dataclass
class Block:
    """What other processes used during one block of a run."""

    name: str
    wall_s: float = 0.0
    other_cpu_s: float | None = None
    own_cpu_s: float | None = None
    other_cores: float | None = None
    #: True / False, or None where the counters were unavailable or the block was too
    #: short to judge alone (``too_short``).
    noisy: bool | None = None
    too_short: bool = False

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class LoadMonitor:
    """Samples other processes' CPU around blocks; keeps every block's record."""

    def __init__(self, threshold_cores: float = THRESHOLD_CORES, root: int | None = None) -> None:
        if not threshold_cores > 0:
            raise ValueError(f"threshold_cores must be > 0, got {threshold_cores!r}")
        self.threshold_cores = float(threshold_cores)
        self.root = root
        self.available = machine_busy_s() is not None
        self.blocks: list[Block] = []
        #: Every process of the run seen at a sample (this one included).
        self.seen_pids: set[int] = set()
        self._run_start = self._sample()

    def _sample(self) -> tuple[float, float | None, float, int]:
        busy = machine_busy_s()
        own, pids = run_cpu_s(self.root)
        self.seen_pids.update(pids)
        return time.perf_counter(), busy, own, len(pids)

    def _judge(self, blk: Block, a: tuple[float, float | None, float, int], b: tuple[float, float | None, float, int]) -> Block:
        blk.wall_s = b[0] - a[0]
        if a[1] is None or b[1] is None or blk.wall_s <= 0:
            return blk
        busy = b[1] - a[1]
        own = b[2] - a[2]
        other = max(0.0, busy - own)
        blk.other_cpu_s = other
        blk.own_cpu_s = own
        blk.other_cores = other / blk.wall_s
        # The counters move in clock ticks: allow one per CPU and one per process of ours.
        slack = _TICK_S * ((os.cpu_count() or 1) + max(a[3], b[3]))
        if other > self.threshold_cores * blk.wall_s + slack:
            blk.noisy = True  # beyond the ticks' doubt, however short the block
        elif self.threshold_cores * blk.wall_s < slack:
            # Too short for the ticks to show the threshold (a 0.1 s block on 2 CPUs
            # with 6 processes would need a whole core): not judged quiet alone; the
            # whole run's window judges it with the rest.
            blk.too_short = True
        else:
            blk.noisy = False
        return blk

    @contextlib.contextmanager
    def block(self, name: str) -> Iterator[Block]:
        """Measure one block; the yielded record is filled in when the block ends
        (also when it raises)."""
        blk = Block(name)
        a = self._sample()
        try:
            yield blk
        finally:
            self._judge(blk, a, self._sample())
            self.blocks.append(blk)

    def summary(self) -> dict[str, Any]:
        """The run so far: every block, how many were noisy, the whole run's window
        (start to now, gaps between blocks included) and the verdict."""
        whole = self._judge(Block("whole run"), self._run_start, self._sample())
        judged = [b for b in self.blocks if b.noisy is not None]
        noisy = [b for b in judged if b.noisy]
        cores = [b.other_cores for b in judged if b.other_cores is not None]
        return {
            "available": self.available,
            "threshold_cores": self.threshold_cores,
            "blocks": [b.as_dict() for b in self.blocks],
            "blocks_judged": len(judged),
            "blocks_too_short": sum(b.too_short for b in self.blocks),
            "noisy_blocks": len(noisy),
            "max_other_cores": max(cores) if cores else None,
            "whole_run": whole.as_dict(),
            "noisy": bool(noisy) or bool(whole.noisy),
        }


class NullMonitor:
    """A monitor that measures nothing (for callers that pass none)."""

    threshold_cores = THRESHOLD_CORES
    available = False
    seen_pids: set[int] = set()

    @contextlib.contextmanager
    def block(self, name: str) -> Iterator[Block]:
        yield Block(name)
