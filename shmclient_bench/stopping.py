"""Stopping a run cleanly: signals, child process groups and what they left in /dev/shm.

``Signals`` turns the first SIGINT or SIGTERM into KeyboardInterrupt in the main thread
and only records later ones; ``stop_group`` and ``stop_descendants`` end child processes
(SIGTERM, then SIGKILL); ``sweep_shm`` removes the shared-memory entries shmclient named
after processes that are gone.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import psutil

_SHM_DIR = "/dev/shm"
_SHM_NAME = re.compile(r"^(?:sem\.)?shmc\w*-(\d+)-")


class Signals:
    """SIGINT and SIGTERM raise KeyboardInterrupt once, in the main thread; later ones
    are only counted, so that the clean-up they started is not cut short."""

    def __init__(self) -> None:
        self.received: str | None = None
        self.later = 0
        #: While True a signal is only recorded (the run is cleaning up and saving).
        self.hold = False
        self._old: dict[int, Any] = {}

    def _handler(self, signum: int, frame: Any) -> None:
        if self.received is not None:
            self.later += 1
            return
        self.received = signal.Signals(signum).name
        if not self.hold:
            raise KeyboardInterrupt(self.received)

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handler)

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def sweep_shm(pids: set[int]) -> list[str]:
    """Remove /dev/shm entries (segments and semaphores) that shmclient named after a
    process in ``pids`` that is no longer running, or after this process. Returns the
    names removed."""
    removed = []
    me = os.getpid()
    try:
        names = os.listdir(_SHM_DIR)
    except OSError:
        return removed
    for n in names:
        m = _SHM_NAME.match(n)
        if m is None:
            continue
        pid = int(m.group(1))
        if pid in pids and (pid == me or not _alive(pid)):
            try:
                os.unlink(os.path.join(_SHM_DIR, n))
                removed.append(n)
            except OSError:
                pass
    return removed


def group_pids(pid: int) -> set[int]:
    try:
        p = psutil.Process(pid)
        return {pid, *(c.pid for c in p.children(recursive=True))}
    except psutil.Error:
        return set()


def stop_group(proc: subprocess.Popen, pids: set[int], grace_s: float = 5.0) -> None:
    """Stop a child that leads its own process group, and everything in that group:
    SIGTERM first (its clean-up runs), SIGKILL for whatever is left after ``grace_s``."""
    pids.update(group_pids(proc.pid))
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        pass
    rest = []
    for pid in pids - {proc.pid}:
        try:
            rest.append(psutil.Process(pid))
        except psutil.Error:
            pass
    if rest:
        psutil.wait_procs(rest, timeout=grace_s / 2)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for p in rest:
        try:
            p.kill()
        except psutil.Error:
            pass
    proc.wait()
    psutil.wait_procs(rest, timeout=2)


def stop_group_left(pgid: int, grace_s: float = 2.0) -> bool:
    """Stop what is left of a process group whose leader has exited (e.g. killed with
    SIGKILL: its children were not stopped by its clean-up, and they are no longer this
    process's descendants, unless it is a child subreaper: then they are its children,
    and reaped here): SIGTERM, then SIGKILL after ``grace_s``. The group's id is safe to
    signal where recorded pids are not (a pid is not reused while a group of that id
    exists). The leader must have been reaped already. Returns whether anything was
    left."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    if not _group_gone(pgid, grace_s):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        _group_gone(pgid, 1.0)  # (SIGKILL: at once, but for a process in D state)
    return True


def _group_gone(pgid: int, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for group ``pgid`` to have no process left, reaping those
    of its members that are this process's children; whether it has none."""
    deadline = time.monotonic() + timeout_s
    while True:
        _reap_group(pgid)
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)  # (mostly not our children: nothing to wait on)


def _reap_group(pgid: int) -> None:
    """Reap the members of group ``pgid`` that exited and are this process's children
    (orphans it took as a child subreaper): a zombie still belongs to its group, so until
    it is reaped the group looks alive."""
    while True:
        try:
            pid, _ = os.waitpid(-pgid, os.WNOHANG)
        except ChildProcessError:  # none of the group is ours
            return
        if pid == 0:
            return


def busy_process(*popen_args: Any, **popen_kw: Any) -> subprocess.Popen:
    """A process that keeps one CPU busy until it is killed or this process exits
    (``PR_SET_PDEATHSIG``: a run killed with SIGKILL does not leave it spinning)."""
    return subprocess.Popen([sys.executable, "-c", _BUSY, str(os.getpid())], *popen_args,
                            **popen_kw)


_BUSY = """\
import ctypes, os, sys
ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
if os.getppid() != int(sys.argv[1]):
    raise SystemExit  # (the parent was gone before the line above)
while True:
    pass
"""


def stop_descendants(before: set[int], grace_s: float = 5.0) -> set[int]:
    """Terminate, then kill, every descendant of this process not in ``before``; returns
    their pids."""
    try:
        kids = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    except psutil.Error:
        return set()
    pids = {p.pid for p in kids}
    for p in kids:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(kids, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=2)
    return pids
