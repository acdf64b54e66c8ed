"""The leak fixture counts only what this session made: two test runs started together on
one host each see their own leaks and not the other's (``conftest.LeakCheck``)."""

from __future__ import annotations

import os
import select
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading

import psutil
import pytest

from . import conftest
from .conftest import LeakCheck, session_tmp, wait_until
from .test_tensors import _resource_tracker  # noqa: F401 - shared memory starts it: before the test

#: A stranger: a process that is not this session's and writes where a parallel run would,
#: in the host's temporary folder (argv[2]) and in /dev/shm (argv[1]).
STRANGER = textwrap.dedent(
    """
    import os, sys, tempfile
    d = tempfile.mkdtemp(prefix="shmc-vllm-model-", dir=sys.argv[2])
    open(os.path.join(sys.argv[1], f"shmc-{os.getpid()}-stranger"), "w").close()
    print(d, os.getpid(), flush=True)
    """
)


def _free_pid() -> int:
    """A pid that no process has now and that this session never started."""
    for pid in range(int(open("/proc/sys/kernel/pid_max").read()) - 1, 300, -1):
        if not psutil.pid_exists(pid) and pid not in conftest._STARTED:
            return pid
    raise AssertionError("no free pid")


def test_the_session_has_a_private_temporary_folder_that_children_inherit():
    path = session_tmp()
    assert tempfile.gettempdir() == path and os.environ["TMPDIR"] == path
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    assert os.path.basename(path).startswith(conftest.SESSION_TMP_PREFIX)
    out = subprocess.run([sys.executable, "-c", "import tempfile; print(tempfile.gettempdir())"],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == path


def test_a_strangers_entries_do_not_count_and_this_sessions_do(tmp_path, monkeypatch):
    # /dev/shm is shared with other developers' runs (whose older fixture removes names it
    # takes for its own): the names are made in a folder of this test instead.
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setattr(conftest, "SHM_DIR", str(shm))
    host_tmp = os.path.dirname(session_tmp())
    check = LeakCheck()
    # A stranger's: a folder straight in the host's temporary folder (as a parallel run's
    # vLLM model folder), /dev/shm names carrying a live stranger's pid (pid 1 is nobody's
    # child here) or the pid of a stranger that exited.
    strangers = [f"shmc-1-{os.getpid()}-test", f"shmc-{_free_pid()}-{os.getpid()}-test"]
    for name in strangers:
        (shm / name).touch()
    env = {k: v for k, v in os.environ.items() if k != "TMPDIR"}
    r = subprocess.run([sys.executable, "-c", STRANGER, str(shm), host_tmp], env=env,
                       capture_output=True, text=True, check=True)
    stranger_dir, child_pid = r.stdout.split()
    try:
        assert os.path.dirname(stranger_dir) == host_tmp
        # That process was started here, though: its /dev/shm name counts, its folder in
        # the host's temporary folder does not.
        assert check.problems() == [f"/dev/shm entries left: ['shmc-{child_pid}-stranger']"]
    finally:
        os.rmdir(stranger_dir)
    assert not (shm / f"shmc-{child_pid}-stranger").exists()
    assert sorted(os.listdir(shm)) == sorted(strangers)  # a stranger's are left alone

    # This session's: an entry in its temporary folder, a /dev/shm name with our pid.
    check = LeakCheck()
    mine = f"shmc-{os.getpid()}-mine"
    (shm / mine).touch()
    left = tempfile.mkdtemp(prefix="shmc-vllm-model-")
    assert check.problems() == [
        f"/dev/shm entries left: ['{mine}']",
        f"temporary entries left in {session_tmp()}: ['{os.path.basename(left)}']"]
    assert not os.path.exists(left) and not (shm / mine).exists()


def test_an_entry_is_ours_only_when_its_creator_pid_is_the_sessions():
    """Before, a name whose creator was gone counted as ours: a parallel run's exited engine."""
    name = f"shmc-{_free_pid()}-x"
    assert not conftest._ours(name, {os.getpid()})
    assert conftest._ours(f"shmc-{os.getpid()}-x", {os.getpid()})
    assert conftest._ours(f"sem.shmc_t-{os.getpid()}-x", {os.getpid()})
    assert not conftest._ours("torch_123_x", {123})


def test_vllm_segments_nobody_holds_are_swept_and_held_ones_stay(_resource_tracker):
    """vLLM's own ``psm_*`` segments that a SIGKILLed engine could not unlink go; those a
    live process has mapped or open stay (another program's)."""
    from multiprocessing import shared_memory

    before = set(os.listdir(conftest.SHM_DIR))
    held = shared_memory.SharedMemory(create=True, size=4096)
    orphan = shared_memory.SharedMemory(create=True, size=4096)
    name = orphan.name
    orphan.close()  # unmapped, not unlinked: what a killed process leaves
    try:
        assert conftest.sweep_orphaned_vllm_segments(before) == [name]
        assert held.name in os.listdir(conftest.SHM_DIR)
        assert name not in os.listdir(conftest.SHM_DIR)
    finally:
        held.close()
        held.unlink()
        from multiprocessing import resource_tracker

        resource_tracker.unregister(f"/{name}", "shared_memory")  # swept: nothing left to track


def test_a_segment_left_open_or_mapped_is_a_leak():
    """shmclient's segments are memfds, which /dev/shm never shows: one a test leaves
    mapped (a ring end never closed) or open (a handle never released) is caught too."""
    from shmclient.shm import Segment

    check = LeakCheck()
    seg = Segment.create(8192)
    try:
        problems = check.problems()
        assert len(problems) == 1 and problems[0].startswith("shared memory still open or mapped")
        assert "fd " in problems[0] and "map " in problems[0]
        seg.close()
        assert "map " not in check.problems()[0]  # the handle is still open
    finally:
        seg.close()
        seg.release_handle()
    assert check.problems() == []


def _wait_exit_unreaped(pid: int) -> None:
    """Wait (10 s at most) for ``pid`` to exit, without reaping it."""
    fd = os.pidfd_open(pid)
    try:
        assert select.select([fd], [], [], 10)[0], f"process {pid} did not exit"
    finally:
        os.close(fd)


def test_a_child_left_unreaped_is_a_leak():
    """A child that exited is its starter's to reap: one left a zombie (its Popen still held,
    or dropped without a wait, where ``Popen.__del__`` would reap it unseen) is reported."""
    check = LeakCheck()
    held = subprocess.Popen([sys.executable, "-c", "pass"])
    dropped = subprocess.Popen([sys.executable, "-c", "pass"])
    held_pid, dropped_pid = held.pid, dropped.pid
    _wait_exit_unreaped(held_pid)
    _wait_exit_unreaped(dropped_pid)
    del dropped
    try:
        problems = check.problems()
        assert len(problems) == 1 and problems[0].startswith("child not reaped"), problems
        assert f"({held_pid}, " in problems[0] and f"({dropped_pid}, " in problems[0]
    finally:
        held.wait(10)  # (reaped by the check already)
    check = LeakCheck()
    subprocess.run([sys.executable, "-c", "pass"], check=True, timeout=30)
    assert check.problems() == []


def test_a_zombie_alone_or_a_thread_alone_is_seen_past_the_quick_look():
    """The check first looks, without a garbage collection, whether anything is new: a
    zombie its Popen still holds, or a thread still running, each on its own, is."""
    check = LeakCheck()
    held = subprocess.Popen([sys.executable, "-c", "pass"])
    _wait_exit_unreaped(held.pid)
    try:
        assert not check._nothing_new()
        problems = check.problems()
        assert len(problems) == 1 and problems[0].startswith("child not reaped"), problems
    finally:
        held.wait(10)  # (reaped by the check already)
    check = LeakCheck()
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, args=(60,), name="left-running")
    t.start()
    try:
        assert not check._nothing_new()
        assert check.problems(thread_wait_s=0.1) == ["threads left: ['left-running']"]
    finally:
        stop.set()
        t.join(10)
    assert check._nothing_new() and check.problems() == []


