"""The ``serving`` section's servers: starting vLLM's OpenAI server, stock or with the
plug-in, and stopping it with every process it started.

``start_server`` spawns a server in its own process group (``LAUNCHERS``: the OpenAI
server module for one API server, ``vllm serve`` for several), waits until every API
server is up, and checks the plug-in's lines in its log (``plugin_lines``, ``dp_flags``,
``api_server_flags``); ``_pause`` / ``_resume`` stop and continue a whole group (SIGSTOP,
SIGCONT: two servers up at once, one measured at a time); ``_stop`` ends the whole group,
orphans included, and sweeps what shmclient named after them in /dev/shm. Processes and
logs only: it never imports vLLM, the benchmark's client or the section's figures.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Iterator, Sequence

import psutil

PLUGIN_LINE = "shmclient.vllm: AsyncMPClient moves engine-core requests and outputs over shared-memory rings"
#: The plug-in's lines with several API servers (``vllm serve --api-server-count M``): one
#: of each API server (``rank`` 0 to M-1), with one engine core or with several (data
#: parallelism), and one of the launcher, the parent that starts the engines and the API
#: servers. ``plugin_lines`` fills them in.
API_SERVER_LINE = ("shmclient.vllm: AsyncMPClient (API server {rank} of {servers}) moves engine-core "
                   "requests and outputs over shared-memory rings")
DP_API_SERVER_LINE = ("shmclient.vllm: DPLBAsyncMPClient ({engines} engines, API server {rank} of {servers}) "
                      "moves engine-core requests and outputs over shared-memory rings")
LAUNCHER_LINE = ("shmclient.vllm: the launcher made shared-memory rings for {servers} API servers "
                 "x {engines} engine core{s}")
#: How a server is started: the OpenAI server module (one API server), or ``vllm serve``
#: (any number of API servers) through ``vllm_cli``; MODEL stands for the model's folder.
LAUNCHERS = {
    "api_server": ["-m", "vllm.entrypoints.openai.api_server", "--model", "MODEL"],
    "serve": ["-m", "shmclient_bench.vllm_cli", "serve", "MODEL"],
    # vllm serve as above, its API servers timed (shmclient_bench.vllm_served_hop)
    "serve_hop": ["-m", "shmclient_bench.vllm_served_hop", "--serve", "serve", "MODEL"],
}
#: The launchers that run ``vllm serve`` (from this folder).
SERVE_LAUNCHERS = ("serve", "serve_hop")
#: What a server logs once per API server when that API server accepts connections
#: (uvicorn's own line).
READY_LINE = "Application startup complete."
HEALTH_TIMEOUT_S, STOP_GRACE_S, PAUSE_TIMEOUT_S = 300.0, 15.0, 10.0
#: Beside --model and --port: float32 (bfloat16 needs CPU features a VM may lack), no CUDA
#: graphs, a KV cache of 256 MiB (4 KiB a token here: every request of a rate-inf run at once).
SERVER_FLAGS = ["--load-format", "dummy", "--dtype", "float32", "--enforce-eager",
                "--max-model-len", "512", "--kv-cache-memory-bytes", str(256 << 20),
                "--host", "127.0.0.1", "--disable-log-stats", "--disable-uvicorn-access-log"]


def _become_subreaper() -> None:
    """Orphans of a server (a worker whose engine core went first) become this process's
    children: reaped here, their CPU counted as the run's, not as another's."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM wait until the block (a clean-up) is done."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _spawn(cmd: list[str], env: dict[str, str], log: str) -> subprocess.Popen:
    with open(log, "w") as out:  # its own process group: stopped as a whole
        return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def _group_members(pgid: int) -> set[int]:
    """Every live process of the process group ``pgid``, those whose parent has already
    exited among them (a server's API servers or engines after its parent's death)."""
    out = set()
    for p in psutil.process_iter():
        with contextlib.suppress(OSError, psutil.Error):
            if os.getpgid(p.pid) == pgid:
                out.add(p.pid)
    return out


#: Where the processes' states are read (a test points it elsewhere).
_PROC = "/proc"


