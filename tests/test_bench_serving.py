"""The bench's ``serving`` section: ratios, spread, verdicts and targets on made-up results
(no vLLM needed), stopping a server's process group (a stand-in group), and, with vLLM
(``-m vllm``), the model folder's tokenizer. No test starts a server: a pair of them
takes minutes."""

from __future__ import annotations

import json
import os
import sys
import tempfile

import msgspec
import pytest

from shmclient_bench import __main__ as bench_main
from shmclient_bench import sections, serving
from shmclient_bench.report import NOT_JUDGED
from shmclient_bench.section_results import Skipped
from shmclient_bench.serving_results import Pair, Params, RunFigures, ServingComparison, TokenizerFacts

RATES = ["inf", "20"]


def _run(**over: float) -> RunFigures:
    """One benchmark run's figures: every metric 10.0 unless given."""
    figures = {name: 10.0 for _, name, _, _ in serving.METRICS}
    figures.update(over)
    return RunFigures(**figures, completed=64, failed=0, duration_s=3.0, server_cpu_s=0.64)


def _pair(stock: dict[str, float], plugin: dict[str, float], noisy: bool | None = False,
          runs: dict | None = None) -> Pair:
    """A pair with the same figures at both rates (``runs``: these runs instead)."""
    if runs is None:
        runs = {"stock": {r: _run(**stock) for r in RATES}, "plugin": {r: _run(**plugin) for r in RATES}}
    return Pair(index=0, order=["stock", "plugin"], runs=runs, server_start_s={}, load=None, noisy=noisy)


def _summary(summaries: list[serving.Summary], metric: str, rate: str = "inf") -> serving.Summary:
    return next(s for s in summaries if s.metric == metric and s.rate == rate)


def _target(targets: list[serving.Target], metric: str, rate: str = "inf") -> serving.Target:
    return next(t for t in targets if t.metric == metric and t.rate == rate)


def test_ratio_is_plugin_over_stock_and_none_without_a_base():
    assert serving.ratio(12.0, 10.0) == pytest.approx(1.2)
    assert serving.ratio(None, 10.0) is None
    assert serving.ratio(5.0, None) is None
    assert serving.ratio(5.0, 0.0) is None


def test_verdict_says_no_difference_when_the_spread_covers_one():
    assert serving.verdict([0.9, 1.1], "lower") == "no difference"
    assert serving.verdict([0.95, 1.0], "lower") == "no difference"
    assert serving.verdict([0.8, 0.9, None], "lower") == "plug-in better"
    assert serving.verdict([1.1, 1.3], "lower") == "stock better"
    assert serving.verdict([1.1, 1.3], "higher") == "plug-in better"
    assert serving.verdict([0.7, 0.9], "higher") == "stock better"
    assert serving.verdict([None, None], "lower") == "-"
    assert serving.verdict([], "higher") == "-"


def test_summary_has_each_pairs_ratio_their_median_and_spread():
    pairs = [_pair({"median_ttft_ms": 10.0}, {"median_ttft_ms": t}, noisy=n)
             for t, n in ((9.0, False), (12.0, True), (10.5, False))]
    got = _summary(serving.summarize(pairs, RATES), "median_ttft_ms")
    assert got.ratios == pytest.approx([0.9, 1.2, 1.05])
    assert got.noisy == [False, True, False]
    assert got.ratio_median == pytest.approx(1.05)
    assert (got.ratio_min, got.ratio_max) == pytest.approx((0.9, 1.2))
    assert got.stock_median == 10.0 and got.plugin_median == 10.5
    assert got.verdict == "no difference"
    # every metric at every rate, the CPU per request among them
    summaries = serving.summarize(pairs, RATES)
    assert len(summaries) == len(serving.METRICS) * len(RATES)
    assert _summary(summaries, "server_cpu_ms_per_request", "20").ratio_median == pytest.approx(1.0)


def test_summary_skips_a_missing_figure():
    pairs = [_pair({}, {"p99_itl_ms": 5.0}), _pair({}, {}, runs={"stock": {}, "plugin": {}})]
    got = _summary(serving.summarize(pairs, RATES), "p99_itl_ms")
    assert got.ratios == [0.5, None]
    assert got.ratio_median == 0.5 and got.verdict == "plug-in better"


