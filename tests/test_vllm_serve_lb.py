"""vLLM data parallelism with a load balancer per node: hybrid load balancing (an API
server per node over that node's engine cores). Each API server talks to the engine cores
of its own node only, so with the plug-in all of them go over the rings, and the answers
are stock vLLM's.

Two nodes are simulated on this host, each a ``vllm serve`` with two API servers and two
DP ranks (vLLM's default there), joined over tcp on the loopback address as two machines
would be. Run with
``python -m pytest -m vllm``; skipped when vLLM is not importable. Stock's servers run
first, then the plug-in's (~1.5 min each here).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import shutil
import tempfile
import time
import urllib.request

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

from .conftest import importorskip_vllm  # noqa: E402
importorskip_vllm()  # an error, not a skip, under SHMCLIENT_REQUIRE_VLLM=1

from shmclient_bench import serving  # noqa: E402

from .conftest import sweep_orphaned_vllm_segments  # noqa: E402
from .test_tensors import _resource_tracker  # noqa: E402,F401 - started once, before the servers
from .test_vllm_serve import completion, streamed  # noqa: E402
from .test_vllm_serve_multi import model  # noqa: E402,F401 - the model folder fixture
from .test_vllm_serve_remote import _free_port, per_engine  # noqa: E402

PROMPTS = [f"def g{i}(y):\n    return" for i in range(4)]
STREAMS = [f"import sys\nclass D{i}:" for i in range(8)]

#: Per mode: the DP size, each node's flags (beside the shared ones) and the plug-in's line
#: each node's API server logs (``{ranks}``: that node's).
MODES = {
    # two nodes of two engine cores each (vLLM runs one local rank as external LB)
    "hybrid": (4, [["--data-parallel-size-local", "2", "--data-parallel-hybrid-lb", "--data-parallel-start-rank", "0"],
                   ["--data-parallel-size-local", "2", "--data-parallel-hybrid-lb", "--data-parallel-start-rank", "2"]],
               "shmclient.vllm: DPLBAsyncMPClient (4 engines, hybrid load balancing: engines {ranks} of this node "
               "on the rings, API server {index} of 2) moves engine-core requests and outputs over shared-memory "
               "rings"),
}
#: API servers a node (vLLM's default with hybrid load balancing: one per local engine).
API_SERVERS = 2
#: Which engines (vLLM's per-engine label) each node has, per mode.
ENGINES = {"hybrid": [["0", "1"], ["2", "3"]]}


def _shared_flags(dp: int, rpc_port: int) -> list[str]:
    return ["--data-parallel-size", str(dp), "--data-parallel-address", "127.0.0.1",
            "--data-parallel-rpc-port", str(rpc_port), "--gpu-memory-utilization", "0.08",
            "--api-server-count", str(API_SERVERS)]


def _healthy(port: int, proc, log: str, deadline: float) -> None:
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"a node exited ({proc.returncode}):\n{serving._tail(log)}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        if time.monotonic() > deadline:
            raise RuntimeError(f"a node was not up within {serving.HEALTH_TIMEOUT_S} s:\n{serving._tail(log)}")
        time.sleep(0.5)  # polling a server's health endpoint


class Nodes:
    """Two nodes of one transport and mode: the second node's ``vllm serve`` started by
    hand (its engines wait for the first node's coordinator), the first's by the
    benchmark's ``start_server``; each logs the plug-in's line for its own ranks."""

    def __init__(self, model: str, transport: str, mode: str) -> None:
        self.tmp = tempfile.mkdtemp(prefix=f"shmc-{mode[0]}{transport[0]}-")
        self.shm_before = set(os.listdir("/dev/shm"))
        self.procs: list = []
        dp, (first, second), line = MODES[mode]
        rpc_port = _free_port()
        local = dp // 2
        try:
            other = os.path.join(self.tmp, "n1")
            os.makedirs(os.path.join(other, "rpc"), 0o700)
            self.other_port = _free_port()
            env = dict(os.environ, TMPDIR=other, VLLM_RPC_BASE_PATH=os.path.join(other, "rpc"))
            env.pop("SHMCLIENT_VLLM", None)
            if transport == "plugin":
                env["SHMCLIENT_VLLM"] = "1"
            cmd = [a.replace("MODEL", model) for a in serving.LAUNCHERS["serve"]]
            base = [f for f in serving.SERVER_FLAGS if f != "--disable-log-stats"]
            self.other_log = os.path.join(other, "server.log")
            other_proc = serving._spawn([serving.sys.executable, *cmd, "--port", str(self.other_port), *base,
                                         *_shared_flags(dp, rpc_port), *second], env, self.other_log)
            self.procs.append(other_proc)
            head = os.path.join(self.tmp, "n0")
            os.makedirs(head)
            ranks = ", ".join(map(str, range(local)))
            proc, self.port = serving.start_server(
                model, transport, head, os.path.join(head, "server.log"), [*_shared_flags(dp, rpc_port), *first],
                [line.format(ranks=ranks, index=i) for i in range(API_SERVERS)], launcher="serve", log_stats=True)
            self.procs.insert(0, proc)
            _healthy(self.other_port, other_proc, self.other_log, time.monotonic() + serving.HEALTH_TIMEOUT_S)
            ranks = ", ".join(map(str, range(local, dp)))
            deadline = time.monotonic() + serving.HEALTH_TIMEOUT_S
            while True:  # every API server of the second node up (one answers health first)
                with open(self.other_log, encoding="utf-8", errors="replace") as f:
                    other_text = f.read()
                if other_text.count(serving.READY_LINE) >= API_SERVERS:
                    break
                assert time.monotonic() < deadline and other_proc.poll() is None, serving._tail(self.other_log)
                time.sleep(0.5)  # polling the second node's log
            for i in range(API_SERVERS):
                want = line.format(ranks=ranks, index=i)
                assert (want in other_text) == (transport == "plugin"), serving._tail(self.other_log)
        except BaseException:
            self.close()
            raise

    @property
    def ports(self) -> list[int]:
        return [self.port, self.other_port]

    def close(self) -> None:
        for proc in self.procs:  # the coordinator's node first
            serving._stop(proc)
        shutil.rmtree(self.tmp, ignore_errors=True)
        sweep_orphaned_vllm_segments(self.shm_before)


def _answers(model: str, transport: str, mode: str) -> dict:
    """What each node answered: completions, then concurrent streams to both nodes, and
    which engines generated meanwhile (vLLM's per-engine token counters)."""
    nodes = Nodes(model, transport, mode)
    try:
        out: dict = {"completions": [[completion(port, model, p, 10) for p in PROMPTS] for port in nodes.ports]}
        before = [per_engine(port, "vllm:generation_tokens_total") for port in nodes.ports]
        jobs = [(node, p) for p in STREAMS for node in (0, 1)]
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
            out["streams"] = list(pool.map(lambda j: streamed(nodes.ports[j[0]], model, j[1], 24), jobs))
        after = [per_engine(port, "vllm:generation_tokens_total") for port in nodes.ports]
        out["generated"] = [sorted(e for e in a if a[e] > b.get(e, 0.0)) for a, b in zip(after, before)]
        return out
    except Exception as e:
        logs = "\n".join(serving._tail(os.path.join(nodes.tmp, n, "server.log")) for n in ("n0", "n1"))
        raise AssertionError(f"{transport}, {mode}: {e!r}; the nodes' logs:\n{logs}") from e
    finally:
        nodes.close()


@pytest.fixture(scope="module", params=list(MODES))
def answers(request, model, _resource_tracker):
    """{"stock": ..., "plugin": ..., "mode": ...} for one mode, one transport's servers at
    a time."""
    out = {transport: _answers(model, transport, request.param) for transport in ("stock", "plugin")}
    out["mode"] = request.param
    return out


def test_each_node_answers_as_stock(answers):
    """Completions to each node's API server: the same text as stock's same node."""
    assert answers["plugin"]["completions"] == answers["stock"]["completions"]
    assert all(usage["completion_tokens"] == 10 for node in answers["plugin"]["completions"] for _, usage in node)


def test_concurrent_streams_on_both_nodes_identical_and_every_engine_serves(answers):
    """Streams to both nodes at once: the same text as stock, and both engine cores of
    each node generated (its API server balanced over its own engines)."""
    assert answers["plugin"]["streams"] == answers["stock"]["streams"]
    assert all(answers["plugin"]["streams"])
    assert answers["plugin"]["generated"] == ENGINES[answers["mode"]]
