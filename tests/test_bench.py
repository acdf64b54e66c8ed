"""The benchmark's own tests: statistics, configuration parsing, files, and tiny runs of
the client sections (very small counts, no timing assertions)."""

from __future__ import annotations

import io
import json
import os
import pathlib
import queue
import random
import re
import signal
import subprocess
import sys
import threading
import time
import types

import msgspec
import numpy as np
import psutil
import pytest

from shmclient_bench import __main__ as bench_main
from shmclient_bench import clients, machine, plots, report, results_files, sections, stats, tables
from shmclient_bench.tensor_results import Copies, TensorHost, TensorSweep, Timing, TransferPoint

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _mp_available() -> bool:
    try:
        import shmclient.client_async  # noqa: F401
        import shmclient.client_mp  # noqa: F401
    except ImportError:
        return False
    return True


# -- statistics ----------------------------------------------------------------------


def test_summarize_known_samples():
    # 1..100 µs given in ns; numpy's linear interpolation between order statistics.
    s = stats.summarize([i * 1000 for i in range(100, 0, -1)])
    assert s["n"] == 100 and s["unit"] == "us"
    assert s["min"] == pytest.approx(1.0)
    assert s["max"] == pytest.approx(100.0)
    assert s["mean"] == pytest.approx(50.5)
    assert s["p50"] == pytest.approx(50.5)
    assert s["p90"] == pytest.approx(90.1)
    assert s["p99"] == pytest.approx(99.01)
    assert s["p99.9"] == pytest.approx(99.901)
    assert s["std"] == pytest.approx(float(np.std(np.arange(1, 101))))


def test_summarize_single_empty_and_units():
    one = stats.summarize([2500])
    assert one["n"] == 1 and one["p50"] == one["p99.9"] == one["min"] == pytest.approx(2.5)
    assert one["std"] == 0.0
    ns = stats.summarize([10, 20, 30], unit="ns")
    assert ns["p50"] == 20.0 and ns["unit"] == "ns"
    empty = stats.summarize([])
    assert empty["n"] == 0 and empty["p50"] is None and empty["mean"] is None


def test_overhead_ratio_and_latency_ratios():
    assert stats.overhead_ratio(30.0, 110.0, 10.0) == pytest.approx(0.2)
    assert stats.overhead_ratio(30.0, 10.0, 10.0) is None  # zmq adds nothing
    assert stats.overhead_ratio(None, 110.0, 10.0) is None

    def entry(p50: float) -> dict:
        return {"summary": {"p50": p50}}

    lat = {
        "inproc": entry(10.0),
        "sync-shm": entry(20.0),
        "sync-zmq": entry(110.0),
        "async-shm": entry(22.0),
        "async-zmq": entry(130.0),
        "inproc@tiny": entry(500.0),
        "sync-shm@tiny": entry(510.0),
        "sync-zmq@tiny": entry(600.0),
    }
    r = stats.latency_ratios(lat)
    assert set(r) == {"sync", "async", "sync@tiny"}
    assert r["sync"]["ratio"] == pytest.approx(0.10) and r["sync"]["met"] is True
    assert r["async"]["ratio"] == pytest.approx(0.10) and r["async"]["met"] is True
    assert r["sync"]["target"] == 0.10 and r["async"]["target"] == 0.10
    assert r["sync@tiny"]["ratio"] == pytest.approx(0.10) and r["sync@tiny"]["model"] == "tiny"
    assert r["sync@tiny"]["target"] is None and r["sync@tiny"]["met"] is None


def test_baseline_of():
    assert stats.baseline_of("sync-shm") == "sync-zmq"
    assert stats.baseline_of("async-shm@tiny") == "async-zmq@tiny"
    assert stats.baseline_of("inproc") == "sync-zmq"
    assert stats.baseline_of("async-zmq") == "async-zmq"


# -- configurations and options --------------------------------------------------------


def test_parse_configs():
    specs = clients.parse_configs("sync-shm,inproc", "mock,tiny")
    assert [s.name for s in specs] == ["inproc", "sync-shm", "inproc@tiny", "sync-shm@tiny"]
    assert [s.name for s in clients.parse_configs("all", "mock")] == list(clients.KINDS)
    explicit = clients.parse_configs("sync-zmq@tiny,inproc", "mock")
    assert [s.name for s in explicit] == ["inproc", "sync-zmq@tiny"]
    with pytest.raises(ValueError, match="bogus"):
        clients.parse_configs("bogus", "mock")
    with pytest.raises(ValueError, match="huge"):
        clients.parse_configs("inproc", "huge")


def test_engine_config_differs_only_in_transport():
    a = clients.ConfigSpec("sync-shm").engine_config()
    b = clients.ConfigSpec("async-zmq").engine_config()
    assert a.transport == "shm" and b.transport == "zmq"
    assert a.replace(transport="zmq") == b
    assert clients.ConfigSpec("inproc", "tiny").engine_config().model == "tiny"


def test_cli_rejects_bad_options(capsys):
    with pytest.raises(SystemExit):
        bench_main.main(["--only", "latency,nonsense"])
    assert bench_main.main(["--configs", "nope", "--only", "latency"]) == 2
    assert "nope" in capsys.readouterr().err


# -- files -----------------------------------------------------------------------------


def test_machine_facts_keys():
    f = machine.machine_facts()
    for k in ("date", "cpu_model", "cpu_count_logical", "python", "packages", "gpu"):
        assert k in f
    for p in ("torch", "numpy", "msgspec", "pyzmq", "psutil"):
        assert p in f["packages"]
    assert f["packages"]["numpy"] == np.__version__
    json.dumps(f)


