"""``shmclient_bench.vllm_served_hop``: the API servers' hook (on a stand-in for vLLM's
``AsyncLLM``), reading the records, the figures and the table, and (with vLLM) a run
against two servers that leaves nothing behind."""

from __future__ import annotations

import glob
import http.server
import json
import os
import select
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest

from shmclient_bench import cpu_time, serving_servers
from shmclient_bench import vllm_served_hop as hop

#: A stand-in for vllm.v1.engine.async_llm: AsyncLLM whose engine-core client returns
#: three batches stamped 250, 500 and 750 µs ago, the second without outputs.
FAKE_VLLM = textwrap.dedent("""
    import asyncio, os, sys, time, types

    for name in ("vllm", "vllm.v1", "vllm.v1.engine", "vllm.v1.engine.async_llm"):
        sys.modules[name] = types.ModuleType(name)

    class Outputs:
        def __init__(self, n, ago):
            self.outputs = [object()] * n
            self.timestamp = time.monotonic() - ago

    class Client:
        def __init__(self):
            self.left = [(2, 250e-6), (0, 500e-6), (5, 750e-6)]

        async def get_output_async(self):
            n, ago = self.left.pop(0)
            return Outputs(n, ago)

    class AsyncLLM:
        def __init__(self):
            self.engine_core = Client()

    sys.modules["vllm.v1.engine.async_llm"].AsyncLLM = AsyncLLM
    import shmclient_bench.vllm_served_hop
    engine = AsyncLLM()

    async def main():
        return [len((await engine.engine_core.get_output_async()).outputs) for _ in range(3)]

    print(asyncio.run(main()))
""")


