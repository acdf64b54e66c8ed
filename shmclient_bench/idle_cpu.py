"""Idle CPU of every multiprocess client and its engine, measured together: ``measure_idle``.

Every client first stays idle, then gets a caller parked in its get_output (a thread per
sync client, a task in its own loop per async client) while the CPU of its threads and
of its engine process is read over a window the load monitor judges. Uses ``cpu_time``
and the sessions it is given; it never starts or stops a client.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from .client_configs import Progress, _quiet
from .client_drivers import _park_async
from .cpu_time import _thread_name, process_cpu, thread_cpu
from .load import NullMonitor
from .session import Session


# -- idle CPU --------------------------------------------------------------------------


def _delta(a: dict[str, int | None], b: dict[str, int | None], key: str) -> int | None:
    if a.get(key) is None or b.get(key) is None:
        return None
    return int(b[key]) - int(a[key])  # type: ignore[arg-type]


def measure_idle(
    sessions: list[Session],
    settle_s: float,
    window_s: float,
    progress: Progress = _quiet,
    monitor: Any = None,
) -> dict[str, Any]:
    """Idle CPU of every MP client and its engine, measured together.

    All clients first stay idle ``settle_s``; then each gets a caller parked in its
    get_output (a thread per sync client, a task in its own loop per async client), and
    CPU is read over ``window_s``. A client's CPU is that of the threads it started plus
    its waiting thread; the engine's is its whole process. ``monitor`` (a
    ``shmclient_bench.load.LoadMonitor``) judges the measured window.
    """
    monitor = monitor if monitor is not None else NullMonitor()
    mp = [s for s in sessions if not s.spec.is_inproc and s.engine_pid is not None]
    if not mp:
        return {}
    progress(f"idle CPU: all clients idle {settle_s:g} s, then {window_s:g} s measured")
    time.sleep(settle_s)
    park_s = 0.2 + window_s + 0.2  # parked through the whole window, back soon after
    waiters: list[tuple[Session, Any, int]] = []
    notes: dict[str, str] = {}

    def park_sync(s: Session) -> None:
        try:
            outs = s.client.get_output(park_s)
            notes[s.name] = f"unexpected output while idle: {outs!r:.200}"
        except TimeoutError:
            pass
        except Exception as e:  # engine died, ...
            notes[s.name] = f"{type(e).__name__}: {e}"

    for s in mp:
        if s.loop is not None:
            waiters.append((s, s.loop.submit(_park_async(s.client, park_s)), s.loop.native_id))
        else:
            t = threading.Thread(target=park_sync, args=(s,), name=f"bench-idle-{s.name}")
            t.start()
            waiters.append((s, t, t.native_id))  # type: ignore[arg-type]
    time.sleep(0.2)  # past every spin budget: the waiters are parked
    me = os.getpid()
    all_tids = set().union(*(s.own_tids | {tid} for s, _, tid in waiters))
    with monitor.block("idle") as blk:
        t_a = time.perf_counter_ns()
        th_a = thread_cpu(all_tids)
        eng_a = {s.name: process_cpu(s.engine_pid) for s in mp}  # type: ignore[arg-type]
        proc_a = process_cpu(me)
        time.sleep(window_s)
        th_b = thread_cpu(all_tids)
        eng_b = {s.name: process_cpu(s.engine_pid) for s in mp}  # type: ignore[arg-type]
        proc_b = process_cpu(me)
        elapsed_ns = time.perf_counter_ns() - t_a
    names = {t: _thread_name(t) for t in all_tids}  # while the waiters still exist
    for s, w, _ in waiters:
        if isinstance(w, threading.Thread):
            w.join(park_s + 30)
        else:
            note = w.result(park_s + 30)
            if note:
                notes[s.name] = note

    out: dict[str, Any] = {}
    for s, _, wtid in waiters:
        tids = s.own_tids | {wtid}
        use_sched = all(
            th_a.get(t, {}).get("sched_ns") is not None and th_b.get(t, {}).get("sched_ns") is not None
            for t in tids
            if t in th_a and t in th_b
        ) and eng_a[s.name]["sched_ns"] is not None and eng_b[s.name]["sched_ns"] is not None
        key = "sched_ns" if use_sched else "psutil_ns"
        threads = {}
        client_ns = 0
        client_psutil_ns = 0
        for t in sorted(tids):
            if t not in th_a or t not in th_b:
                continue  # exited
            d = _delta(th_a[t], th_b[t], key) or 0
            dp = _delta(th_a[t], th_b[t], "psutil_ns") or 0
            client_ns += d
            client_psutil_ns += dp
            threads[names[t] + ("" if t != wtid else " (waiting caller)")] = d / elapsed_ns * 100
        eng_ns = _delta(eng_a[s.name], eng_b[s.name], key) or 0
        eng_psutil_ns = _delta(eng_a[s.name], eng_b[s.name], "psutil_ns") or 0
        entry: dict[str, Any] = {
            "client_pct": client_ns / elapsed_ns * 100,
            "engine_pct": eng_ns / elapsed_ns * 100,
            "client_pct_psutil": client_psutil_ns / elapsed_ns * 100,
            "engine_pct_psutil": eng_psutil_ns / elapsed_ns * 100,
            "source": "schedstat" if use_sched else "psutil",
            "window_s": elapsed_ns * 1e-9,
            "client_threads_pct": threads,
            "engine_pid": s.engine_pid,
            "noisy": blk.noisy,
            "other_cores": blk.other_cores,
        }
        if s.name in notes:
            entry["note"] = notes[s.name]
        out[s.name] = entry
    total = _delta(proc_a, proc_b, "sched_ns")
    if total is None:
        total = _delta(proc_a, proc_b, "psutil_ns")
    out_meta = {"frontend_process_pct_all_clients": (total or 0) / elapsed_ns * 100}
    return {"configs": out, "meta": out_meta}
