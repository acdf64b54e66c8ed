"""The benchmark's own tests: statistics, configuration parsing, files, and tiny runs of
the client sections (very small counts, no timing assertions)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from bench import __main__ as bench_main
from bench import clients, report

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
    s = report.summarize([i * 1000 for i in range(100, 0, -1)])
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
    one = report.summarize([2500])
    assert one["n"] == 1 and one["p50"] == one["p99.9"] == one["min"] == pytest.approx(2.5)
    assert one["std"] == 0.0
    ns = report.summarize([10, 20, 30], unit="ns")
    assert ns["p50"] == 20.0 and ns["unit"] == "ns"
    empty = report.summarize([])
    assert empty["n"] == 0 and empty["p50"] is None and empty["mean"] is None


def test_overhead_ratio_and_latency_ratios():
    assert report.overhead_ratio(30.0, 110.0, 10.0) == pytest.approx(0.2)
    assert report.overhead_ratio(30.0, 10.0, 10.0) is None  # zmq adds nothing
    assert report.overhead_ratio(None, 110.0, 10.0) is None

    def entry(p50: float) -> dict:
        return {"summary": {"p50": p50}}

    lat = {
        "inproc": entry(10.0),
        "sync-shm": entry(20.0),
        "sync-zmq": entry(110.0),
        "async-shm": entry(40.0),
        "async-zmq": entry(130.0),
        "inproc@tiny": entry(500.0),
        "sync-shm@tiny": entry(510.0),
        "sync-zmq@tiny": entry(600.0),
    }
    r = report.latency_ratios(lat)
    assert set(r) == {"sync", "async", "sync@tiny"}
    assert r["sync"]["ratio"] == pytest.approx(0.10) and r["sync"]["met"] is True
    assert r["async"]["ratio"] == pytest.approx(0.25) and r["async"]["met"] is True
    assert r["sync"]["target"] == 0.15 and r["async"]["target"] == 0.25
    assert r["sync@tiny"]["ratio"] == pytest.approx(0.10) and r["sync@tiny"]["model"] == "tiny"
    assert r["sync@tiny"]["target"] is None and r["sync@tiny"]["met"] is None


def test_baseline_of():
    assert report.baseline_of("sync-shm") == "sync-zmq"
    assert report.baseline_of("async-shm@tiny") == "async-zmq@tiny"
    assert report.baseline_of("inproc") == "sync-zmq"
    assert report.baseline_of("async-zmq") == "async-zmq"


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
    f = report.machine_facts()
    for k in ("date", "cpu_model", "cpu_count_logical", "python", "packages", "gpu"):
        assert k in f
    for p in ("torch", "numpy", "msgspec", "pyzmq", "posix_ipc"):
        assert p in f["packages"]
    assert f["packages"]["numpy"] == np.__version__
    json.dumps(f)


def test_write_json_is_strict_json(tmp_path):
    path = report.write_json(
        str(tmp_path / "x.json"), {"a": np.float64(1.5), "b": {1, 2}, "c": float("nan"), 3: (1,)}
    )
    with open(path) as f:
        data = json.load(f)
    assert data == {"a": 1.5, "b": [1, 2], "c": None, "3": [1]}


@pytest.mark.skipif(not _has_matplotlib(), reason="matplotlib not installed")
def test_plot_latency_cdf_writes_png(tmp_path):
    rng = np.random.default_rng(0)
    out = report.plot_latency_cdf(
        {"a": rng.integers(10_000, 50_000, 200), "b": rng.integers(50_000, 200_000, 200)},
        str(tmp_path / "cdf.png"),
    )
    assert out == str(tmp_path / "cdf.png")
    with open(out, "rb") as f:
        assert f.read(8) == PNG_MAGIC


@pytest.mark.skipif(not _has_matplotlib(), reason="matplotlib not installed")
def test_transfer_series_and_plot(tmp_path):
    data = {
        "shm": [{"size_bytes": 1 << k, "p50_us": 2.0 * (k + 1)} for k in range(10, 14)],
        "zmq": [{"nbytes": 1 << k, "p50_ns": 9000.0 * (k + 1)} for k in range(10, 14)],
    }
    series = report.transfer_series(data)
    assert set(series) == {"shm", "zmq"}
    assert series["zmq"][0] == (1024.0, pytest.approx(99.0))
    nested = {
        "host": {"cpus": 2},
        "memcpy": {"4096": {"np_copyto": {"median_us": 1.0}}, "65536": {"np_copyto": {"median_us": 3.0}}},
        "shm_view": {"4096": {"median_us": 5.0, "p99_us": 9.0, "n": 3}},
    }
    assert report.transfer_series(nested) == {
        "memcpy np_copyto": [(4096.0, 1.0), (65536.0, 3.0)],
        "shm_view": [(4096.0, 5.0)],
    }
    out = report.plot_transfer(series, str(tmp_path / "t.png"))
    with open(out, "rb") as f:
        assert f.read(8) == PNG_MAGIC
    assert report.plot_transfer({}, str(tmp_path / "none.png")).startswith("plots skipped")


def test_plots_skipped_with_a_note_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "_pyplot", lambda: None)
    note = report.plot_latency_cdf({"a": [1000, 2000]}, str(tmp_path / "x.png"))
    assert note.startswith("plots skipped") and "matplotlib" in note
    assert report.plot_transfer({"a": [(1.0, 1.0)]}, str(tmp_path / "y.png")) == note
    assert not os.listdir(tmp_path)


def test_format_report_renders_every_section():
    res = {
        "args": {"quick": True},
        "machine": {"date": "d", "cpu_count_logical": 2, "cpu_model": "m", "python": "3"},
        "latency_meta": {"rounds": 2, "warmup": 1},
        "latency": {
            c: {"summary": report.summarize([v * 1000] * 5)}
            for c, v in (("inproc", 10), ("sync-shm", 20), ("sync-zmq", 110))
        },
        "streaming_meta": {"tokens": 4, "rounds": 1},
        "streaming": {
            "sync-shm": {
                "1": {
                    "outputs_per_s": 10.0,
                    "batches": 4,
                    "wall_us_per_batch": 1.0,
                    "gap_us": report.summarize([1000]),
                    "client_cpu_us_per_batch": 2.0,
                }
            }
        },
        "idle_meta": {"settle_s": 1, "window_s": 1},
        "idle_cpu": {"sync-shm": {"client_pct": 0.1, "engine_pct": 0.2, "source": "psutil"}},
        "tensors": {"points": [{"size_bytes": 10, "p50_us": 1.0}]},
        "ring": {"shm": {"p50_us": 2.0}},
        "skipped": ["something: why"],
    }
    res["latency_ratios"] = report.latency_ratios(res["latency"])
    text = report.format_report(res)
    for needle in ("sync-shm", "0.10", "(shm - inproc) / (zmq - inproc)", "Idle CPU", "Streaming",
                   "Tensor transfer", "ring", "something: why"):
        assert needle in text, needle


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
