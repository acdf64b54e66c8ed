"""``vllm serve`` with several API server processes, stock and with the plug-in: the same
answers, the same aborts, the same end when an engine core or an API server is killed.

Two layouts, both with two API servers (``--api-server-count 2``): ``api2``, one engine
core, and ``dp2``, two (``--data-parallel-size 2``, internal load balancing, a DP
coordinator). The ``vllm serve`` parent binds the listening socket and the engines' ZMQ
listeners, starts the engine cores, the coordinator and the API servers
(``ApiServer_0``, ``ApiServer_1``), and then watches them all: the kernel hands each new
connection to one of the API servers.

The kill tests come first, each with its own server (so that no more than one runs
then): an engine core killed in ``dp2``, an API server in ``api2`` (the other two pairings
would add ~4 min); then a plug-in ``api2`` server with small output rings, one of whose
API servers is stopped while its streams run. Then the stock and the plug-in server of one layout are shared by that
layout's tests, one layout at a time (four processes and more a server, ~1 min to start
here). Servers run with vLLM's stats on (without ``--disable-log-stats``): the abort test
reads vLLM's gauge of running requests and its count of generated tokens.

The plug-in servers' logs must have the plug-in's lines of every API server and of the
launcher (``shmclient_bench.serving.plugin_lines``), the stock servers' logs no line of
the plug-in. Run with ``python -m pytest -m vllm``; skipped when vLLM is not importable.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field

import psutil
import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

from .conftest import importorskip_vllm, sigstop, wait_until  # noqa: E402
importorskip_vllm()  # an error, not a skip, under SHMCLIENT_REQUIRE_VLLM=1

from shmclient_bench import serving  # noqa: E402
from shmclient_bench.stopping import sweep_shm  # noqa: E402

from .conftest import sweep_orphaned_vllm_segments  # noqa: E402
from .test_tensors import _resource_tracker  # noqa: E402,F401 - started once, before the servers

API_SERVERS = 2
#: layout -> engine cores, each with ``API_SERVERS`` API servers
LAYOUTS = {"api2": 1, "dp2": 2}
PROMPTS = [f"def f{i}(x):\n    return" for i in range(6)]
STREAMS = [f"import os\nclass C{i}:" for i in range(16)]
MAX_BURSTS = 4
#: The servers' context length (the model's config says as much): room for LONG.
MAX_MODEL_LEN = 8192
#: Tokens the kill and abort tests' streams ask for: ~20 s of an engine's work here (~3 ms
#: a step), longer than a starved client lags behind its server on a busy host. With
#: 480-token streams and 3 busy processes on this 2-core host the clients read their first
#: chunks up to 7 s late, when their servers had sent all 480 (and the kill then came
#: after every stream's end).
LONG = 6000
#: What stock did when one of its processes was SIGKILLed (measured on this 2-core host,
#: vLLM 0.31 and 0.32): the parent noticed at once, stopped the rest (SIGTERM, then SIGKILL
#: after vLLM's 5 s per kind of process: API servers, engine cores) and exited with 1,
#: 7-13 s after the kill. The plug-in must end the same way within these bounds.
KILLED_EXIT_CODE = 1
KILLED_EXIT_BOUND_S = 40.0
ALL_GONE_BOUND_S = 10.0  # after the parent's exit
#: What a killed server may leave in its TMPDIR: vLLM's own (its ipc sockets, its
#: torch.distributed init file, torch's compile cache) and the server's log.
VLLM_TMP_LEFTOVERS = ("rpc", "vllm_dist_", "torchinductor_", "server.log")
_SHMC_NAME = re.compile(r"^(?:sem\.)?shmc[\w]*-(\d+)-")


def flags_of(layout: str) -> list[str]:
    flags, _ = serving.api_server_flags(LAYOUTS[layout], API_SERVERS)
    return flags


def lines_of(layout: str) -> list[str]:
    """The plug-in's lines every plug-in server of ``layout`` must log."""
    return serving.plugin_lines(LAYOUTS[layout], API_SERVERS)


