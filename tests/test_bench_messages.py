"""The benchmark's messages say what to do and what a figure is: an unknown ``--set`` field
names the closest one, a noisy run does not judge its targets, samples.json says its unit,
every plot has a footer with the date, the machine, the load and what a point is."""

from __future__ import annotations

import json
import re

import pytest

from shmclient_bench import plots, report, results_files, stats
from shmclient_bench import __main__ as bench
from shmclient_bench.tensor_results import TransferPoint


def test_set_with_an_unknown_field_names_the_closest_one(capsys):
    with pytest.raises(ValueError, match=r"no field 'spinus': did you mean 'spin_us'\?"):
        bench._base_config(["spinus=3"])
    with pytest.raises(ValueError, match=r"no field 'bogus': the fields are .*ring_capacity_bytes"):
        bench._base_config(["bogus=1"])
    with pytest.raises(ValueError, match="expected FIELD=VALUE"):
        bench._base_config(["spin_us"])
    assert bench._base_config(["spin_us=3"]).spin_us == 3
    assert bench.main(["--set", "ring_capacity=65536", "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert "--set: EngineConfig has no field 'ring_capacity': did you mean 'ring_capacity_bytes'?" in err


def _summary(p50: float) -> dict:
    return {"n": 10, "unit": "us", "p50": p50, "p99": p50, "p99.9": p50, "mean": p50}


def _results(noisy: bool) -> dict:
    lat = {c: {"summary": _summary(v), "noisy_blocks": 0, "blocks": 1}
           for c, v in (("inproc", 10.0), ("sync-shm", 50.0), ("sync-zmq", 60.0))}
    return {
        "machine": {"date": "2026-12-01T22:00:00", "cpu_count_logical": 2},
        "load": {"noisy": noisy, "noisy_blocks": int(noisy), "blocks_judged": 1,
                 "max_other_cores": 1.5 if noisy else 0.0, "threshold_cores": 0.3},
        "latency": lat,
        "latency_ratios": stats.latency_ratios(lat),  # 0.8: far from the 0.10 target
        "idle_cpu": {"sync-shm": {"client_pct": 5.0, "engine_pct": 0.5, "noisy": False}},
    }


def test_a_noisy_run_does_not_judge_its_targets():
    quiet = report.format_report(_results(noisy=False))
    assert quiet.count("NOT met") == 2 and report.NOT_JUDGED not in quiet
    noisy = report.format_report(_results(noisy=True))
    assert "NOT met" not in noisy, noisy
    assert "target <= 0.10: not judged (noisy)" in noisy
    idle = [line for line in noisy.splitlines() if line.lstrip("| ").startswith("sync-shm")
            and "5.00" in line]
    assert idle and "not judged (noisy)" in idle[0], noisy


def test_a_noisy_block_in_a_quiet_run_is_not_judged_either():
    res = _results(noisy=False)
    res["latency"]["sync-zmq"]["noisy_blocks"] = 1
    res["idle_cpu"]["sync-shm"]["noisy"] = True
    text = report.format_report(res)
    assert "NOT met" not in text and text.count(report.NOT_JUDGED) == 2, text


def test_samples_json_says_its_unit_and_old_files_still_read(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    res = {"latency_samples_ns": {"inproc": [1000, 2500], "sync-shm": [3000]}, "skipped": []}
    files = bench._write_files(res, str(out), no_plots=True)
    with open(files["samples"]) as f:
        data = json.load(f)
    assert data["unit"] == "ns" and "round trip" in data["what"]
    assert data["inproc"] == [1000, 2500]  # the configurations stay top-level keys
    assert results_files.read_samples(files["samples"]) == {"inproc": [1000, 2500], "sync-shm": [3000]}
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"inproc": [7, 8]}))  # a run before the unit was written
    assert results_files.read_samples(str(old)) == {"inproc": [7, 8]}


DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


@pytest.fixture
def footers(monkeypatch):
    """The texts of every figure saved, at saving time."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    saved: list[list[str]] = []
    real = Figure.savefig

    def savefig(self, *args, **kwargs):
        saved.append([t.get_text() for t in self.texts])
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return saved


def _check_footer(texts: list[str], point: str) -> None:
    footer = "\n".join(texts)
    assert DATE.search(footer) and "CPUs" in footer and "load average" in footer, footer
    assert point in footer, footer


def test_every_plot_has_a_footer_with_date_machine_load_and_what_a_point_is(tmp_path, footers):
    from shmclient_bench import vllm

    path = plots.plot_latency_cdf({"inproc": [1000, 2000, 3000]}, str(tmp_path / "cdf.png"))
    assert path.endswith("cdf.png")
    _check_footer(footers[-1], "each point: one request's round trip")
    points = [TransferPoint("shm_view", 4096, 3.0), TransferPoint("shm_view", 65536, 5.0)]
    plots.plot_transfer(points, str(tmp_path / "t.png"))
    _check_footer(footers[-1], "each point: the median transfer time")
    from shmclient_bench.vllm_results import ConfigFigures, Percentiles, VllmComparison

    def figures(hops: list[float]) -> ConfigFigures:
        return ConfigFigures(hop_us=Percentiles(n=len(hops)), ttft_ms={}, tpot_ms={}, hops_sample_us=hops)

    results = VllmComparison(
        vllm_version="0", rounds=1, tokens=2, streams=[1], model={}, passes=1,
        configs={"sync-stock": figures([40.0, 50.0, 60.0]), "sync-shm": figures([10.0, 12.0])},
        load_before=(0.25, 0.2, 0.1), load_after=(0.25, 0.2, 0.1))
    assert vllm.plot(results, str(tmp_path / "vllm_hop_cdf.png"))
    _check_footer(footers[-1], "each point: one output batch")
    assert "load average 0.25" in "\n".join(footers[-1])
    # A run's own label (run_label) is used where there is one.
    plots.plot_latency_cdf({"inproc": [1000]}, str(tmp_path / "c2.png"),
                            label="2026-12-01 22:00:00 · host · 2 CPUs · load average 0.10 -> 0.20")
    assert "2026-12-01 22:00:00 · host · 2 CPUs" in "\n".join(footers[-1])