def test_write_json_is_strict_json(tmp_path):
    path = results_files.write_json(
        str(tmp_path / "x.json"), {"a": np.float64(1.5), "b": {1, 2}, "c": float("nan"), 3: (1,)}
    )
    with open(path) as f:
        data = json.load(f)
    assert data == {"a": 1.5, "b": [1, 2], "c": None, "3": [1]}


@pytest.mark.skipif(not _has_matplotlib(), reason="matplotlib not installed")
def test_plot_latency_cdf_writes_png(tmp_path):
    rng = np.random.default_rng(0)
    out = plots.plot_latency_cdf(
        {"a": rng.integers(10_000, 50_000, 200), "b": rng.integers(50_000, 200_000, 200)},
        str(tmp_path / "cdf.png"),
    )
    assert out == str(tmp_path / "cdf.png")
    with open(out, "rb") as f:
        assert f.read(8) == PNG_MAGIC


def _sweep(cuda: bool = False) -> TensorSweep:
    """A made-up tensor sweep over 4 KiB and 64 KiB: every time is the size in KiB times
    the way's factor, in µs."""
    sizes = (4096, 65536)

    def t(size: int, factor: float) -> Timing:
        return Timing(median_us=size / 1024 * factor, p99_us=size / 1024 * factor * 2,
                      min_us=1.0, n=3)

    copies = {z: Copies(np_copyto=t(z, 0.1), torch_copy_=t(z, 0.2), torch_clone=t(z, 0.3))
              for z in sizes}
    host = TensorHost(python="3.11", torch="2.5", cpus=2, torch_threads=2, load_avg_1m=0.5,
                      machine="x86_64", load_avg_1m_after=0.75)
    return TensorSweep(host=host, quick=True, memcpy=copies,
                       shm_view={z: t(z, 1.0) for z in sizes},
                       shm_copy={z: t(z, 2.0) for z in sizes},
                       zmq={z: t(z, 3.0) for z in sizes},
                       cuda_ipc={z: t(z, 4.0) for z in sizes} if cuda else None)


def test_the_transfer_points_come_from_the_typed_sweep():
    pts = _sweep().points()
    assert all(isinstance(p, TransferPoint) for p in pts)
    assert [p.series for p in pts[::2]] == [
        "memcpy np_copyto", "memcpy torch_copy_", "memcpy torch_clone", "shm_view", "shm_copy", "zmq"]
    assert pts[6:8] == [TransferPoint("shm_view", 4096, 4.0), TransferPoint("shm_view", 65536, 64.0)]
    assert _sweep(cuda=True).points()[-1] == TransferPoint("cuda_ipc", 65536, 256.0)


def test_the_sweep_keeps_its_json_layout():
    """results.json holds the sweep as it always has: sizes as string keys, one dict per
    timing, the memcpy variants by name, no cuda_ipc without CUDA."""
    data = json.loads(msgspec.json.encode(_sweep()))
    assert list(data) == ["host", "quick", "memcpy", "shm_view", "shm_copy", "zmq"]
    assert data["memcpy"]["65536"]["torch_copy_"] == {"median_us": 12.8, "p99_us": 25.6,
                                                      "min_us": 1.0, "n": 3}
    assert data["zmq"]["4096"]["median_us"] == 12.0
    assert data["host"]["load_avg_1m_after"] == 0.75
    assert "cuda_ipc" in json.loads(msgspec.json.encode(_sweep(cuda=True)))


def test_the_sweeps_host_encodes_as_json():
    from shmclient_bench import tensors

    host = json.loads(sections.ENCODER.encode(tensors._host(0.5)))
    assert host["torch"] == str(tensors.torch.__version__) and host["load_avg_1m"] == 0.5


@pytest.mark.skipif(not _has_matplotlib(), reason="matplotlib not installed")
def test_transfer_plot_draws_the_typed_points(tmp_path, monkeypatch):
    from matplotlib.axes import Axes

    drawn: list[tuple[str, list, list]] = []
    real = Axes.plot

    def plot(self, xs, ys, *args, **kwargs):
        drawn.append((kwargs.get("label"), list(xs), list(ys)))
        return real(self, xs, ys, *args, **kwargs)

    monkeypatch.setattr(Axes, "plot", plot)
    out = plots.plot_transfer(_sweep().points(), str(tmp_path / "t.png"), label="2026-12-01 · box · quiet")
    with open(out, "rb") as f:
        assert f.read(8) == PNG_MAGIC
    assert [d[0] for d in drawn] == [
        "memcpy np_copyto", "memcpy torch_copy_", "memcpy torch_clone", "shm_view", "shm_copy", "zmq"]
    assert drawn[5] == ("zmq", [4096, 65536], [12.0, 192.0])
    assert plots.plot_transfer([], str(tmp_path / "none.png")).startswith("plots skipped")


def test_a_sections_output_comes_back_typed(tmp_path, monkeypatch):
    """The child writes the section's result and its table; the run reads the result back
    into the section's type. A table that fails leaves a note and the result."""
    fake = types.ModuleType("shmclient_bench.fake")
    fake.run = lambda quick: _sweep()
    fake.table = lambda r: f"{len(r.points())} points"
    monkeypatch.setitem(sys.modules, "shmclient_bench.fake", fake)
    monkeypatch.setitem(sections.RENDERERS, "fake", "table")
    monkeypatch.setitem(sections.RESULT_TYPES, "fake", TensorSweep)
    old = signal.getsignal(signal.SIGTERM)
    try:
        assert sections.run_child("fake", True, str(tmp_path / "a.json")) == 0
        fake.table = lambda r: r["memcpy"]  # a table that treats the result as a dict
        assert sections.run_child("fake", True, str(tmp_path / "b.json")) == 0
        fake.run = lambda quick: 1 / 0
        assert sections.run_child("fake", True, str(tmp_path / "c.json")) == 1
    finally:
        signal.signal(signal.SIGTERM, old)
    a = sections.read_output("fake", str(tmp_path / "a.json"))
    assert a.result == _sweep() and a.table == "12 points" and a.note is None
    b = sections.read_output("fake", str(tmp_path / "b.json"))
    assert b.result == _sweep() and b.table is None and "table failed: TypeError" in b.note
    c = sections.read_output("fake", str(tmp_path / "c.json"))
    assert c.result is None and c.error.startswith("ZeroDivisionError") and "1 / 0" in c.traceback
    assert sections.read_output("fake", str(tmp_path / "missing.json")) is None