#: What a server that runs ``check_abort`` (or any LONG stream) is started with.
LONG_FLAGS = ["--max-model-len", str(MAX_MODEL_LEN)]


def start(model: str, transport: str, layout: str, tmp: str):
    return serving.start_server(model, transport, tmp, os.path.join(tmp, "server.log"),
                                [*flags_of(layout), *LONG_FLAGS], lines_of(layout), launcher="serve",
                                log_stats=True)


def title(p: psutil.Process) -> str:
    """A vLLM process's title (``VLLM::EngineCore_DP1``, ``VLLM::APIServer_0``)."""
    try:
        cmd = p.cmdline()
        return cmd[0] if len(cmd) == 1 else p.name()
    except psutil.Error:
        return "?"


def api_servers(proc) -> dict[int, int]:
    """pid -> rank of the server's API server processes."""
    out = {}
    for p in psutil.Process(proc.pid).children(recursive=True):
        m = re.fullmatch(r"VLLM::APIServer_(\d+)", title(p))
        if m:
            out[p.pid] = int(m.group(1))
    return out


# -- servers ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model():
    folder = tempfile.mkdtemp(prefix="shmc-serve-model-")
    serving.build_model(folder)
    for name, key in (("config.json", "max_position_embeddings"), ("tokenizer_config.json", "model_max_length")):
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            data = json.load(f)
        data[key] = MAX_MODEL_LEN
        with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request):
    """The layout of the tests that share servers; pytest runs one layout's tests
    together, and stops its servers (fixtures that depend on this one) before the next."""
    return request.param


class Server:
    """A server of one transport and layout, in a temporary folder of its own (its
    TMPDIR and vLLM's ipc sockets, its log)."""

    def __init__(self, model: str, transport: str, layout: str) -> None:
        self.transport, self.layout = transport, layout
        self.tmp = tempfile.mkdtemp(prefix=f"shmc-serve-{layout}-{transport}-")
        self.shm_before = set(os.listdir("/dev/shm"))
        try:
            self.proc, self.port = start(model, transport, layout, self.tmp)
        except BaseException:
            self.close()
            raise

    @property
    def log(self) -> str:
        with open(os.path.join(self.tmp, "server.log"), encoding="utf-8", errors="replace") as f:
            return f.read()

    def close(self) -> None:
        if hasattr(self, "proc"):
            serving._stop(self.proc)
        shutil.rmtree(self.tmp, ignore_errors=True)
        # vLLM's own worker queues, left by the processes its shutdown SIGKILLs
        sweep_orphaned_vllm_segments(self.shm_before)


@pytest.fixture(scope="module")
def stock(model, layout, _resource_tracker):
    server = Server(model, "stock", layout)
    yield server
    server.close()


@pytest.fixture(scope="module")
def plugin(model, layout, stock):
    server = Server(model, "plugin", layout)
    yield server
    server.close()


# -- clients -------------------------------------------------------------------------------

