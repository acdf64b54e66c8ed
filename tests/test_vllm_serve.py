"""vLLM's OpenAI server (what ``vllm serve`` runs) with data parallelism over the rings:
two engine cores behind one API server, stock and with the plug-in, answer the same.

Run with ``python -m pytest -m vllm``; skipped when vLLM is not importable. The stock
and the plug-in server (~1 min each to start here) are shared by the module; the kill
test starts its own. Servers run with vLLM's stats on: the abort test reads its gauges.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import shutil
import signal
import tempfile
import threading
import time
import urllib.request

import psutil
import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

from .conftest import importorskip_vllm  # noqa: E402
importorskip_vllm()  # an error, not a skip, under SHMCLIENT_REQUIRE_VLLM=1

from shmclient_bench import serving  # noqa: E402

from .conftest import sweep_orphaned_vllm_segments  # noqa: E402
from .test_tensors import _resource_tracker  # noqa: E402,F401 - started once, before the servers
from .test_vllm_serve_multi import LONG_FLAGS, check_abort, model  # noqa: E402,F401 - model: the model folder fixture

DP_FLAGS = ["--data-parallel-size", "2", "--api-server-count", "1", "--gpu-memory-utilization", "0.08"]
DP_LINE = "shmclient.vllm: DPLBAsyncMPClient (2 engines) moves engine-core requests and outputs"
PROMPTS = [f"def f{i}(x):\n    return" for i in range(8)]
STREAMS = [f"import os\nclass C{i}:" for i in range(16)]


@pytest.fixture(scope="module")
def servers(model, _resource_tracker):
    """{"stock": port, "plugin": port}: one server each, two engine cores each."""
    tmp = tempfile.mkdtemp(prefix="shmc-serve-")
    procs, ports = [], {}
    try:
        for transport in ("stock", "plugin"):
            proc, port = serving.start_server(model, transport, tmp, os.path.join(tmp, f"{transport}.log"),
                                              [*DP_FLAGS, *LONG_FLAGS], DP_LINE, log_stats=True)
            procs.append(proc)
            ports[transport] = port
        yield ports
    finally:
        for proc in procs:
            serving._stop(proc)
        shutil.rmtree(tmp, ignore_errors=True)


def post(port: int, body: dict, timeout: float = 60.0) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def completion(port: int, model: str, prompt: str, n: int) -> tuple[str, dict]:
    out = post(port, {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True})
    return out["choices"][0]["text"], out["usage"]


def streamed(port: int, model: str, prompt: str, n: int, started: "threading.Event | None" = None) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", json.dumps(
            {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
             "stream": True}), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        text = []
        for line in resp:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            if started is not None:
                started.set()
            text.append(json.loads(line[6:])["choices"][0]["text"])
        return "".join(text)
    finally:
        conn.close()


def test_dp_server_completions_identical(servers, model):
    want = [completion(servers["stock"], model, p, 12) for p in PROMPTS]
    got = [completion(servers["plugin"], model, p, 12) for p in PROMPTS]
    assert got == want
    assert all(usage["completion_tokens"] == 12 for _, usage in got)


def test_dp_server_sixteen_concurrent_streams_identical(servers, model):
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        want = list(pool.map(lambda p: streamed(servers["stock"], model, p, 20), STREAMS))
        got = list(pool.map(lambda p: streamed(servers["plugin"], model, p, 20), STREAMS))
    assert got == want
    assert all(got)


def test_dp_server_aborts_a_request_whose_client_went_away(servers, model):
    """A streaming client goes away after its first chunk: the API server aborts the
    request on the engine that runs it (``check_abort``). Stock first: the check itself is
    checked there."""
    for transport in ("stock", "plugin"):
        check_abort(servers[transport], model, transport)
    assert completion(servers["plugin"], model, PROMPTS[0], 6) == completion(servers["stock"], model, PROMPTS[0], 6)


def test_dp_server_exits_when_an_engine_is_killed(model, _resource_tracker):
    tmp = tempfile.mkdtemp(prefix="shmc-serve-kill-")
    shm_before = set(os.listdir("/dev/shm"))
    proc, port = serving.start_server(model, "plugin", tmp, os.path.join(tmp, "plugin.log"), DP_FLAGS, DP_LINE)
    try:
        engines = [p for p in psutil.Process(proc.pid).children(recursive=True)
                   if "EngineCore_DP1" in " ".join(p.cmdline()) or p.name().endswith("EngineCore_DP1")]
        assert len(engines) == 1, [(p.pid, p.name(), p.cmdline()) for p in psutil.Process(proc.pid).children(True)]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            started = threading.Event()
            pending = [pool.submit(streamed, port, model, p, 300, started) for p in STREAMS[:4]]
            assert started.wait(60)  # tokens are streaming
            os.kill(engines[0].pid, signal.SIGKILL)
            t0 = time.monotonic()
            proc.wait(timeout=60)  # vLLM's server shuts down on EngineDeadError
            took = time.monotonic() - t0
            for f in pending:
                try:
                    f.result(timeout=60)
                except Exception:  # noqa: BLE001 - a broken stream is the expected outcome
                    pass
        assert took < 30, took
        assert sorted(n for n in set(os.listdir("/dev/shm")) - shm_before if n.startswith("shmc")) == []
    finally:
        serving._stop(proc)
        shutil.rmtree(tmp, ignore_errors=True)
        sweep_orphaned_vllm_segments(shm_before)  # vLLM's own, left by the engine it lost