def test_plots_skipped_with_a_note_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setattr(plots, "_pyplot", lambda: None)
    note = plots.plot_latency_cdf({"a": [1000, 2000]}, str(tmp_path / "x.png"))
    assert note.startswith("plots skipped") and "matplotlib" in note
    assert plots.plot_transfer([TransferPoint("a", 1, 1.0)], str(tmp_path / "y.png")) == note
    assert not os.listdir(tmp_path)


def test_format_report_renders_every_section():
    res = {
        "args": {"quick": True},
        "machine": {"date": "d", "cpu_count_logical": 2, "cpu_model": "m", "python": "3"},
        "latency_meta": {"rounds": 2, "warmup": 1},
        "latency": {
            c: {"summary": stats.summarize([v * 1000] * 5)}
            for c, v in (("inproc", 10), ("sync-shm", 20), ("sync-zmq", 110))
        },
        "streaming_meta": {"tokens": 4, "rounds": 1},
        "streaming": {
            "sync-shm": {
                "1": {
                    "outputs_per_s": 10.0,
                    "batches": 4,
                    "wall_us_per_batch": 1.0,
                    "gap_us": stats.summarize([1000]),
                    "client_cpu_us_per_batch": 2.0,
                }
            }
        },
        "idle_meta": {"settle_s": 1, "window_s": 1},
        "idle_cpu": {"sync-shm": {"client_pct": 0.1, "engine_pct": 0.2, "source": "psutil"}},
        "tensors": _sweep(),
        "ring": {"round_trip": {"64 B": {"ring_p50_us": 2.0}}},
        "tables": {"tensors": "the sweep's table", "ring": "the ring's table"},
        "skipped": ["something: why"],
    }
    res["latency_ratios"] = stats.latency_ratios(res["latency"])
    text = report.format_report(res)
    for needle in ("sync-shm", "0.10", "(shm - inproc) / (zmq - inproc)", "Idle CPU", "Streaming",
                   "Tensor transfer sweep (shmclient_bench.tensors):\nthe sweep's table",
                   "Raw ring ping-pong vs pyzmq ipc (shmclient_bench.ring):\nthe ring's table",
                   "something: why", "5.50x faster", "baseline"):
        assert needle in text, needle
    assert not text.startswith("NOISY")


def test_a_section_without_its_table_says_so_and_guesses_nothing():
    res = {"machine": {}, "ring": {"round_trip": {"64 B": {"ring_p50_us": 2.0}}},
           "notes": ["ring: shmclient_bench.ring's table failed: KeyError: 'throughput'"]}
    text = report.format_report(res)
    assert "Raw ring ping-pong vs pyzmq ipc (shmclient_bench.ring):\n" + report.NO_TABLE in text
    assert "ring_p50_us" not in text and "2.0" not in text


def test_a_noisy_sections_table_says_not_judged_instead_of_its_verdicts():
    """A section run in a child renders its table there, verdicts included: a noisy
    section was only marked in its title, its rows still said met / NOT met."""
    table = "  busy 1 |  31.0 | met |  40.0 | NOT met\nmetric: µs; all targets met"
    for noisy in (False, True):
        res = {"machine": {}, "contention": {"cells": {}}, "tables": {"contention": table},
               "section_load": {"contention": {"noisy": noisy, "other_cores": 0.9}}}
        text = report.format_report(res)
        if noisy:
            assert "[NOISY: other processes used 0.90 cores]" in text
            assert "met" not in text.replace("metric", "")
            assert text.count(report.NOT_JUDGED) == 3
        else:
            assert table in text


def test_ratio_words_say_which_way_is_better():
    assert tables.faster(20.0, 110.0) == "5.50x faster"
    assert tables.faster(120.0, 100.0) == "1.20x slower"
    assert tables.faster(None, 1.0) == "-" and tables.faster(1.0, 1.0) == "same"
    assert tables.compare(150.0, 100.0, False, ("more", "fewer")) == "1.50x more"
    assert tables.compare(50.0, 100.0, True, ("less", "more")) == "2.00x less"


def test_noisy_run_says_so_in_the_first_line_and_plots_carry_a_label():
    load = {"noisy": True, "noisy_blocks": 2, "blocks_judged": 5, "max_other_cores": 0.9,
            "threshold_cores": 0.25, "whole_run": {"other_cores": 0.4}}
    res = {"args": {"quick": True}, "load": load,
           "machine": {"date": "2026-12-01T10:00:00+00:00", "host": "box", "cpu_count_logical": 2,
                       "load_average": [0.5, 0, 0], "load_average_end": [1.5, 0, 0]}}
    text = report.format_report(res)
    first = text.splitlines()[0]
    assert first.startswith("NOISY RUN") and "2 of 5 blocks" in first and "0.90 cores" in first
    label = plots.run_label(res)
    for needle in ("2026-12-01 10:00:00", "box", "2 CPUs", "load average 0.50 -> 1.50", "NOISY"):
        assert needle in label, needle
    load["noisy"] = False
    assert "quiet (other processes 0.40 cores)" in report.format_report(res).splitlines()[0]
    assert "quiet" in plots.run_label(res)