ORPHANING_FRONTEND = textwrap.dedent(
    """
    import sys
    from shmclient import EngineConfig, SyncMPClient
    c = SyncMPClient(EngineConfig(model="mock"))
    print(c.engine_pid, flush=True)
    sys.stdin.read()
    """
)


def test_an_orphaned_engine_is_still_seen():
    """A frontend subprocess is SIGKILLed while its engine is stopped (an engine that misses
    its frontend's death): the engine, an orphan, is reparented to this process (a child
    subreaper), not to pid 1, so the check sees it left running and kills it."""
    check = LeakCheck()
    fe = subprocess.Popen([sys.executable, "-c", ORPHANING_FRONTEND], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True)
    engine = None
    try:
        ready, _, _ = select.select([fe.stdout], [], [], 60)
        assert ready, "the frontend never reported its engine"
        engine = psutil.Process(int(fe.stdout.readline()))
        conftest.sigstop(engine.pid)  # (stopped late, it would see its frontend die and end)
        fe.kill()
        fe.wait(10)
        fe.stdin.close()
        fe.stdout.close()
        problems = check.problems(exit_wait_s=0.5)  # (stopped: it cannot exit meanwhile)
        assert len(problems) == 1 and problems[0].startswith("child processes left"), problems
        assert f"({engine.pid}, " in problems[0]
        assert not engine.is_running()  # killed and reaped by the check
    finally:
        if engine is not None and engine.is_running():
            engine.kill()
            psutil.wait_procs([engine], timeout=10)
        if fe.poll() is None:
            fe.kill()
            fe.wait(10)
        fe.stdin.close()
        fe.stdout.close()


