"""CPU time of this process's threads and of other processes, and torch's thread count.

Where the kernel provides it, ``/proc/.../schedstat`` gives nanosecond run time (psutil's
per-thread times move in 10 ms ticks, too coarse for a 2 % idle target over a few
seconds); ``thread_cpu`` and ``process_cpu`` read both; ``run_queue_ns`` a thread's time
runnable without a CPU. ``torch_threads`` runs a block under a given torch thread count. Reads counters only: it imports psutil (and torch when
asked), never a client or the engine.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any

import psutil


# -- torch threads ---------------------------------------------------------------------


@contextlib.contextmanager
def torch_threads(n: int | None) -> Any:
    """Run the body with ``torch.set_num_threads(n)`` (None: leave torch alone), then put
    back the number there was; yields what torch reports inside."""
    if n is None:
        yield None
        return
    import torch

    old = torch.get_num_threads()
    if old != n:
        torch.set_num_threads(n)
    try:
        yield torch.get_num_threads()
    finally:
        if torch.get_num_threads() != old:
            torch.set_num_threads(old)


# -- CPU accounting -------------------------------------------------------------------


def _schedstat_ns(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def run_queue_ns(stats: dict[int, int]) -> int:
    """The calling thread's time spent runnable without a CPU so far (ns), from its
    ``/proc/thread-self/schedstat`` (kept open in ``stats``); -1 where there is none."""
    tid = threading.get_ident()
    fd = stats.get(tid)
    if fd is None:
        try:
            fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            fd = -1
        stats[tid] = fd
    if fd < 0:
        return -1
    try:
        return int(os.pread(fd, 128, 0).split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def thread_ids() -> set[int]:
    """Native ids of this process's threads (Python and native, e.g. ZMQ I/O threads)."""
    return {t.id for t in psutil.Process().threads()}


def thread_cpu(tids: set[int]) -> dict[int, dict[str, int | None]]:
    """CPU used so far by each of this process's threads in ``tids``:
    {tid: {'psutil_ns', 'sched_ns'}} (sched_ns None where schedstat is unavailable)."""
    out: dict[int, dict[str, int | None]] = {}
    for t in psutil.Process().threads():
        if t.id in tids:
            out[t.id] = {
                "psutil_ns": int(round((t.user_time + t.system_time) * 1e9)),
                "sched_ns": _schedstat_ns(f"/proc/self/task/{t.id}/schedstat"),
            }
    return out


def process_cpu(pid: int) -> dict[str, int | None]:
    """CPU used so far by process ``pid`` (all its threads)."""
    p = psutil.Process(pid)
    ct = p.cpu_times()
    sched: int | None = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        tasks = []
    for tid in tasks:
        v = _schedstat_ns(f"/proc/{pid}/task/{tid}/schedstat")
        if v is None:
            sched = None
            break
        sched += v  # type: ignore[operator]
    if not tasks:
        sched = None
    return {"psutil_ns": int(round((ct.user + ct.system) * 1e9)), "sched_ns": sched}


def _thread_name(tid: int) -> str:
    for t in threading.enumerate():
        if t.native_id == tid:
            return t.name
    try:
        with open(f"/proc/self/task/{tid}/comm", encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return f"tid {tid}"