def test_fmt_bytes():
    assert [plots.fmt_bytes(n) for n in (512, 4096, 65536, 1 << 20, 1536 << 10, 1 << 30)] == [
        "512 B", "4 KiB", "64 KiB", "1 MiB", "1.5 MiB", "1 GiB"]


# -- tiny runs -------------------------------------------------------------------------


def _load(out: str) -> dict:
    with open(os.path.join(out, "results.json")) as f:
        return json.load(f)


def test_tiny_inproc_run_writes_json(tmp_path):
    out = str(tmp_path / "res")
    rc = bench_main.main(
        ["--configs", "inproc", "--models", "mock", "--only", "latency,streaming",
         "--samples", "20", "--rounds", "2", "--warmup", "2", "--streams", "1,3",
         "--tokens", "3", "--out", out]
    )  # fmt: skip
    assert rc == 0
    data = _load(out)
    for k in ("args", "machine", "latency", "latency_meta", "streaming", "skipped", "errors",
              "files", "duration_s", "engine_config"):
        assert k in data, k
    s = data["latency"]["inproc"]["summary"]
    assert s["n"] == 20 and s["p50"] > 0
    assert len(data["latency"]["inproc"]["rounds"]) == 2
    st = data["streaming"]["inproc"]
    assert set(st) == {"1", "3"}
    assert st["3"]["outputs"] == 9 and st["3"]["runs"] == 2
    with open(os.path.join(out, "samples.json")) as f:
        assert len(json.load(f)["inproc"]) == 20
    if _has_matplotlib():
        assert data["files"]["plots"]
        for p in data["files"]["plots"]:
            with open(p, "rb") as f:
                assert f.read(8) == PNG_MAGIC


@pytest.mark.skipif(not _mp_available(), reason="multiprocess clients not importable")
def test_tiny_mp_run_latency_and_idle(tmp_path):
    out = str(tmp_path / "res")
    rc = bench_main.main(
        ["--configs", "async-shm", "--models", "mock", "--only", "latency,idle",
         "--samples", "10", "--rounds", "2", "--warmup", "2", "--idle-settle", "0.1",
         "--idle-window", "0.3", "--no-plots", "--out", out]
    )  # fmt: skip
    data = _load(out)
    assert rc == 0, data["errors"]
    assert set(data.get("latency", {})) == {"async-shm"}, data["skipped"]
    for cfg in ("async-shm",):
        assert data["latency"][cfg]["summary"]["n"] == 10
        idle = data["idle_cpu"][cfg]
        assert idle["client_pct"] >= 0 and idle["engine_pct"] >= 0
        assert "note" not in idle


def test_a_client_that_cannot_start_is_an_error_of_the_run(tmp_path):
    """A client refused at both starts was only listed as skipped: the run exited 0 and
    the target it was to be judged by vanished from the report."""
    out = str(tmp_path / "res")
    rc = bench_main.main(
        ["--configs", "sync-shm", "--models", "mock", "--only", "latency", "--samples", "5",
         "--rounds", "1", "--warmup", "1", "--no-plots", "--set", f"ring_capacity_bytes={1 << 40}",
         "--out", out]
    )  # fmt: skip
    data = _load(out)
    assert rc == 1
    assert any("sync-shm: could not start the client" in e for e in data["errors"]), data["errors"]


def test_ctrl_c_inside_one_clients_shutdown_still_shuts_the_others_down(tmp_path, monkeypatch):
    """A KeyboardInterrupt raised inside the first client's close left the loop over
    the clients: the others were never shut down (their engines were terminated
    instead, reported as deaths, their loop threads left running)."""
    from shmclient_bench import clients

    closed: list[str] = []
    close = clients.Session.close

    def interrupted_close(self):
        close(self)
        closed.append(self.name)
        if len(closed) == 1:
            raise KeyboardInterrupt  # (as a signal landing at the end of it)

    monkeypatch.setattr(clients.Session, "close", interrupted_close)
    rc = bench_main.main(
        ["--configs", "sync-shm,async-shm", "--models", "mock", "--only", "latency",
         "--samples", "5", "--rounds", "1", "--warmup", "1", "--no-plots", "--out", str(tmp_path / "res")]
    )  # fmt: skip
    assert rc == 130
    assert sorted(closed) == ["async-shm", "sync-shm"]


def test_inproc_floor_runs_under_the_engine_threads(tmp_path):
    import torch

    before = torch.get_num_threads()
    threads = before + 2  # differs from whatever torch uses here
    out = str(tmp_path / "res")
    rc = bench_main.main(
        ["--configs", "inproc,inproc@tiny", "--models", "mock", "--only", "latency",
         "--samples", "5", "--rounds", "1", "--warmup", "1", "--no-plots",
         "--set", f"cpu_threads={threads}", "--out", out]
    )  # fmt: skip
    data = _load(out)
    assert rc == 0, data["errors"]
    assert data["latency"]["inproc"]["torch_threads"] == threads
    assert data["latency"]["inproc@tiny"]["torch_threads"] == threads
    assert torch.get_num_threads() == before


# -- results folders, load, progress ---------------------------------------------------


def test_every_run_gets_a_new_folder(tmp_path, capsys):
    import datetime

    now = datetime.datetime(2026, 12, 1, 10, 0, 0)
    a = bench_main.new_results_dir(str(tmp_path / "results"), now)
    b = bench_main.new_results_dir(str(tmp_path / "results"), now)
    assert a != b and os.path.isdir(a) and os.path.isdir(b)
    assert os.path.basename(a).startswith("20261201-100000-")
    taken = tmp_path / "taken"
    taken.mkdir()
    rc = bench_main.main(["--configs", "inproc", "--models", "mock", "--only", "latency",
                          "--out", str(taken)])
    assert rc == 2
    assert "already exists" in capsys.readouterr().err
    assert not os.listdir(taken)