#: A child whose threads keep running (a spinning one, sleeping ones) until it is killed.
THREADS = textwrap.dedent(
    """
    import sys, threading, time
    def spin():
        while True:
            pass
    def nap():
        while True:
            time.sleep(0.001)
    for target in (spin, nap, nap):
        threading.Thread(target=target, daemon=True).start()
    print("up", flush=True)
    threading.Event().wait()
    """
)


def test_sigstop_returns_once_every_thread_of_the_process_has_stopped():
    """``kill`` returns before the stop takes effect (a busy host delays it long enough
    for a process to go on reading its rings): ``sigstop`` waits until every thread is
    stopped, and the process runs on after SIGCONT."""
    child = subprocess.Popen([sys.executable, "-c", THREADS], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "up\n"
        assert len(conftest._thread_states(child.pid)) == 4
        conftest.sigstop(child.pid)
        assert set(conftest._thread_states(child.pid)) == {"T"}
        os.kill(child.pid, signal.SIGCONT)
        wait_until(lambda: set(conftest._thread_states(child.pid)) != {"T"}, 10, "it never ran on", every=0.001)
        conftest.sigstop(child.pid)
        assert set(conftest._thread_states(child.pid)) == {"T"}
        os.kill(child.pid, signal.SIGCONT)
        child.kill()
        wait_until(lambda: conftest._thread_states(child.pid) == ["Z"], 10, "no zombie", every=0.001)  # not reaped yet
        conftest.sigstop(child.pid)  # a zombie counts as stopped
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
    conftest.sigstop(int(open("/proc/sys/kernel/pid_max").read()) + 1)  # no such process: stopped


def test_sigstop_polls_until_the_last_thread_has_stopped_and_gives_up_at_its_timeout(monkeypatch):
    """The threads stop one by one: ``sigstop`` returns only once the last has; one that
    never stops is continued and reported after the timeout."""
    child = subprocess.Popen([sys.executable, "-c", THREADS], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "up\n"
        polls = iter([["T", "R", "S"], ["T", "T", "R"], ["T", "T", "T"]])
        seen = []
        monkeypatch.setattr(conftest, "_thread_states", lambda pid: seen.append(pid) or next(polls))
        conftest.sigstop(child.pid)
        assert seen == [child.pid] * 3
        monkeypatch.setattr(conftest, "_thread_states", lambda pid: ["T", "R"])
        with pytest.raises(TimeoutError, match=f"process {child.pid} did not stop within 0.05 s"):
            conftest.sigstop(child.pid, timeout=0.05)
        monkeypatch.undo()
        wait_until(lambda: set(conftest._thread_states(child.pid)) != {"T"}, 10, "it was left stopped", every=0.001)
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