def test_targets_cover_throughput_at_inf_latencies_and_cpu_at_both_rates():
    names = serving.targets_for(RATES)
    assert ("request_throughput_per_s", "inf", ">=") in names
    assert ("request_throughput_per_s", "20", ">=") not in names
    for rate in RATES:
        for m in ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
                  "server_cpu_ms_per_request"):
            assert (m, rate, "<=") in names
    assert len(names) == 11


def test_targets_met_and_not_met_on_the_quiet_median():
    # quiet pairs: throughput 1.1 and 0.95 (median 1.025), TTFT 0.9 / 1.2 / 1.0 (1.0);
    # the noisy pair's 0.5 is left out of the median
    pairs = [
        _pair({}, {"request_throughput_per_s": 11.0, "median_ttft_ms": 9.0, "p99_tpot_ms": 12.0}),
        _pair({}, {"request_throughput_per_s": 9.5, "median_ttft_ms": 12.0, "p99_tpot_ms": 11.0}),
        _pair({}, {"request_throughput_per_s": 5.0, "median_ttft_ms": 10.0, "p99_tpot_ms": 5.0},
              noisy=True),
    ]
    targets = serving.judge_targets(pairs, RATES)
    tput = _target(targets, "request_throughput_per_s")
    assert tput.verdict == "met" and tput.quiet_pairs == 2
    assert tput.ratio_median_quiet == pytest.approx(1.025)
    assert _target(targets, "median_ttft_ms", "20").verdict == "NOT met"  # (0.9 + 1.2) / 2
    assert _target(targets, "p99_tpot_ms").verdict == "NOT met"
    assert _target(targets, "server_cpu_ms_per_request").verdict == "met"  # 1.0 exactly


def test_targets_not_judged_with_too_few_quiet_pairs():
    pairs = [_pair({}, {"median_ttft_ms": 5.0}), _pair({}, {"median_ttft_ms": 5.0}, noisy=True),
             _pair({}, {"median_ttft_ms": 5.0}, noisy=None)]  # None: the load was not measured
    targets = serving.judge_targets(pairs, RATES)
    assert all(t.verdict.startswith(NOT_JUDGED) for t in targets)
    assert all(t.quiet_pairs == 1 for t in targets)
    assert "1 of 3 pairs quiet" in targets[0].verdict
    one = serving.judge_targets([_pair({}, {})], RATES)
    assert all(t.verdict.startswith("not judged (too few pairs)") for t in one)
    assert serving.judge_targets([_pair({}, {})], RATES, min_quiet=1)[0].verdict == "met"


def _results(pairs: list[Pair], dp: int = 1, api_servers: int = 1) -> ServingComparison:
    params = Params(pairs=len(pairs), num_prompts=200, warmup_prompts=16, input_len_tokens=128,
                    output_len_tokens=64, seed=0, rates=RATES, noisy_above_cores=0.25, quick=False,
                    data_parallel_size=dp, api_servers=api_servers, server_command=["python"])
    tokenizer = TokenizerFacts(kind="byte-level BPE", vocab_size=1024, special_tokens=[serving.EOS],
                               trained_on="some stdlib modules", python="3", tokenizer_json_sha256_16="0" * 16)
    return ServingComparison(
        vllm_version="0.0", units=serving.UNITS, notes=["a note"], pairs=pairs, params=params,
        tokenizer=tokenizer, summary=serving.summarize(pairs, RATES),
        targets=serving.judge_targets(pairs, RATES), load={})


def test_table_prints_ratios_noisy_marks_verdicts_and_targets():
    pairs = [_pair({}, {"median_tpot_ms": 8.0}), _pair({}, {"median_tpot_ms": 9.0}),
             _pair({}, {"median_tpot_ms": 12.0}, noisy=True)]
    text = serving.format_table(_results(pairs))
    assert "rate inf" in text and "rate 20 req/s" in text
    tpot = next(line for line in text.splitlines() if line.startswith("TPOT p50 ms"))
    assert "0.80 0.90 1.20*" in tpot and "0.90" in tpot and "0.80-1.20" in tpot
    assert tpot.rstrip().endswith("no difference")
    assert "TPOT p50 ms at rate 20 req/s: <= 1.0, median 0.85: met" in text
    assert "throughput req/s at rate inf: >= 1.0, median 1.00: met" in text
    assert "note: a note" in text
    assert serving.ITL_NOTE not in text
    # one run of one pair with its ITL median near 0 is enough for the note
    itl = serving.format_table(_results([_pair({}, {}), _pair({}, {}), _pair({}, {})]
                                        + [_pair({"median_itl_ms": 0.01}, {})]))
    assert serving.ITL_NOTE in itl


