"""Shared fixtures. ``no_leaks`` runs around every test: a test must leave /dev/shm, /tmp,
the process table and the thread list as it found them."""

from __future__ import annotations

import gc
import os
import re
import threading

import psutil
import pytest

SHM_DIR = "/dev/shm"


_PID_IN_NAME = re.compile(r"^(?:sem\.)?shmc[\w]*-(\d+)-")


def _ours(name: str, pids: set[int]) -> bool:
    """Is this /dev/shm entry this test's? shmclient names carry the creator's pid: ours
    if that is this process or one of its children, or a process that is gone (a child
    that already exited); a live stranger's entry (a parallel test run) is not ours."""
    m = _PID_IN_NAME.match(name)
    if m is None:
        return False
    pid = int(m.group(1))
    return pid in pids or not psutil.pid_exists(pid)


def _tmp_entries() -> set[str]:
    """shmclient's own entries in /tmp (the project's prefix; pytest's tmp_path lives
    elsewhere in /tmp and cleans up after itself)."""
    return {n for n in os.listdir("/tmp") if n.startswith("shmc")}


def _shm_entries() -> set[str]:
    try:
        return set(os.listdir(SHM_DIR))
    except FileNotFoundError:  # pragma: no cover - non-Linux
        return set()


@pytest.fixture(autouse=True)
def no_leaks(request):
    """Fail the test if it leaves a /dev/shm or /tmp entry, a child process or a thread behind.

    Children and threads get a bounded grace period to finish exiting (they are waited on,
    not slept for); whatever is still there afterwards is killed and reported.
    """
    shm_before = _shm_entries()
    tmp_before = _tmp_entries()
    me = psutil.Process()
    kids_before = {p.pid for p in me.children(recursive=True)}
    threads_before = set(threading.enumerate())
    yield
    gc.collect()
    problems = []

    new_kids = [p for p in me.children(recursive=True) if p.pid not in kids_before]
    pids = {os.getpid(), *kids_before, *(p.pid for p in new_kids)}
    if new_kids:
        _, alive = psutil.wait_procs(new_kids, timeout=10)
        if alive:
            problems.append(f"child processes left: {[(p.pid, p.cmdline()) for p in alive]}")
            for p in alive:
                p.kill()
            psutil.wait_procs(alive, timeout=5)

    new_threads = [t for t in threading.enumerate() if t not in threads_before]
    for t in new_threads:
        t.join(timeout=5)
    stuck = [t.name for t in new_threads if t.is_alive()]
    if stuck:
        problems.append(f"threads left: {stuck}")

    leaked = {n for n in _shm_entries() - shm_before if _ours(n, pids)}
    if leaked:
        problems.append(f"/dev/shm entries left: {sorted(leaked)}")
        for name in leaked:
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except OSError:
                pass
    tmp_left = _tmp_entries() - tmp_before
    if tmp_left:
        problems.append(f"/tmp entries left: {sorted(tmp_left)}")
    if problems:
        pytest.fail(f"{request.node.nodeid} leaked: " + "; ".join(problems), pytrace=False)