def test_console_entry_takes_sys_argv(monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["shmclient-bench", "--configs", "nope", "--only", "latency"])
    assert bench_main.main() == 2
    assert capsys.readouterr().err.startswith("shmclient-bench: ")


def test_load_monitor_counts_the_runs_own_children_as_its_own():
    from shmclient_bench import load

    with pytest.raises(ValueError, match="threshold_cores"):
        load.LoadMonitor(0)
    mon = load.LoadMonitor()
    if not mon.available:
        pytest.skip("no /proc/stat")
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        with mon.block("own busy child") as blk:
            # Until the child has used 0.3 s of CPU (observable), at most 30 s.
            deadline = time.monotonic() + 30
            p = psutil.Process(child.pid)
            while sum(p.cpu_times()[:2]) < 0.3:
                assert time.monotonic() < deadline, "the busy child never ran"
                with pytest.raises(subprocess.TimeoutExpired):
                    child.wait(0.05)
    finally:
        child.kill()
        child.wait(10)
    assert blk.own_cpu_s is not None and blk.own_cpu_s >= 0.25
    assert child.pid in mon.seen_pids
    s = mon.summary()
    assert s["blocks"][0]["name"] == "own busy child" and s["threshold_cores"] == 0.25


class _FakeTty(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.wrote = threading.Event()

    def isatty(self) -> bool:
        return True

    def write(self, text: str) -> int:
        n = super().write(text)
        if "still at" in text:
            self.wrote.set()
        return n


def test_progress_ticks_in_long_blocks_on_a_terminal_only():
    tty = _FakeTty()
    p = bench_main.Progress(tty, every_s=0.2)
    p.start_ticker()
    try:
        p("a long block")
        assert tty.wrote.wait(20), tty.getvalue()
    finally:
        p.stop()
    assert "still at: a long block" in tty.getvalue()
    pipe = io.StringIO()
    q = bench_main.Progress(pipe, every_s=0.2)
    q.start_ticker()
    assert q._ticker is None  # nothing periodic when not a terminal
    q("x")
    q.stop()
    assert pipe.getvalue().count("\n") == 1


# -- whole runs in a process of their own ------------------------------------------------

SHM_NAME = re.compile(r"^(?:sem\.)?shmc\w*-(\d+)-")
TINY_RUN = ["--configs", "inproc", "--models", "mock", "--only", "latency", "--samples", "5",
            "--rounds", "1", "--warmup", "0", "--no-plots"]  # fmt: skip


class BenchProc:
    """``python -m shmclient_bench ARGS`` in a child process with a private TMPDIR; stderr lines are
    collected by a reader thread, the run's processes by polling while waiting."""

    def __init__(self, args: list[str], cwd: str, tmpdir: str) -> None:
        env = dict(os.environ, TMPDIR=tmpdir, PYTHONUNBUFFERED="1")
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "shmclient_bench", *args], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.lines: queue.Queue[str] = queue.Queue()
        self.err: list[str] = []
        self.out: list[str] = []
        self.procs: dict[int, psutil.Process] = {}
        self._readers = [
            threading.Thread(target=self._read_err, daemon=True),
            threading.Thread(target=self._read_out, daemon=True),
        ]
        for t in self._readers:
            t.start()

    def _read_err(self) -> None:
        for line in self.proc.stderr:
            self.err.append(line)
            self.lines.put(line)

    def _read_out(self) -> None:
        self.out.append(self.proc.stdout.read())

    def _poll(self) -> None:
        try:
            me = psutil.Process(self.proc.pid)
            for p in [me, *me.children(recursive=True)]:
                self.procs.setdefault(p.pid, p)
        except psutil.Error:
            pass

    def wait_line(self, needle: str, timeout: float = 90) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._poll()
            try:
                line = self.lines.get(timeout=0.05)
            except queue.Empty:
                assert self.proc.poll() is None, f"exited before {needle!r}: {''.join(self.err)}"
                continue
            if needle in line:
                return line
        raise AssertionError(f"no line with {needle!r} in {timeout} s: {''.join(self.err)}")

    def finish(self, timeout: float = 120) -> tuple[int, str, str]:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise
        finally:
            for t in self._readers:
                t.join(10)
            self.proc.stdout.close()
            self.proc.stderr.close()
        return self.proc.returncode, "".join(self.out), "".join(self.err)

    def alive(self) -> list[psutil.Process]:
        out = []
        for p in self.procs.values():
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
            except psutil.Error:
                pass
        return out