def test_skipped_without_vllm(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    got = serving.run(quick=True)
    assert isinstance(got, Skipped) and "vLLM is not importable" in got.reason
    assert serving.format_table(got).startswith("serving: skipped: vLLM is not importable")


def test_the_sections_results_come_back_typed_and_a_skip_as_skipped(tmp_path):
    """Through the output file the run reads: the figures as a ServingComparison, the same
    table from their JSON form; a skipped section as Skipped, which SectionOutput.skipped
    reports."""
    result = _results([_pair({}, {"median_tpot_ms": 8.0}), _pair({}, {}, noisy=True)])
    path = tmp_path / "out.json"
    for value in (result, Skipped("vLLM is not importable (none here)")):
        table = serving.format_table(value)
        path.write_bytes(sections.ENCODER.encode(sections.SectionOutput(result=value, table=table)))
        got = sections.read_output("serving", str(path))
        assert got.result == value and type(got.result) is type(value) and got.table == table
        assert serving.format_table(json.loads(msgspec.json.encode(value))) == table
    assert got.skipped == "vLLM is not importable (none here)"
    data = json.loads(msgspec.json.encode(result))
    assert data["status"] == "measured" and data["pairs"][0]["runs"]["plugin"]["20"]["median_tpot_ms"] == 8.0


def _without_vllm_or_a_model(monkeypatch) -> None:
    """``serving.run`` without vLLM installed nor a model folder built: a stand-in
    ``vllm`` module, no subreaper, made-up tokenizer facts."""
    import types

    fake = types.ModuleType("vllm")
    fake.__version__ = "0.0-made-up"
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setattr(serving, "_become_subreaper", lambda: None)
    monkeypatch.setattr(serving, "build_model", lambda folder: TokenizerFacts(
        kind="made-up", vocab_size=1, special_tokens=[], trained_on="", python="", tokenizer_json_sha256_16=""))


def test_a_run_keeps_each_servers_and_clients_log_where_asked(monkeypatch, tmp_path):
    """``run(..., logs=DIR)`` with the servers and the client replaced: every server's and
    client's log lands in DIR, named by pair and transport; without ``logs`` none is kept."""
    import subprocess

    _without_vllm_or_a_model(monkeypatch)
    procs = []

    def start_server(model, transport, tmp, log, *args):
        with open(log, "w") as f:
            f.write(f"{transport} server\n")
        procs.append(subprocess.Popen([sys.executable, "-c", "pass"]))
        procs[-1].wait()
        return procs[-1], 1

    def bench_server(spec, tmp, log=None):
        with open(log, "w") as f:
            f.write("client\n")
        return {r: _run() for r in spec["rates"]}

    monkeypatch.setattr(serving, "start_server", start_server)
    monkeypatch.setattr(serving, "bench_server", bench_server)
    logs = tmp_path / "logs"
    got = serving.run(True, pairs=2, logs=str(logs))
    assert [p.order for p in got.pairs] == [["stock", "plugin"], ["plugin", "stock"]]
    assert sorted(p.name for p in logs.iterdir()) == [
        f"{kind}-{i}-{t}.log" for kind in ("client", "server") for i in (0, 1) for t in ("plugin", "stock")]
    assert (logs / "server-1-plugin.log").read_text() == "plugin server\n"
    procs.clear()
    written: list[str] = []
    monkeypatch.setattr(serving, "bench_server", lambda spec, tmp, log=None: written.append(log) or
                        bench_server(spec, tmp, log))
    serving.run(True, pairs=1)
    assert len(written) == 2 and not any(os.path.exists(p) for p in written)  # gone with the run's folder


def test_rounds_run_against_both_servers_with_the_one_not_measured_paused(monkeypatch, tmp_path):
    """``run(..., rounds=3)``: each pair of servers starts once, a record a round with its
    server pair, the order alternating from round to round across pairs, and each
    benchmark run against a resumed server while the other one is paused; both servers
    stopped at the end of their pair."""
    _without_vllm_or_a_model(monkeypatch)
    paused: dict[int, bool] = {}
    events: list[tuple] = []

    class Proc:
        def __init__(self, pid: int) -> None:
            self.pid = pid

    def start_server(model, transport, tmp, log, *args):
        proc = Proc(len(paused) + 100)
        paused[proc.pid] = False
        events.append(("start", transport, os.path.basename(log)))
        return proc, proc.pid

    def pause(proc):
        paused[proc.pid] = True

    def resume(proc):
        paused[proc.pid] = False

    def bench_server(spec, tmp, log=None):
        others = [pid for pid in paused if pid != spec["server_pid"]]
        assert not paused[spec["server_pid"]] and all(paused[pid] for pid in others)
        events.append(("bench", spec["port"], os.path.basename(log)))
        return {r: _run() for r in spec["rates"]}

    monkeypatch.setattr(serving, "start_server", start_server)
    monkeypatch.setattr(serving, "bench_server", bench_server)
    monkeypatch.setattr(serving, "_pause", pause)
    monkeypatch.setattr(serving, "_resume", resume)
    monkeypatch.setattr(serving, "_stop", lambda proc: events.append(("stop", proc.pid)))
    got = serving.run(True, pairs=2, rounds=3, logs=str(tmp_path / "logs"))
    assert [p.index for p in got.pairs] == list(range(6))
    assert [p.server_pair for p in got.pairs] == [0, 0, 0, 1, 1, 1]
    assert [p.order for p in got.pairs] == [["stock", "plugin"], ["plugin", "stock"]] * 3
    assert got.params.rounds == 3 and got.params.pairs == 2
    starts = [e for e in events if e[0] == "start"]
    assert [s[1] for s in starts] == ["stock", "plugin", "plugin", "stock"]
    benches = [e for e in events if e[0] == "bench"]
    assert len(benches) == 12 and benches[0][2] == "client-0-0-stock.log" and benches[-1][2] == "client-1-2-stock.log"
    # the second pair's servers are other processes; each pair's two stopped before the next starts
    assert {e[1] for e in benches[:6]} == {100, 101} and {e[1] for e in benches[6:]} == {102, 103}
    kinds = [e[0] for e in events]
    assert kinds.index("stop") > max(i for i, e in enumerate(events[:9]) if e[0] == "bench")
    assert sorted(e[1] for e in events if e[0] == "stop") == [100, 101, 102, 103]
    assert "2 starts of both servers, 3 rounds each" in serving.format_table(got)
    with pytest.raises(ValueError, match="rounds must be at least 1"):
        serving.run(True, pairs=1, rounds=0)


def test_pause_stops_a_servers_whole_group_and_stop_ends_a_paused_one_cleanly(tmp_path):
    """``_pause`` stops every process of the group (a parent and its child, in their own
    session as ``_spawn`` starts them), ``_resume`` continues them, and ``_stop`` of a
    paused group resumes it first: SIGTERM ends it at once instead of SIGKILL after the
    grace."""
    import select
    import signal

    from shmclient_bench import serving_servers

    fifo = str(tmp_path / "pids")
    os.mkfifo(fifo)
    script = ("import subprocess, sys, time; "
              "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
              f"open({fifo!r}, 'w').write(str(child.pid)); time.sleep(600)")
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    proc = serving._spawn([sys.executable, "-c", script], dict(os.environ), str(tmp_path / "server.log"))
    try:
        text = b""
        try:
            while not text.endswith(b"\n") and select.select([reader], [], [], 60)[0]:
                chunk = os.read(reader, 64)
                if not chunk:
                    break
                text += chunk
        finally:
            os.close(reader)
        child = int(text)
        serving._pause(proc)
        assert serving_servers._stopped(proc.pid) and serving_servers._stopped(child)
        serving._resume(proc)
        os.kill(child, 0)
        assert not serving_servers._stopped(child) and not serving_servers._stopped(proc.pid)
        serving._pause(proc)
    finally:
        serving._stop(proc, grace_s=30.0)
    assert proc.poll() == -signal.SIGTERM


def test_a_process_counts_as_stopped_only_once_every_thread_has(tmp_path, monkeypatch):
    """A stop reaches a process's threads one by one: with its first thread stopped and
    another still running (what ``/proc/PID/stat`` alone showed as stopped), a server is
    not paused yet."""
    from shmclient_bench import serving_servers

    def thread(tid: int, state: str) -> None:
        d = tmp_path / "123" / "task" / str(tid)
        d.mkdir(parents=True, exist_ok=True)
        (d / "stat").write_text(f"{tid} (python (x)) {state} 1 1 1 0 -1\n")

    thread(123, "T")
    (tmp_path / "123" / "stat").write_text("123 (python (x)) T 1 1 1 0 -1\n")
    thread(124, "R")
    monkeypatch.setattr(serving_servers, "_PROC", str(tmp_path))
    assert not serving_servers._stopped(123)
    thread(124, "S")
    assert not serving_servers._stopped(123)
    thread(124, "t")
    assert serving_servers._stopped(123)
    assert serving_servers._stopped(999)  # gone


def test_section_is_registered_with_its_own_time_limit():
    assert "serving" in bench_main.SECTIONS and "serving" in bench_main.EXTERNAL
    for kind in ("quick", "full"):
        assert bench_main.DEFAULTS[kind]["serving_timeout"] > bench_main.DEFAULTS[kind]["section_timeout"]


@pytest.mark.vllm
@pytest.mark.timeout(300)
def test_model_folder_tokenizer_loads_and_round_trips():
    from .conftest import importorskip_vllm
    importorskip_vllm()  # an error, not a skip, under SHMCLIENT_REQUIRE_VLLM=1
    from transformers import AutoTokenizer
    from vllm.benchmarks.datasets import RandomDataset
    from vllm.tokenizers import get_tokenizer

    with tempfile.TemporaryDirectory(prefix="shmc-serving-test-") as folder:
        facts = serving.build_model(folder)
        assert facts.vocab_size == serving.CONFIG["vocab_size"] == 1024
        tok = AutoTokenizer.from_pretrained(folder)
        assert len(tok) == tok.vocab_size == 1024
        assert tok.eos_token == serving.EOS and tok.all_special_ids == [tok.eos_token_id]
        for text in ("def main(argv=None):\n    return 0\n", "ünïcode ✓ and   spaces\t",
                     "import os, sys  # a comment", ""):
            ids = tok.encode(text, add_special_tokens=False)
            assert all(0 <= i < 1024 for i in ids)
            assert tok.decode(ids) == text
        assert len(tok.encode("import os\nimport sys\n")) < len("import os\nimport sys\n")  # merges learnt
        # the same training text gives the same tokenizer
        with tempfile.TemporaryDirectory(prefix="shmc-serving-test-") as again:
            assert serving.build_model(again).tokenizer_json_sha256_16 == facts.tokenizer_json_sha256_16
        # what the server and vLLM's serving benchmark load: the random dataset's prompts
        vtok = get_tokenizer(folder)
        samples = RandomDataset(random_seed=0).sample(vtok, 4, input_len=serving.INPUT_LEN,
                                                      output_len=serving.OUTPUT_LEN)
        assert len(samples) == 4
        for s in samples:
            assert s.prompt_len == serving.INPUT_LEN and s.expected_output_len == serving.OUTPUT_LEN
            assert len(vtok.encode(s.prompt, add_special_tokens=False)) == serving.INPUT_LEN


def test_data_parallel_servers_get_their_flags_and_the_dp_clients_line():
    from shmclient_bench.serving import PLUGIN_LINE, dp_flags

    assert dp_flags(1) == ([], PLUGIN_LINE)
    flags, line = dp_flags(2)
    assert flags[:4] == ["--data-parallel-size", "2", "--api-server-count", "1"]
    assert line.startswith("shmclient.vllm: DPLBAsyncMPClient (2 engines) moves")


def test_several_api_servers_log_a_line_each_and_the_launcher_one():
    from shmclient_bench.serving import PLUGIN_LINE, dp_flags, plugin_lines

    assert plugin_lines(1, 1) == [PLUGIN_LINE] and plugin_lines(2, 1) == [dp_flags(2)[1]]
    assert plugin_lines(1, 2) == [
        "shmclient.vllm: AsyncMPClient (API server 0 of 2) moves engine-core requests and outputs "
        "over shared-memory rings",
        "shmclient.vllm: AsyncMPClient (API server 1 of 2) moves engine-core requests and outputs "
        "over shared-memory rings",
        "shmclient.vllm: the launcher made shared-memory rings for 2 API servers x 1 engine core"]
    lines = plugin_lines(2, 2)
    assert lines[0].startswith("shmclient.vllm: DPLBAsyncMPClient (2 engines, API server 0 of 2) moves")
    assert lines[1].startswith("shmclient.vllm: DPLBAsyncMPClient (2 engines, API server 1 of 2) moves")
    assert lines[2].endswith("for 2 API servers x 2 engine cores")
    assert len(plugin_lines(2, 3)) == 4


def test_api_server_count_as_vllm_serve_counts_them():
    count = serving.api_server_count
    assert count([]) == 1
    assert count(["--api-server-count", "3"]) == 3
    assert count(["--api-server-count=3", "--data-parallel-size", "2"]) == 3
    assert count(["--data-parallel-size", "2"]) == 2  # vllm serve's default: one per engine
    assert count(["--data-parallel-size", "2", "--api-server-count", "1"]) == 1
    assert count(["--api-server-count", "3"], launcher="api_server") == 1


def test_server_command_names_the_launcher():
    assert serving.LAUNCHERS["serve"][:3] == ["-m", "shmclient_bench.vllm_cli", "serve"]
    assert "MODEL" in serving.LAUNCHERS["serve"] and "MODEL" in serving.LAUNCHERS["api_server"]


def test_the_bench_serves_several_api_servers_by_vllm_serve():
    from shmclient_bench.serving import api_server_flags, dp_flags, launcher_for, plugin_lines

    assert api_server_flags(1, 1) == ([], [serving.PLUGIN_LINE])
    assert api_server_flags(2, 1) == (dp_flags(2)[0], [dp_flags(2)[1]])
    assert launcher_for(1) == "api_server" and launcher_for(2) == "serve"
    assert api_server_flags(1, 2) == (["--api-server-count", "2"], plugin_lines(1, 2))
    flags, lines = api_server_flags(2, 2)
    assert flags[:4] == ["--api-server-count", "2", "--data-parallel-size", "2"]
    assert "--gpu-memory-utilization" in flags
    assert lines == plugin_lines(2, 2)
    assert serving.api_server_count(flags) == 2
    results = _results([_pair({}, {})], dp=2, api_servers=2)
    assert "(2 engine cores, data parallelism; 2 API servers, vllm serve)" in serving.format_table(results)


def test_stop_ends_the_whole_process_group_of_a_server(tmp_path):
    """What the tests' and the benchmark's servers are stopped with: a parent that ignores
    SIGTERM and a child of it, in their own session as ``_spawn`` starts them; both are
    gone afterwards (SIGKILL after the grace) and waited for."""
    import os
    import select
    import signal

    fifo = str(tmp_path / "pids")
    os.mkfifo(fifo)
    script = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
              "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
              f"open({fifo!r}, 'w').write(str(child.pid)); time.sleep(600)")
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # before the writer: it never blocks
    proc = serving._spawn([sys.executable, "-c", script], dict(os.environ), str(tmp_path / "server.log"))
    try:
        text = b""
        while not text.endswith(b"\n") and select.select([reader], [], [], 60)[0]:
            chunk = os.read(reader, 64)
            if not chunk:  # the writer closed: the pid is complete
                break
            text += chunk
        child = int(text)
    finally:
        os.close(reader)
    serving._stop(proc, grace_s=0.5)
    assert proc.poll() == -signal.SIGKILL
    try:
        os.kill(child, 0)
    except ProcessLookupError:
        pass
    else:  # a zombie of a reaped group would be gone; a live one is a failure
        with open(f"/proc/{child}/stat") as f:
            assert f.read().split()[2] == "Z", f"child {child} still runs"
