"""vLLM data parallelism across nodes: the head node's API server talks to its own engine
core over the rings and to an engine of another node over vLLM's ZMQ sockets, and
answers as stock vLLM does.

The other node is simulated on this host: ``vllm serve --headless`` for DP rank 1,
reached over tcp on the loopback address, as a second machine would be. Run with
``python -m pytest -m vllm``; skipped when vLLM is not importable. Each transport's pair
of processes (~1.5 min to start here) is shared by the module.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import socket
import tempfile

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

from .conftest import importorskip_vllm  # noqa: E402
importorskip_vllm()  # an error, not a skip, under SHMCLIENT_REQUIRE_VLLM=1

from shmclient_bench import serving  # noqa: E402

from .test_tensors import _resource_tracker  # noqa: E402,F401 - started once, before the servers
from .test_vllm_serve import completion, streamed  # noqa: E402
from .test_vllm_serve_multi import generated, metric, model  # noqa: E402,F401 - model: the model folder fixture

PROMPTS = [f"def f{i}(x):\n    return" for i in range(6)]
STREAMS = [f"import os\nclass C{i}:" for i in range(16)]
#: The head's log line: engine 0 on the rings, engine 1 (the other node's) on ZMQ.
SPLIT_LINE = ("shmclient.vllm: DPLBAsyncMPClient (2 engines, engine 0 on the rings, engine 1 on another "
              "node on vLLM's ZMQ sockets) moves engine-core requests and outputs over shared-memory rings")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dp_flags(rpc_port: int) -> list[str]:
    return ["--data-parallel-size", "2", "--data-parallel-size-local", "1", "--data-parallel-address", "127.0.0.1",
            "--data-parallel-rpc-port", str(rpc_port), "--gpu-memory-utilization", "0.08"]


def start_other_node(model: str, transport: str, rpc_port: int, tmp: str):
    """DP rank 1 as another node runs it: ``vllm serve --headless`` (no API server),
    stock vLLM's engine either way: it is handed no channel."""
    os.makedirs(os.path.join(tmp, "rpc"), 0o700, exist_ok=True)
    root = os.path.dirname(os.path.dirname(os.path.abspath(serving.__file__)))
    env = dict(os.environ, TMPDIR=tmp, VLLM_RPC_BASE_PATH=os.path.join(tmp, "rpc"),
               PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    env.pop("SHMCLIENT_VLLM", None)
    if transport == "plugin":
        env["SHMCLIENT_VLLM"] = "1"  # switched on there too: nothing to carry, nothing changes
    cmd = [a.replace("MODEL", model) for a in serving.LAUNCHERS["serve"]]
    base = [f for f in serving.SERVER_FLAGS if f != "--disable-log-stats"]
    return serving._spawn([serving.sys.executable, *cmd, "--headless", "--data-parallel-start-rank", "1",
                           *base, *dp_flags(rpc_port)], env, os.path.join(tmp, "other-node.log"))


@pytest.fixture(scope="module")
def servers(model, _resource_tracker):
    """{"stock": port, "plugin": port}: a head node (one API server, engine 0) and a
    headless node (engine 1) each."""
    tmp = tempfile.mkdtemp(prefix="shmc-serve-remote-")
    procs, ports = [], {}
    try:
        for transport in ("stock", "plugin"):
            rpc_port = _free_port()
            where = os.path.join(tmp, transport)
            os.makedirs(where)
            procs.append(start_other_node(model, transport, rpc_port, where))
            proc, port = serving.start_server(model, transport, where, os.path.join(where, "head.log"),
                                              [*dp_flags(rpc_port), "--api-server-count", "1"], SPLIT_LINE,
                                              launcher="serve", log_stats=True)
            procs.append(proc)
            ports[transport] = port
        yield ports
    finally:
        for proc in reversed(procs):  # each head before its other node
            serving._stop(proc)
        shutil.rmtree(tmp, ignore_errors=True)


def per_engine(port: int, name: str) -> dict[str, float]:
    """vLLM's counter ``name`` per engine label."""
    import urllib.request

    out: dict[str, float] = {}
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + "{") and 'engine="' in line:
                engine = line.split('engine="', 1)[1].split('"', 1)[0]
                out[engine] = out.get(engine, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def test_completions_identical_to_stock(servers, model):
    want = [completion(servers["stock"], model, p, 12) for p in PROMPTS]
    got = [completion(servers["plugin"], model, p, 12) for p in PROMPTS]
    assert got == want
    assert all(usage["completion_tokens"] == 12 for _, usage in got)


def test_sixteen_streams_identical_and_both_nodes_serve(servers, model):
    """16 concurrent streams: the same text as stock, and the load balancer sent some to
    the engine on the rings and some to the one on ZMQ (vLLM's per-engine token counts
    both grew)."""
    before = {t: per_engine(port, "vllm:generation_tokens_total") for t, port in servers.items()}
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        want = list(pool.map(lambda p: streamed(servers["stock"], model, p, 40), STREAMS))
        got = list(pool.map(lambda p: streamed(servers["plugin"], model, p, 40), STREAMS))
    assert got == want
    assert all(got)
    for transport, port in servers.items():
        after = per_engine(port, "vllm:generation_tokens_total")
        grew = {e for e in after if after[e] > before[transport].get(e, 0.0)}
        assert grew == {"0", "1"}, (transport, before[transport], after)
    assert generated(servers["plugin"]) > 0 and metric(servers["plugin"], "vllm:num_requests_running") == 0.0