def _stopped(pid: int) -> bool:
    """Whether every thread of process ``pid`` is stopped by a signal (or it is gone). A
    stop takes effect thread by thread: the process's own state (its first thread's)
    can say stopped while another thread still runs (a polling worker's)."""
    try:
        tids = os.listdir(f"{_PROC}/{pid}/task")
    except OSError:
        return True
    for tid in tids:
        try:
            with open(f"{_PROC}/{pid}/task/{tid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):  # (that thread ended)
            continue
        if state not in (b"T", b"t", b"Z", b"X"):
            return False
    return True


def _pause(proc: subprocess.Popen, timeout_s: float = PAUSE_TIMEOUT_S) -> None:
    """SIGSTOP to the server's process group, and wait until every process of it is
    stopped: a paused server (its polling worker too) takes no CPU from the one being
    measured. Raises RuntimeError when one is not stopped within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        os.killpg(proc.pid, signal.SIGSTOP)  # again each time: a process forked meanwhile
        running = [pid for pid in _group_members(proc.pid) if not _stopped(pid)]
        if not running:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {running} of server group {proc.pid} not stopped in {timeout_s:g} s")
        time.sleep(0.01)


def _resume(proc: subprocess.Popen) -> None:
    """SIGCONT to the server's process group (a no-op for a group that runs)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGCONT)


def _stop(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM to the group, SIGKILL to whatever is left after ``grace_s``, every process
    waited for (the group's orphans too), what shmclient named after them in /dev/shm
    removed. A paused group is resumed first, so that it can shut down cleanly."""
    from .stopping import group_pids, stop_group, sweep_shm

    with _signals_held():
        _resume(proc)
        pids = group_pids(proc.pid) | _group_members(proc.pid)
        stop_group(proc, pids, grace_s)
        sweep_shm(pids)


def _tail(path: str, n: int = 3000) -> str:
    with contextlib.suppress(OSError), open(path, encoding="utf-8", errors="replace") as f:
        return f.read()[-n:]
    return ""


def _flag(flags: Sequence[str], name: str) -> str | None:
    """The value of ``name`` (``--name V`` or ``--name=V``) in ``flags``, the last one
    given; None when absent."""
    value = None
    for i, f in enumerate(flags):
        if f == name and i + 1 < len(flags):
            value = flags[i + 1]
        elif f.startswith(name + "="):
            value = f.split("=", 1)[1]
    return value


def api_server_count(flags: Sequence[str], launcher: str = "serve") -> int:
    """How many API servers a server started with ``flags`` runs: one for the OpenAI
    server module; for ``vllm serve`` ``--api-server-count``, which defaults to the data
    parallel size (internal load balancing, what these flags ask for)."""
    if launcher not in SERVE_LAUNCHERS:
        return 1
    count = _flag(flags, "--api-server-count") or _flag(flags, "--data-parallel-size") or "1"
    return max(int(count), 1)


def plugin_lines(dp: int = 1, api_servers: int = 1) -> list[str]:
    """The plug-in's lines in the log of a server with ``dp`` engine cores and
    ``api_servers`` API servers: every one must be there when the rings carry it all."""
    if api_servers <= 1:
        return [dp_flags(dp)[1]]
    line = API_SERVER_LINE if dp <= 1 else DP_API_SERVER_LINE
    return [*(line.format(rank=r, servers=api_servers, engines=dp) for r in range(api_servers)),
            LAUNCHER_LINE.format(servers=api_servers, engines=dp, s="s" if dp > 1 else "")]


def start_server(model: str, transport: str, tmp: str, log: str, flags: Sequence[str] = (),
                 plugin_line: str | Sequence[str] = PLUGIN_LINE,
                 launcher: str = "api_server", log_stats: bool = False) -> tuple[subprocess.Popen, int]:
    """A healthy server of ``transport`` (``flags`` added to its command line), started
    by ``launcher`` (a key of ``LAUNCHERS``), every API server of it up; raises, with its
    log's tail, when it exits, is not up in time, or its log lacks one of the plug-in's
    lines ``plugin_line`` (one line or several; for stock: has any of them).
    ``log_stats``: without ``--disable-log-stats`` (vLLM's gauges on /metrics, its
    periodic stats lines in the log)."""
    lines = [plugin_line] if isinstance(plugin_line, str) else list(plugin_line)
    servers = api_server_count(flags, launcher)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.makedirs(os.path.join(tmp, "rpc"), 0o700, exist_ok=True)  # vLLM's ipc sockets
    env = dict(os.environ, TMPDIR=tmp, VLLM_RPC_BASE_PATH=os.path.join(tmp, "rpc"))
    env.pop("SHMCLIENT_VLLM", None)
    if transport == "plugin":
        env["SHMCLIENT_VLLM"] = "1"
    if launcher in SERVE_LAUNCHERS:  # vllm_cli from this folder, whatever is installed
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    cmd = [model if a == "MODEL" else a for a in LAUNCHERS[launcher]]
    base = [f for f in SERVER_FLAGS if not (log_stats and f == "--disable-log-stats")]
    proc = _spawn([sys.executable, *cmd, "--port", str(port), *base, *flags], env, log)
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    try:
        healthy = False
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the {transport} server exited ({proc.returncode}):\n{_tail(log)}")
            if not healthy:
                with contextlib.suppress(OSError):
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                        healthy = r.status == 200
            # each API server answers once it logged its start (health may come from one)
            if healthy and _tail(log, 1 << 30).count(READY_LINE) >= servers:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {transport} server was not up in {HEALTH_TIMEOUT_S:g} s "
                                   f"({servers} API servers):\n{_tail(log)}")
            time.sleep(0.5)
        text = _tail(log, 1 << 30)
        wrong = [line for line in lines if (line in text) != (transport == "plugin")]
        if wrong:
            raise RuntimeError(f"the {transport} server's log {'lacks' if transport == 'plugin' else 'has'}"
                               f" the plug-in's lines {wrong!r}:\n{_tail(log)}")
    except BaseException:
        _stop(proc)
        raise
    return proc, port


def dp_flags(dp: int) -> tuple[list[str], str]:
    """The server flags for ``dp`` engine cores behind one API server (internal load
    balancing), and the plug-in's line its log then has."""
    if dp <= 1:
        return [], PLUGIN_LINE
    return (["--data-parallel-size", str(dp), "--api-server-count", "1", "--gpu-memory-utilization", "0.08"],
            f"shmclient.vllm: DPLBAsyncMPClient ({dp} engines) moves engine-core requests and outputs")


def api_server_flags(dp: int, api_servers: int) -> tuple[list[str], list[str]]:
    """The server flags for ``dp`` engine cores behind ``api_servers`` API servers
    (internal load balancing), and the plug-in's lines its log then has. More than one
    API server takes ``vllm serve`` (``launcher_for``)."""
    if api_servers <= 1:
        flags, line = dp_flags(dp)
        return flags, [line]
    flags = ["--api-server-count", str(api_servers)]
    if dp > 1:
        flags += ["--data-parallel-size", str(dp), "--gpu-memory-utilization", "0.08"]
    return flags, plugin_lines(dp, api_servers)


def launcher_for(api_servers: int) -> str:
    """The OpenAI server module for one API server, ``vllm serve`` for several."""
    return "serve" if api_servers > 1 else "api_server"