def completion(port: int, model: str, prompt: str, n: int) -> tuple[str, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(
        {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}).encode(),
        {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        out = json.load(r)
    return out["choices"][0]["text"], out["usage"]


@dataclass
class Stream:
    """What a streaming client saw."""

    text: str = field(default="", repr=False)
    chunks: int = 0
    done: bool = False  # the stream ended with data: [DONE]
    finish: str | None = None  # the last finish_reason
    error: str | None = None  # an error event, an HTTP status, or the exception
    local_port: int | None = None  # the client's end of the connection
    api_server: int | None = None  # the pid of the API server that kept the connection

    @property
    def complete(self) -> bool:
        return self.done and self.error is None and self.finish == "length"


def connections(pids: "dict[int, int]", port: int) -> dict[int, int]:
    """client port -> pid of the API server (among ``pids``) holding the connection:
    accepted connections to ``port`` only (the kernel queues the others on the
    listening socket the API servers share)."""
    out = {}
    for pid in pids:
        try:
            for c in psutil.Process(pid).net_connections("tcp"):
                if c.raddr and c.laddr.port == port:
                    out[c.raddr.port] = pid
        except psutil.Error:
            continue
    return out


def send(port: int, model: str, prompt: str, n: int, rank: int | None = None,
         timeout: float = 60) -> http.client.HTTPConnection:
    """Connect and send a streamed completion's request (temperature 0, ``n`` tokens);
    ``rank``: the engine (DP rank) that serves it (vLLM's X-data-parallel-rank header),
    default vLLM's load balancing. The answer is ``stream``'s to read."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.connect()
        conn.request("POST", "/v1/completions", json.dumps(
            {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
             "stream": True}),
            {"Content-Type": "application/json", **({} if rank is None else {"X-data-parallel-rank": str(rank)})})
    except BaseException:
        conn.close()
        raise
    return conn


def stream(port: int, model: str, prompt: str, n: int, pids: "dict[int, int] | None" = None,
           timeout: float = 60, out: Stream | None = None, rank: int | None = None,
           conn: http.client.HTTPConnection | None = None) -> Stream:
    """A streamed completion (``send``'s request, or ``conn``, its request sent already).
    ``pids``: the API servers, one of which is found holding the connection once the
    stream is read (HTTP keep-alive keeps it open until the client closes it). ``out``:
    the Stream to fill in (another thread may watch its chunks arrive)."""
    out = Stream() if out is None else out
    text = []
    try:
        if conn is None:
            conn = send(port, model, prompt, n, rank, timeout)
        out.local_port = conn.sock.getsockname()[1]
        resp = conn.getresponse()
        if resp.status != 200:
            out.error = f"HTTP {resp.status}"
            return out
        for line in resp:
            line = line.strip()
            if line == b"data: [DONE]":
                out.done = True
                continue
            if not line.startswith(b"data: "):
                continue
            msg = json.loads(line[6:])
            if "error" in msg:
                out.error = f"error event: {msg['error']}"
                continue
            out.chunks += 1
            choice = msg["choices"][0]
            text.append(choice["text"])
            out.finish = choice.get("finish_reason") or out.finish
        if pids:
            out.api_server = connections(pids, port).get(out.local_port)
    except Exception as e:  # noqa: BLE001 - what the client saw is the result
        out.error = f"{type(e).__name__}: {e}"
    finally:
        if conn is not None:
            conn.close()
        out.text = "".join(text)
    return out


def metric(port: int, name: str) -> float | None:
    """A vLLM metric from /metrics, summed over its series (the engines); None when
    /metrics has none. With several API servers /metrics comes from whichever API server
    takes the connection, and each shows every API server's figures (prometheus
    multiprocess mode, files in vLLM's PROMETHEUS_MULTIPROC_DIR): counters summed over the
    API servers; gauges such as the running requests' ``mostrecent``: per engine, the
    value last written by any API server. The engine sends a step's stats to one API
    server only. A gauge appears once first set (not before the first request)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        values = [float(line.rsplit(" ", 1)[1]) for line in r.read().decode().splitlines()
                  if line.startswith(name + "{")]
    return sum(values) if values else None


def running(port: int) -> float | None:
    """vLLM's gauge of the requests its engines run."""
    return metric(port, "vllm:num_requests_running")


def generated(port: int) -> float:
    """vLLM's count of the tokens its engines generated."""
    return metric(port, "vllm:generation_tokens_total") or 0.0


# -- kills: each starts its own server, before any shared one runs -------------------------------

def _proc_file(pid: int, name: str) -> str:
    try:
        with open(f"/proc/{pid}/{name}", encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError as e:
        return f"({type(e).__name__})"


def tree_report(parent: int, procs: "list[psutil.Process]") -> str:
    """What each process of a server is doing: its state and, per thread, the kernel
    function it waits in (what a server that does not end was stuck on)."""
    lines = []
    for pid, name in [(parent, "parent"), *((p.pid, title(p)) for p in procs)]:
        state = next((ln.split(None, 1)[1] for ln in _proc_file(pid, "status").splitlines()
                      if ln.startswith("State:")), "gone")
        try:
            tids = sorted(os.listdir(f"/proc/{pid}/task"), key=int)
        except OSError:
            tids = []
        waits = [f"{tid}:{_proc_file(pid, f'task/{tid}/comm')}@{_proc_file(pid, f'task/{tid}/wchan')}"
                 f"[{(_proc_file(pid, f'task/{tid}/stat').rsplit(')', 1)[-1].split() or ['?'])[0]}]" for tid in tids]
        lines.append(f"{pid} {name} {state}: {' '.join(waits)}")
    return "\n".join(lines)


def _ours(names: set[str], pids: set[int]) -> list[str]:
    return sorted(n for n in names if (m := _SHMC_NAME.match(n)) and int(m.group(1)) in pids)


@pytest.mark.parametrize("transport", ["stock", "plugin"])
@pytest.mark.parametrize("kill_layout, victim", [("dp2", "engine core"), ("api2", "API server")],
                         ids=["engine-core-dp2", "api-server-api2"])
def test_server_ends_when_one_of_its_processes_is_killed(model, _resource_tracker, kill_layout, victim,
                                                         transport, monkeypatch):
    """SIGKILL an engine core (EngineCore_DP1) or an API server (the one holding most
    streams) once each of 8 streams has its first chunk, thousands of tokens before its
    end: the parent sees it, stops every other process and exits with 1 in bounded time,
    nothing listens any more; no stream hangs; none completes that the killed process
    served; nothing of the plug-in's is left in /dev/shm or in the server's TMPDIR.

    With data parallelism the engine cores of a dense model are independent (vLLM runs
    each like a lone engine, no step in lockstep): the survivor's streams may run on
    while the parent stops the API servers. Half the streams are pinned to DP1 (vLLM's
    X-data-parallel-rank header): those cannot complete. The 8 requests are sent at once,
    before any is read (8 threads starting one after another on a busy host sent the
    last seconds after the first), and the kill waits on the streams themselves: waiting
    on the API servers' sockets (or on vLLM's gauges) reacted late on a busy host. Which
    API server holds which stream is found before any is read, the readers' threads are
    started before the requests go out: nothing slow between the first chunks and the kill."""
    monkeypatch.setenv("PYTHONFAULTHANDLER", "1")  # stacks in the log, should the parent not end
    tmp = tempfile.mkdtemp(prefix=f"shmc-serve-kill-{kill_layout}-")
    shm_before = set(os.listdir("/dev/shm"))
    proc = None
    try:
        proc, port = start(model, transport, kill_layout, tmp)
        tree = psutil.Process(proc.pid).children(recursive=True)
        pids = api_servers(proc)
        live = [Stream() for _ in range(8)]
        ranks = [i % 2 if victim == "engine core" else None for i in range(len(live))]
        with concurrent.futures.ThreadPoolExecutor(8) as ex:
            # the readers' threads run before the requests go out: started one after
            # another beside the first readers (one GIL), the last read its first chunk
            # up to 14 s after the first
            started = threading.Barrier(9)
            for _ in range(8):
                ex.submit(started.wait, 60)
            started.wait(60)
            conns = []
            try:
                for p, r in zip(STREAMS, ranks):
                    conns.append(send(port, model, p, LONG, r, 90))
                t_sent = time.monotonic()
                ports = [c.sock.getsockname()[1] for c in conns]
                # which API server holds which stream, and so the victim, before any stream
                # is read: psutil's walk over the API servers' fds took 2 s while 8 threads
                # read their streams (one GIL), and once the streams ended before the kill
                held = wait_until(lambda: (h := connections(pids, port)) and set(ports) <= set(h) and h, 60,
                                  "every stream's connection accepted by an API server", every=0.01)
                if victim == "engine core":
                    targets = [p for p in tree if title(p) == "VLLM::EngineCore_DP1"]
                else:  # the API server with the most streams (ApiServer_1 on a tie)
                    most = max(pids, key=lambda pid: ([held[lp] for lp in ports].count(pid), pids[pid]))
                    targets = [p for p in tree if p.pid == most]
                assert len(targets) == 1, [(p.pid, title(p)) for p in tree]
                name = title(targets[0])
            except BaseException:
                for c in conns:
                    c.close()
                raise
            t_held = time.monotonic()
            pending = [ex.submit(stream, port, model, p, LONG, None, 90, s, conn=c)
                       for p, s, c in zip(STREAMS, live, conns)]
            # every stream running (a first chunk each, or an end: then the assertion
            # below says it came too late), LONG - 1 tokens of work left
            wait_until(lambda: all(s.chunks or s.done or s.error for s in live), 60,
                       "every stream has its first chunk", every=0.002)
            ended = [s.local_port for s in live if s.done or s.error]
            at_first = [s.chunks for s in live]
            t_first = time.monotonic()
            os.kill(targets[0].pid, signal.SIGKILL)
            t0 = time.monotonic()
            at_kill = [s.chunks for s in live]
            try:
                rc = proc.wait(timeout=KILLED_EXIT_BOUND_S)
            except Exception:
                report = tree_report(proc.pid, tree)
                # the parent's threads' Python stacks into the log (PYTHONFAULTHANDLER),
                # no core file
                with contextlib.suppress(psutil.Error):
                    psutil.Process(proc.pid).rlimit(psutil.RLIMIT_CORE, (0, 0))
                os.kill(proc.pid, signal.SIGABRT)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(10)
                log = serving._tail(os.path.join(tmp, "server.log"), 8000)
                # what the parent no longer stops: the streams end now, not at their timeout
                serving._stop(proc)
                sweep_shm({proc.pid, *(p.pid for p in tree)})
                pytest.fail(f"the {transport} server still runs {KILLED_EXIT_BOUND_S:g} s after {name}'s kill; "
                            f"its processes:\n{report}\nits log's end:\n{log}")
            exited = time.monotonic() - t0
            seen = [f.result(timeout=60) for f in pending]
        _, alive = psutil.wait_procs(tree, timeout=ALL_GONE_BOUND_S)
        print(f"\n{transport} {kill_layout}: connections held {t_held - t_sent:.2f} s after the requests' "
              f"send, first chunks read {t_first - t_held:.2f} s later (chunks then {at_first}); "
              f"{name} killed; parent exit {rc} after {exited:.1f} s; chunks read at the kill {at_kill}; "
              f"streams (API server, chunks, [DONE], finish, error): "
              f"{[(pids.get(held.get(s.local_port)), s.chunks, s.done, s.finish, (s.error or '')[:50]) for s in seen]}")
        assert rc == KILLED_EXIT_CODE
        assert [(p.pid, title(p)) for p in alive] == []
        assert ended == []  # the kill came while every stream ran
        if victim == "engine core":  # DP1's streams are lost
            lost = [s for s, r in zip(seen, ranks) if r == 1]
            assert lost and [s for s in lost if s.complete] == []
        else:
            lost = [s for s in seen if held.get(s.local_port) == targets[0].pid]
            assert lost and [s for s in lost if s.complete] == []
        with pytest.raises(OSError):  # nothing listens any more
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
        # before _stop sweeps what is named after dead processes: nothing of the plug-in's
        assert _ours(set(os.listdir("/dev/shm")) - shm_before, {proc.pid, *(p.pid for p in tree)}) == []
        assert sorted(n for n in os.listdir(tmp) if not n.startswith(VLLM_TMP_LEFTOVERS)) == []
    finally:
        if proc is not None:
            serving._stop(proc)
        shutil.rmtree(tmp, ignore_errors=True)
        sweep_orphaned_vllm_segments(shm_before)  # vLLM's own, left by the processes it lost


#: The output rings of the stopped-API-server test: a few hundred output batches fill one.
SMALL_RING_BYTES = 64 << 10
#: Chunks the running API server's streams must gain while the other is stopped: every
#: step sends the stopped server a batch (~100 bytes or more) of its own streams'
#: tokens, so its 64 KiB ring was full long before.
STOPPED_PROGRESS = 1500
STOPPED_TOKENS = 4000
#: Most streams the test opens (in fours) until both API servers hold some.
STOPPED_MAX_STREAMS = 24


def test_a_stopped_api_server_holds_back_neither_the_engine_nor_the_other(model, _resource_tracker, monkeypatch):
    """Two API servers, one engine core, output rings of 64 KiB (the plug-in): streams run
    on both API servers; one is stopped (SIGSTOP, alive but reading nothing) while its
    streams run, and its ring fills. The other's streams go on for thousands of tokens
    (the engine queues the stopped server's batches, as vLLM's sockets do; it waited for
    room before), and once the stopped server goes on (SIGCONT) its streams end complete,
    with the same text as the others' (one prompt for all): nothing it was sent while
    stopped is lost or out of order."""
    monkeypatch.setenv("SHMCLIENT_VLLM_RING_BYTES", str(SMALL_RING_BYTES))
    tmp = tempfile.mkdtemp(prefix="shmc-serve-stop-api2-")
    shm_before = set(os.listdir("/dev/shm"))
    proc = stopped = None
    prompt = STREAMS[0]
    try:
        proc, port = start(model, "plugin", "api2", tmp)
        pids = api_servers(proc)
        live: list[Stream] = []
        conns: list = []
        held: dict = {}
        with concurrent.futures.ThreadPoolExecutor(STOPPED_MAX_STREAMS) as ex:
            pending = []
            try:
                # streams in fours until both API servers hold some (the kernel hands a
                # connection to whichever accepts first)
                while (len(conns) < STOPPED_MAX_STREAMS
                       and len(set(held.get(c.sock.getsockname()[1]) for c in conns)) < 2):
                    batch = [send(port, model, prompt, STOPPED_TOKENS, timeout=300) for _ in range(4)]
                    conns += batch
                    ports = [c.sock.getsockname()[1] for c in conns]
                    held = wait_until(lambda: (h := connections(pids, port)) and set(ports) <= set(h) and h, 60,
                                      "every stream's connection accepted by an API server", every=0.01)
                    for c in batch:
                        live.append(Stream())
                        pending.append(ex.submit(stream, port, model, prompt, STOPPED_TOKENS, None, 300, live[-1],
                                                 conn=c))
            except BaseException:
                for c in conns:
                    c.close()
                raise
            by_server = [held[c.sock.getsockname()[1]] for c in conns]
            assert len(set(by_server)) == 2, "one API server took every stream"
            victim = by_server[0]
            others = [s for s, pid in zip(live, by_server) if pid != victim]
            wait_until(lambda: all(s.chunks or s.done or s.error for s in live), 60,
                       "every stream has its first chunk", every=0.002)
            sigstop(victim)
            stopped = victim
            before = sum(s.chunks for s in others)
            try:
                wait_until(lambda: sum(s.chunks for s in others) - before >= STOPPED_PROGRESS
                           or any(s.done or s.error for s in others), 180,
                           "the running API server's streams go on while the other is stopped")
                assert not any(s.error for s in others), [s.error for s in others]
            finally:
                os.kill(victim, signal.SIGCONT)
                stopped = None
            seen = [f.result(timeout=300) for f in pending]
        assert [s for s in seen if not s.complete] == []
        texts = {s.text for s in seen}
        assert len(texts) == 1 and texts != {""}, [len(s.text) for s in seen]
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        if proc is not None:
            serving._stop(proc)
        shutil.rmtree(tmp, ignore_errors=True)
        sweep_orphaned_vllm_segments(shm_before)


# -- the shared servers' tests ----------------------------------------------------------------

def test_logs_name_the_transport_of_every_api_server(stock, plugin):
    for server in (stock, plugin):
        assert sorted(api_servers(server.proc).values()) == list(range(API_SERVERS))
    assert "shmclient.vllm" not in stock.log
    assert [line for line in lines_of(plugin.layout) if line not in plugin.log] == []
    assert "vLLM's own ZMQ transport is used" not in plugin.log


def memfds_held(pid: int) -> list[str]:
    """The project's memfds (rings, arenas, parked pages) process ``pid`` holds an fd of."""
    out = []
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("/memfd:shmc"):
                    out.append(link)
    return out


def test_no_process_holds_a_ring_once_every_side_attached(plugin):
    """The launcher releases its handles once every engine and API server attached (the
    server has served by now in the shared tests that ran before: the tests' order);
    the engines close what they inherited, and vLLM's DP coordinator, started inside
    the launch, holds none (forked, as on a GPU host, it drops what it inherited at its
    start: tests/test_vllm_dp.py; vLLM's CPU platform spawns it): then no process of
    the server holds an fd of a ring, an arena or a parked page (each is kept by the
    mappings of its two sides only)."""
    procs = psutil.Process(plugin.proc.pid).children(recursive=True)
    if plugin.layout == "dp2":
        assert any(title(p) == "VLLM::DPCoordinator" for p in procs), [title(p) for p in procs]
    wait_until(lambda: not memfds_held(plugin.proc.pid), 30, "the launcher released its handles")
    assert {title(p): memfds_held(p.pid) for p in procs} == {title(p): [] for p in procs}


def test_completions_identical(stock, plugin, model):
    want = [completion(stock.port, model, p, 12) for p in PROMPTS]
    got = [completion(plugin.port, model, p, 12) for p in PROMPTS]
    assert got == want
    assert all(usage["completion_tokens"] == 12 for _, usage in got)


def test_streamed_text_identical_to_the_completion(stock, plugin, model):
    for prompt in PROMPTS[:3]:
        want = completion(stock.port, model, prompt, 16)[0]
        for server in (stock, plugin):
            s = stream(server.port, model, prompt, 16)
            assert s.complete, s
            assert s.text == want


def test_sixteen_concurrent_streams_identical_on_every_api_server(stock, plugin, model):
    """Bursts of 16 streams at once to each server, the plug-in's texts stock's, until
    each API server has served some: the kernel hands a connection to whichever API
    server accepts first, and one may take a whole burst."""
    served = {"stock": set(), "plugin": set()}
    for burst in range(MAX_BURSTS):
        got = {}
        for server in (stock, plugin):
            pids = api_servers(server.proc)
            with concurrent.futures.ThreadPoolExecutor(len(STREAMS)) as ex:
                got[server.transport] = list(ex.map(lambda p: stream(server.port, model, p, 24, pids), STREAMS))
            assert [s for s in got[server.transport] if not s.complete] == []
            served[server.transport] |= {pids[s.api_server] for s in got[server.transport] if s.api_server}
        assert [s.text for s in got["plugin"]] == [s.text for s in got["stock"]]
        assert all(s.text for s in got["stock"])
        if all(ranks >= set(range(API_SERVERS)) for ranks in served.values()):
            break
    assert served == {"stock": set(range(API_SERVERS)), "plugin": set(range(API_SERVERS))}, burst


def test_a_disconnected_stream_is_aborted(stock, plugin, model):
    """A streaming client goes away after its first chunk: its API server aborts the
    request on the engine (``check_abort``), and the server answers as stock afterwards.
    Stock first: the check itself is checked there."""
    for server in (stock, plugin):
        check_abort(server.port, model, server.transport)
    assert completion(plugin.port, model, PROMPTS[0], 6) == completion(stock.port, model, PROMPTS[0], 6)


def check_abort(port: int, model: str, what: str) -> None:
    """Start a ``LONG`` stream, take its first chunk and go away: vLLM's running-requests
    gauge goes back to 0 and its generated-tokens count stops short of ``LONG`` (with
    ignore_eos only an abort stops it early)."""
    assert wait_until(lambda: running(port) in (None, 0.0), 30, "no request running before")
    before = generated(port)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(
        {"model": model, "prompt": "abort me", "max_tokens": LONG, "temperature": 0, "ignore_eos": True,
         "stream": True}), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    for line in resp:
        if line.startswith(b"data: "):
            break  # the first chunk is there: the request runs on an engine
    conn.close()  # the client goes away
    wait_until(lambda: running(port) == 0.0, 30, f"{what}: the abandoned request is aborted")
    counts = [generated(port)]
    while len(counts) < 3 or counts[-1] != counts[-2]:  # the count settles
        assert len(counts) < 50, counts
        time.sleep(0.2)
        counts.append(generated(port))
    assert 0 < counts[-1] - before < LONG, (what, before, counts)