def _run_fake(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", FAKE_VLLM], env=env, capture_output=True, text=True, timeout=60)


def test_the_hook_records_each_batch_with_outputs_and_only_with_the_folder_named(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != hop.HOP_ENV}
    plain = _run_fake(env)
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.split("\n")[0] == "[2, 0, 5]"  # batches pass through unchanged
    assert os.listdir(tmp_path) == []
    hooked = _run_fake({**env, hop.HOP_ENV: str(tmp_path)})
    assert hooked.returncode == 0, hooked.stderr
    assert hooked.stdout.split("\n")[0] == "[2, 0, 5]"
    files = os.listdir(tmp_path)
    assert len(files) == 1 and files[0].startswith("hops-"), files
    data = (tmp_path / files[0]).read_bytes()
    records = list(hop.RECORD.iter_unpack(data))
    assert [n for _, n, _ in records] == [2, 5]  # the empty batch is left out
    # the hop is the return's time after the stamp: at least how long ago it was stamped
    assert 250e-6 <= records[0][0] < 250e-6 + 0.5 and 750e-6 <= records[1][0] < 750e-6 + 0.5
    # the run-queue wait, where the kernel keeps it: known, and within the call
    if os.path.exists("/proc/thread-self/schedstat"):
        assert all(0 <= w < 0.5e9 for _, _, w in records), records
    else:
        assert all(w == -1 for _, _, w in records), records


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"), reason="the kernel keeps no schedstat")
def test_the_run_queue_wait_is_the_time_a_thread_sharing_its_cpu_did_not_run():
    stats: dict[int, int] = {}
    cpu = min(os.sched_getaffinity(0))
    mine = os.sched_getaffinity(0)
    # Two busy processes on the same CPU: this thread runs about a third of the time.
    busy = [subprocess.Popen([sys.executable, "-c", "import os, sys, time\n"
                              f"os.sched_setaffinity(0, {{{cpu}}})\n"
                              "print('pinned', flush=True)\n"
                              "end = time.monotonic() + 30\nwhile time.monotonic() < end: pass"],
                             stdout=subprocess.PIPE)
            for _ in range(2)]
    try:
        for p in busy:  # both spin on the CPU before the measurement starts
            ready, _, _ = select.select([p.stdout], [], [], 30)
            assert ready and p.stdout.readline() == b"pinned\n"
        os.sched_setaffinity(0, {cpu})
        _spin(0.05)
        before, cpu0, wall0 = cpu_time.run_queue_ns(stats), time.thread_time(), time.monotonic()
        _spin(0.45)
        waited = (cpu_time.run_queue_ns(stats) - before) / 1e9
        ran, wall = time.thread_time() - cpu0, time.monotonic() - wall0
    finally:
        os.sched_setaffinity(0, mine)
        for p in busy:
            p.kill()
            p.wait(10)
            p.stdout.close()
        for fd in stats.values():
            if fd >= 0:
                os.close(fd)
    # A spinning thread is either on its CPU or waiting for it: the wait is the wall time
    # it did not run (not its CPU time, ~0.15 s of the 0.45, not zero). On a VM the time
    # the host took the vCPU away (steal) is neither: up to 0.1 s of the 0.45 is allowed.
    assert waited > 0.1, (waited, ran, wall)
    assert abs(wall - ran - waited) < 0.1, (waited, ran, wall)


def test_the_run_queue_wait_is_unknown_without_schedstat(monkeypatch):
    def refuse(path, *args):
        raise FileNotFoundError(path)

    monkeypatch.setattr(cpu_time.os, "open", refuse)
    assert cpu_time.run_queue_ns({}) == -1


def test_records_are_read_after_the_offsets_a_partial_one_left_for_later(tmp_path):
    a, b = tmp_path / "hops-1.bin", tmp_path / "hops-2.bin"
    a.write_bytes(hop.RECORD.pack(1e-4, 1, 20_000) + hop.RECORD.pack(2e-4, 3, -1))
    b.write_bytes(hop.RECORD.pack(3e-4, 1, 0) + hop.RECORD.pack(4e-4, 1, 7)[:5])  # a write under way
    (tmp_path / "other.bin").write_bytes(b"x" * 12)
    hops, sizes = hop.read_records(str(tmp_path))
    assert hops == [(1e-4, 2e-5), (2e-4, None), (3e-4, 0.0)]
    assert sizes == {str(a): 2 * hop.RECORD.size, str(b): hop.RECORD.size}
    with open(b, "ab") as f:  # the rest of the record, and one more in a
        f.write(hop.RECORD.pack(4e-4, 1, 7)[5:])
    with open(a, "ab") as f:
        f.write(hop.RECORD.pack(5e-4, 2, 1000))
    hops, sizes = hop.read_records(str(tmp_path), sizes)
    assert hops == [(5e-4, 1e-6), (4e-4, 7e-9)]
    assert sizes == {str(a): 3 * hop.RECORD.size, str(b): 2 * hop.RECORD.size}
    assert hop.read_records(str(tmp_path), sizes)[0] == []


def test_summaries_ratios_and_the_table():
    s = hop.summarise([(i * 1e-6, (100 - i) * 1e-7) for i in range(1, 101)])  # 1..100 µs, waits 9.9..0
    assert s["batches"] == 100  # (percentiles interpolated, as every section's)
    assert (s["p50"], s["p90"], s["p99"]) == pytest.approx((50.5, 90.1, 99.01))
    assert (s["wait_p50"], s["wait_p90"]) == pytest.approx((4.95, 8.91))
    assert hop.summarise([]) == {"batches": 0, "p50": None, "p90": None, "p99": None,
                                 "wait_p50": None, "wait_p90": None}
    # one batch without a known wait: no wait figures (they would be of some batches only)
    partial = hop.summarise([(1e-4, 1e-5), (2e-4, None)])
    assert partial["p50"] == pytest.approx(150) and partial["wait_p50"] is None

    def pair(stock, plugin):
        return {"stock": {"1 stream": hop.summarise([(stock * 1e-6, 30e-6)]), "8 streams": hop.summarise([])},
                "plugin": {"1 stream": hop.summarise([(plugin * 1e-6, None)]), "8 streams": hop.summarise([])}}

    pairs = [pair(200, 100), pair(300, 60), pair(250, 100)]
    assert [round(r, 2) for r in hop.pair_ratios(pairs, "1 stream")] == [0.5, 0.2, 0.4]
    assert hop.pair_ratios(pairs, "8 streams") == []  # no batches: no ratio
    table = hop.format_table(pairs)
    assert "| 2 | plugin | 1 stream | 1 | 60 / 60 / 60 | - |" in table
    assert "| 2 | stock | 1 stream | 1 | 300 / 300 / 300 | 30 / 30 |" in table
    assert "| 1 | stock | 8 streams | 0 | - | - |" in table
    assert "plug-in / stock, hop p50, 1 stream: median 0.40x over 3 pairs (0.20, 0.40, 0.50)" in table
    assert "8 streams: median" not in table


def test_the_median_of_an_even_number_of_pairs_is_the_mean_of_the_middle_two():
    def pair(stock, plugin):
        return {"stock": {"1 stream": hop.summarise([(stock * 1e-6, None)])},
                "plugin": {"1 stream": hop.summarise([(plugin * 1e-6, None)])}}

    table = hop.format_table([pair(200, 100), pair(200, 60)])  # --pairs 2, the default
    assert "1 stream: median 0.40x over 2 pairs (0.30, 0.50)" in table


def test_the_servers_are_started_as_vllm_serve_through_this_module():
    cmd = serving_servers.LAUNCHERS["serve_hop"]
    assert cmd[:4] == ["-m", "shmclient_bench.vllm_served_hop", hop.SERVE_ARG, "serve"]
    flags = ["--api-server-count", "2"]
    assert serving_servers.api_server_count(flags, "serve_hop") == 2
    assert serving_servers.api_server_count(flags, "api_server") == 1


class _SSE(http.server.BaseHTTPRequestHandler):
    """Answers a completion with the events the test puts in ``server.events`` (or an
    HTTP 400 for the prompt "bad")."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body["prompt"] == "bad":
            self.send_response(400)
            self.send_header("Content-Length", "3")
            self.end_headers()
            self.wfile.write(b"no!")
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for event in self.server.events:
            self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args):
        pass


def test_a_stream_is_judged_by_its_finish_reason_and_errors_raise():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SSE)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever)
    thread.start()
    try:
        port = server.server_address[1]
        # tokens merged into two chunks by a lagging API server: still the whole stream
        server.events = [{"choices": [{"text": "ab", "finish_reason": None}]},
                         {"choices": [{"text": "cd", "finish_reason": "length"}]}]
        assert hop._stream(port, "m", "p") == "length"
        server.events = [{"choices": [{"text": "ab", "finish_reason": "abort"}]}]
        assert hop._stream(port, "m", "p") == "abort"
        server.events = [{"choices": [{"text": "ab", "finish_reason": None}]}, {"error": {"message": "boom"}}]
        with pytest.raises(RuntimeError, match="error event.*boom"):
            hop._stream(port, "m", "p")
        with pytest.raises(RuntimeError, match="HTTP 400"):
            hop._stream(port, "m", "bad")
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_bad_arguments_are_refused():
    run = subprocess.run([sys.executable, "-m", "shmclient_bench.vllm_served_hop", "--pairs", "0"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--pairs" in run.stderr


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_a_run_against_two_api_servers_has_every_figure_and_leaves_no_files(tmp_path):
    from .conftest import importorskip_vllm
    importorskip_vllm()  # an error, not a skip, under SHMCLIENT_REQUIRE_VLLM=1
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "shmc-served-hop-*")))
    out = tmp_path / "hop.json"
    run = subprocess.run([sys.executable, "-m", "shmclient_bench.vllm_served_hop", "--api-servers", "2",
                          "--pairs", "1", "--rounds", "1", "--json", str(out)],
                         capture_output=True, text=True, timeout=840)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["api_servers"] == 2 and len(got["pairs"]) == 1
    for transport in hop.TRANSPORTS:
        loads = got["pairs"][0][transport]
        # 64 tokens a stream: at least one batch a token after the first
        assert loads["1 stream"]["batches"] >= hop.TOKENS - 1, (transport, loads)
        assert loads[f"{hop.STREAMS} streams"]["batches"] >= hop.TOKENS - 1, (transport, loads)
        assert 0 < loads["1 stream"]["p50"] < 1e6, (transport, loads)
        if os.path.exists("/proc/thread-self/schedstat"):
            assert all(0 <= s["wait_p50"] <= s["wait_p90"] for s in loads.values()), (transport, loads)
    assert "plug-in / stock, hop p50, 1 stream: median" in run.stdout
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "shmc-served-hop-*"))) == before