@pytest.fixture
def short_tmp():
    """A private TMPDIR for a run, short enough for the unix sockets made inside it."""
    import shutil
    import tempfile

    path = tempfile.mkdtemp(prefix="bt-", dir="/tmp")
    try:
        yield pathlib.Path(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_two_concurrent_runs_write_two_folders(tmp_path, short_tmp):
    tmp = short_tmp
    runs = [BenchProc(TINY_RUN, str(tmp_path), str(tmp)) for _ in range(2)]
    results = [r.finish() for r in runs]
    for rc, _, err in results:
        assert rc == 0, err
    folders = sorted(os.listdir(tmp_path / "results"))
    assert len(folders) == 2, folders
    for f in folders:
        assert _load(str(tmp_path / "results" / f))["latency"]["inproc"]["summary"]["n"] == 5
    assert not os.listdir(tmp)


# Idle settles 2 s: a signal up to 1.5 s after "starting sync-shm" still lands in the
# client sections, one after "tensors: running" or "ring: running" in those sections
# (runs interrupted there settle idle briefly: only the sections' order matters).
INTERRUPT_RUN = ["--quick", "--configs", "inproc,sync-shm", "--models", "mock", "--only",
                 "latency,idle,tensors,ring", "--samples", "20", "--rounds", "2", "--warmup", "2",
                 "--idle-settle", "2.0", "--idle-window", "0.5"]  # fmt: skip


@pytest.mark.parametrize(
    "sig, after, during",
    [
        ("SIGINT", "starting sync-shm", "latency/idle"),
        ("SIGINT", "tensors: running", "tensors"),
        pytest.param("SIGTERM", "tensors: running", "tensors", marks=pytest.mark.slow),
        pytest.param("SIGINT", "ring: running", "ring", marks=pytest.mark.slow),
        pytest.param("SIGTERM", "idle CPU:", "latency/idle", marks=pytest.mark.slow),
    ],
)
def test_interrupt_stops_everything_and_keeps_what_finished(tmp_path, short_tmp, sig, after, during):
    seed = random.randrange(1 << 30)
    delay = random.Random(seed).uniform(0.0, 1.5)  # a random point after the line
    tmp = short_tmp
    out = tmp_path / "res"
    brief_idle = ["--idle-settle", "0.2", "--idle-window", "0.2"] if during != "latency/idle" else []
    run = BenchProc([*INTERRUPT_RUN, *brief_idle, "--out", str(out)], str(tmp_path), str(tmp))
    try:
        run.wait_line(after)
        t_end = time.monotonic() + delay
        while time.monotonic() < t_end:
            run._poll()
            assert run.proc.poll() is None, f"seed {seed}: the run ended first: {''.join(run.err)}"
            try:
                run.proc.wait(0.05)
            except subprocess.TimeoutExpired:
                pass
        run._poll()
        run.proc.send_signal(getattr(signal, sig))
        rc, stdout, err = run.finish(timeout=90)
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
            run.finish()
    ctx = f"seed {seed}, delay {delay:.2f} s: {err}"
    assert rc == 130, ctx
    assert "Traceback" not in err, ctx
    said = [line for line in err.splitlines() if "interrupted" in line]
    assert len(said) == 1 and f"interrupted ({sig}) during {during}" in said[0], ctx
    assert stdout == "", ctx
    # No process of the run is left, nothing in /dev/shm or the temporary folder.
    deadline = time.monotonic() + 10
    while run.alive() and time.monotonic() < deadline:
        psutil.wait_procs(run.alive(), timeout=0.5)
    left = run.alive()
    for p in left:
        p.kill()
    assert not left, f"{ctx}\nleft: {[(p.pid, p.cmdline()) for p in left]}"
    pids = set(run.procs) | {run.proc.pid}
    shm = [n for n in os.listdir("/dev/shm") if (m := SHM_NAME.match(n)) and int(m.group(1)) in pids]
    assert not shm, ctx
    assert not os.listdir(tmp), ctx
    # The results folder holds what finished.
    data = _load(str(out))
    assert data["interrupted"] == {"signal": sig, "during": during}, ctx
    if during in ("tensors", "ring"):
        assert data["latency"]["sync-shm"]["summary"]["n"] == 20
        assert "sync-shm" in data["idle_cpu"]
        assert os.path.exists(out / "samples.json")
        if _has_matplotlib():
            assert os.path.exists(out / "latency_cdf_mock.png")
        assert ("tensors" in data) == (during == "ring"), ctx
    assert "ring" not in data


def test_a_busy_process_started_half_way_marks_the_run_noisy(tmp_path, short_tmp):
    tmp = short_tmp
    out = tmp_path / "res"
    run = BenchProc(
        ["--configs", "sync-shm", "--models", "mock", "--only", "latency,idle", "--samples", "50",
         "--rounds", "2", "--warmup", "2", "--idle-settle", "1.0", "--idle-window", "1.0",
         "--no-plots", "--out", str(out)],
        str(tmp_path), str(tmp),
    )  # fmt: skip
    busy = None
    try:
        run.wait_line("idle CPU:")  # the latency blocks are done: half-way
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # not the run's
        rc, stdout, err = run.finish()
    finally:
        if busy is not None:
            busy.kill()
            busy.wait(10)
        if run.proc.poll() is None:
            run.proc.kill()
            run.finish()
    assert rc == 0, err
    data = _load(str(out))
    assert data["load"]["noisy"] is True
    idle = [b for b in data["load"]["blocks"] if b["name"] == "idle"]
    assert len(idle) == 1 and idle[0]["noisy"] is True and idle[0]["other_cores"] >= 0.5, idle
    assert data["idle_cpu"]["sync-shm"]["noisy"] is True
    assert stdout.splitlines()[0].startswith("NOISY RUN"), stdout
    assert "noisy" in err


def test_the_vllm_sections_busy_processes_are_pinned_one_to_each_cpu():
    """Left to the scheduler, where the busy processes land beside vLLM's pinned worker
    decides the step time; pinned, both transports see the same placement."""
    from shmclient_bench.vllm import _pinned_busy

    cpus = sorted(os.sched_getaffinity(0))
    hogs = _pinned_busy(len(cpus) + 1)
    try:
        got = [os.sched_getaffinity(h.pid) for h in hogs]
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    assert got == [{c} for c in cpus] + [{cpus[0]}]


def test_the_vllm_dp_table_judges_hop_ttft_and_tpot_against_stock():
    from shmclient_bench.vllm import _dp_table
    from shmclient_bench.vllm_results import ConfigFigures, DataParallel, Percentiles

    def cfg(hop: float, ttft: float, tpot: float) -> ConfigFigures:
        return ConfigFigures(hop_us=Percentiles(n=1, p50=hop, p90=hop, p99=hop),
                             ttft_ms={1: Percentiles(n=1, p50=ttft), 16: Percentiles(n=1, p50=ttft)},
                             tpot_ms={1: Percentiles(n=1, p50=tpot), 16: Percentiles(n=1, p50=tpot)},
                             hops_sample_us=[])

    met = _dp_table(DataParallel(engines=2, configs={"async-stock": cfg(1000, 10, 9), "async-shm": cfg(250, 9, 9)}))
    assert met[-1] == ("async: shm / stock: hop p50 0.25x, TTFT p50 0.90x / 0.90x, TPOT p50 1.00x (1 stream) "
                       "/ 1.00x (16): target met")
    slow = _dp_table(DataParallel(engines=2, configs={"async-stock": cfg(1000, 10, 9),
                                                      "async-shm": cfg(250, 9, 9.5)}))
    assert slow[-1].endswith("target NOT met")
    both = _dp_table(DataParallel(engines=2, configs={"async-stock": cfg(1000, 10, 9), "async-shm": cfg(600, 9, 9),
                                                      "async-shm-inline": cfg(300, 9, 9)}))
    assert both[-2].startswith("async: shm / stock: hop p50 0.60x") and both[-2].endswith("target NOT met")
    assert both[-1].startswith("async: shm-inline / stock: hop p50 0.30x") and both[-1].endswith("target met")
    assert _dp_table(None) == []


def test_a_section_run_alone_keeps_its_temporary_files_in_a_folder_it_removes(capsys):
    """``python -m shmclient_bench.<section>``: what the section (and vLLM's ipc sockets
    under it) puts in the temporary folder goes in a folder of its own, removed at the end;
    TMPDIR is as before."""
    import tempfile

    from shmclient_bench import sections

    before = os.environ.get("TMPDIR")
    seen: dict[str, str] = {}

    def run(quick: bool) -> dict:
        seen["tmp"] = os.environ["TMPDIR"]
        seen["gettempdir"] = tempfile.gettempdir()
        with open(os.path.join(tempfile.gettempdir(), "socket-like"), "w") as f:
            f.write("x")
        return {"ok": quick}

    assert sections.section_main(["--quick"], "doc line\n", run, lambda res: str(res), "quick") == 0
    assert seen["tmp"] == seen["gettempdir"] and seen["tmp"] != before
    assert os.path.basename(seen["tmp"]).startswith("bench-section-")
    assert not os.path.exists(seen["tmp"])
    assert os.environ.get("TMPDIR") == before
    assert "{'ok': True}" in capsys.readouterr().out


def test_a_section_run_on_its_own_cleans_up_on_sigterm():
    """``python -m shmclient_bench.contention`` killed with a plain ``kill`` died at
    once, leaving its busy processes spinning (and its temporary folder, and a quota
    cell's cgroup): SIGTERM runs the section's clean-up now, as Ctrl-C does."""
    code = (
        "import os, signal, tempfile\n"
        "from shmclient_bench import sections\n"
        "def run(quick):\n"
        "    print(tempfile.gettempdir(), flush=True)\n"
        "    try:\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "        signal.sigtimedwait([], 10)\n"
        "    finally:\n"
        "        print('cleaned up', flush=True)\n"
        "sections.section_main([], 'doc\\n', run, str, 'quick')\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    tmp, *rest = p.stdout.splitlines()
    assert rest == ["cleaned up"], (p.returncode, p.stdout, p.stderr)
    assert "KeyboardInterrupt" in p.stderr and not os.path.exists(tmp)


def test_a_busy_process_ends_with_the_process_that_started_it():
    """The contention section's busy processes outlived a section child killed with
    SIGKILL (re-parented, spinning for good, the rest of the run measured beside them)."""
    code = ("import time\nfrom shmclient_bench import stopping\n"
            "print(stopping.busy_process().pid, flush=True)\ntime.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        busy = psutil.Process(int(parent.stdout.readline()))
        # Past its start (which checks that its parent is still there): spinning.
        deadline = time.monotonic() + 30
        while busy.cpu_times().user < 0.3:
            assert time.monotonic() < deadline, "the busy process does not spin"
            time.sleep(0.01)  # (polling its CPU time)
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()
    try:
        busy.wait(timeout=30)
    except psutil.TimeoutExpired:
        busy.kill()
        raise AssertionError("the busy process outlived its parent") from None


@pytest.mark.parametrize("left_does", ["sleep", "ignore SIGTERM"])
def test_what_is_left_of_a_group_whose_leader_died_is_stopped(left_does):
    """A section child that died (SIGKILL, the OOM killer) left the processes of its
    group running: they were stopped only while the child itself still ran. One that
    ignores SIGTERM is killed once the grace is over."""
    from shmclient_bench import stopping

    body = ("import time; time.sleep(120)" if left_does == "sleep" else
            "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print(flush=True); time.sleep(120)")
    code = ("import subprocess, sys\n"
            f"p = subprocess.Popen([sys.executable, '-c', {body!r}], stdout=subprocess.PIPE)\n"
            "p.stdout.readline() if %r else None\n"
            "print(p.pid, flush=True)\n") % (left_does != "sleep",)
    leader = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    left = psutil.Process(int(leader.stdout.readline()))
    leader.wait(timeout=30)
    leader.stdout.close()
    try:
        assert left.is_running() and os.getpgid(left.pid) == leader.pid
        # This process is a child subreaper (conftest): the orphan is its child, and its
        # zombie, unreaped, would keep the group alive until the grace ended.
        assert stopping.stop_group_left(leader.pid, grace_s=10 if left_does == "sleep" else 0.2)
        assert not psutil.pid_exists(left.pid), "the group's orphan was not reaped"
        assert not stopping.stop_group_left(leader.pid)
    finally:
        if left.is_running():
            left.kill()


def test_the_vllm_sections_child_keeps_vllms_files_out_of_the_shared_tmp(monkeypatch):
    """The vllm section's child (and the engines it starts) put vLLM's ipc sockets and
    temporary files in the section's own folder, removed with it: run on its own, it
    left one or two sockets per engine in the host's temporary folder."""
    import tempfile

    from shmclient_bench import vllm as vllm_section

    real_popen = subprocess.Popen
    child = ("import os, sys, tempfile\n"
             "d = tempfile.gettempdir()\n"
             "open(os.path.join(d, 'engine.sock'), 'w').close()\n"
             "sys.stderr.write(d + '|' + os.environ.get('VLLM_RPC_BASE_PATH', ''))\n")

    def popen(cmd, **kw):  # the section's own child, standing in for vLLM's engines
        return real_popen([sys.executable, "-c", child], **kw)

    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setattr(vllm_section.subprocess, "Popen", popen)
    result = vllm_section.run(True, ("quiet",))
    tmp, rpc = result.reason.rsplit(": ", 1)[1].split("|")
    assert tmp == rpc and tmp != tempfile.gettempdir()
    assert os.path.dirname(tmp) == tempfile.gettempdir()
    assert not os.path.exists(tmp)


def test_the_vllm_section_run_alone_cleans_up_on_sigterm(tmp_path):
    """``python -m shmclient_bench.vllm`` stopped by SIGTERM (a timeout, a job's stop)
    kills its child's process group and removes its temporary folder with vLLM's sockets
    in it: it used to die at once and leave both."""
    stub = tmp_path / "stub"
    (stub / "vllm").mkdir(parents=True)
    # The child blocks where it would start vLLM's engines; the parent's import returns.
    (stub / "vllm" / "__init__.py").write_text(
        "import os, signal, sys\n"
        "if '--child' in sys.argv:\n"
        "    with open(os.environ['SHMC_TEST_MARK'] + '.tmp', 'w') as f:\n"
        "        f.write(f'{os.getpid()} {os.environ[\"TMPDIR\"]}')\n"
        "    os.rename(os.environ['SHMC_TEST_MARK'] + '.tmp', os.environ['SHMC_TEST_MARK'])\n"
        "    signal.pause()\n")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    mark = tmp_path / "child"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(stub), os.getcwd()]), TMPDIR=str(tmp),
               SHMC_TEST_MARK=str(mark))
    parent = subprocess.Popen([sys.executable, "-m", "shmclient_bench.vllm", "--quick", "--parts", "quiet"],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    child_pid = None
    try:
        deadline = time.monotonic() + 60
        while not mark.exists():
            assert parent.poll() is None, parent.stderr.read()
            assert time.monotonic() < deadline, "the section's child never started"
            time.sleep(0.01)  # polling for a file another process writes
        child_pid, section_tmp = mark.read_text().split(" ", 1)
        child_pid = int(child_pid)
        assert os.path.dirname(section_tmp) == str(tmp) and os.path.isdir(section_tmp)
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(timeout=30) == 130
        assert "interrupted" in parent.stderr.read()
        assert not os.path.exists(section_tmp)
        assert not psutil.pid_exists(child_pid) or psutil.Process(child_pid).status() == psutil.STATUS_ZOMBIE
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if child_pid is not None:
            try:
                os.killpg(child_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_block_too_short_for_the_cpu_counters_is_not_judged_alone():
    """The counters move in 10 ms ticks, allowed as slack (one per CPU and per process):
    a 0.1 s block could not show a quarter of a core over that slack, so it passed as
    quiet with other processes using most of a core. Such a block is left to the whole
    run's window; a long one is judged as before."""
    from shmclient_bench import load, report

    mon = load.LoadMonitor()
    slack = load._TICK_S * ((os.cpu_count() or 1) + 6)
    short = mon._judge(load.Block("short"), (0.0, 0.0, 0.0, 6), (slack, 0.9 * slack, 0.0, 6))
    assert short.too_short and short.noisy is None
    # Beyond the ticks' doubt it is noisy however short (it passed unjudged, and a
    # threshold low enough made every block, and the whole run, "quiet").
    burst = mon._judge(load.Block("burst"), (0.0, 0.0, 0.0, 6), (slack, 3 * slack, 0.0, 6))
    assert burst.noisy is True and not burst.too_short
    long_s = 4 * slack / mon.threshold_cores
    busy = mon._judge(load.Block("long"), (0.0, 0.0, 0.0, 6), (long_s, 0.5 * long_s, 0.0, 6))
    assert not busy.too_short and busy.noisy is True
    quiet = mon._judge(load.Block("quiet"), (0.0, 0.0, 0.0, 6), (long_s, 0.0, 0.0, 6))
    assert quiet.noisy is False
    assert report._noisy_cell({"noisy_blocks": 0, "blocks": 3, "judged": 0}) == "-"
    assert report._noisy_cell({"noisy_blocks": 1, "blocks": 3, "judged": 2}) == "1/2"


def test_quantiles_interpolate_as_the_summaries_do():
    from shmclient_bench.stats import quantile, summarize

    xs = list(range(1, 101))
    assert quantile(xs, 0.5) == 50.5 and quantile(xs, 0.99) == pytest.approx(99.01)
    assert quantile(xs, 0.99) == pytest.approx(summarize([x * 1000 for x in xs])["p99"])
    assert quantile([3.0], 0.99) == 3.0
    with pytest.raises(ValueError):
        quantile([], 0.5)
