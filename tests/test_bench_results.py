"""The sections' typed results: each comes back from a section's output file as its own
type (``shmclient_bench.sections``), encodes to the JSON layout results.json holds,
renders the same table from its JSON form, and a skipped section reads back as skipped.
Made-up figures only: nothing here measures."""

from __future__ import annotations

import json
import sys

import msgspec
import pytest

from shmclient.stats import RingStatistics
from shmclient_bench import contention, dp, fairness, ring, sections, vllm
from shmclient_bench.contention_results import Cell, Contention, RoundTrips
from shmclient_bench.dp_results import (BalanceAlternating, BalancePinned, DpBench, Overhead, Rate,
                                        RequestRate, Settings)
from shmclient_bench.fairness_results import Fairness, Lateness
from shmclient_bench.ring_results import RingBench, RoundTrip, Stream, Throughput, WakePipe
from shmclient_bench.section_results import SectionHost, Skipped, typed
from shmclient_bench.vllm_results import BusyHost, ConfigFigures, Percentiles, VllmComparison


def ring_bench() -> RingBench:
    trip = RoundTrip(ring_p50_us=2.0, ring_p99_us=4.0, zmq_p50_us=20.0, zmq_p99_us=30.0,
                     ratio_p50=10.0, ratio_p99=7.5, round_trips=100)
    return RingBench(
        machine=SectionHost(cpus=2, load_1m=0.25, python="3.11.7"), quick=True, spin_us=30.0,
        round_trip={"64 B": trip, "1 MiB": trip},
        throughput=Throughput(ring_64B_msgs_per_s=2e6, ring_64B_batched64_msgs_per_s=4e6,
                              zmq_64B_msgs_per_s=5e5, ring_1MiB_GBps_zero_copy=40.0,
                              ring_1MiB_GBps_copy_out=20.0, zmq_1MiB_GBps=4.0),
        stream_64B=Stream(messages=1000, msgs_per_s=1.5e6, send_p50_us=0.1, send_p99_us=1.0,
                          send_p9999_us=10.0, send_max_us=100.0, waits_on_full=3, received=1000),
        idle_consumer_cpu_percent=0.5,
        wake_pipe=WakePipe(without_pipe_ns=70.0, with_pipe_ns=80.0, extra_ns_per_batch=10.0),
        ring_stats_after_round_trips=RingStatistics(*range(1, 17)),
    )


def contention_result() -> Contention:
    def cell(shm: float, zmq: float) -> Cell:
        s, z = RoundTrips(shm, shm * 3, 800), RoundTrips(zmq, zmq * 2, 800)
        return Cell(sync_shm=s, sync_zmq=z, async_shm=s, async_zmq=z, wall_s=1.5,
                    sync_target_met=shm <= zmq, async_target_met=False)
    return Contention(cells={"busy_0": cell(50.0, 200.0), "quota_1cpu": cell(90.0, 80.0)},
                      notes=["a note"], machine=SectionHost(cpus=2, load_1m=1.0),
                      all_targets_met=False)


def fairness_result() -> Fairness:
    def late(p50: float, batches: int | None = None) -> Lateness:
        return Lateness(p50_us=p50, p99_us=p50 * 2, max_us=p50 * 10, n=1500, output_batches=batches)
    return Fairness(tick_ms=1.0, step_ms=0.5, loop_alone=late(100.0), shm_idle=late(103.0),
                    shm_busy=late(286.0, 900), zmq_idle=late(135.0), zmq_busy=late(458.0, 800),
                    machine=SectionHost(cpus=2, load_1m=0.5))


def dp_bench() -> DpBench:
    return DpBench(
        settings=Settings(requests=64, max_tokens=16, rounds=2, step_delay_s=0.005, max_num_seqs=8),
        throughput={"async_1_engine": Rate(92.0, 1472.0, (91.0, 93.0)),
                    "dp_lb_2_engines": Rate(184.0, 2944.0, (180.0, 188.0))},
        speedup_2_vs_1_engine=2.0, dp_layer_cost=1.01,
        balance_pinned=BalancePinned(pinned_to_rank_0=1 / 3, request_share=(0.5, 0.5),
                                     token_share=(0.5, 0.5), round_robin_request_share=(2 / 3, 1 / 3),
                                     elapsed_s=1.0),
        balance_alternating=BalanceAlternating(long_tokens=64, short_tokens=2, request_share=(0.5, 0.5),
                                               token_share=(0.49, 0.51),
                                               round_robin_token_share=(64 / 66, 2 / 66), elapsed_s=1.0),
        overhead_no_delay=Overhead(requests=1024, async_1_engine=RequestRate(27851.0, (27851.0,)),
                                   dp_lb_1_engine=RequestRate(27149.0, (27149.0,)),
                                   us_per_request_added=0.9),
        machine=SectionHost(cpus=2, load_1m=0.5),
    )


#: (section, its module, a made-up result, lines its table must hold)
CASES = [
    ("ring", ring, ring_bench, ["      64 B |       2.0       4.0 |      20.0      30.0 |        10.0x   7.5x",
                                "idle consumer: 0.50 % of a core"]),
    ("contention", contention, contention_result, ["note: a note"]),
    ("fairness", fairness, fairness_result, ["              shm busy |     286     572     2860"]),
    ("dp", dp, dp_bench, ["2 engines vs 1: 2.00x; DP layer over AsyncMPClient, 1 engine: 1.01x",
                          "  alternating 64 and 2 tokens: tokens 0.49 / 0.51 (round robin, and vLLM's "
                          "score alone: 0.97 / 0.03), requests 0.50 / 0.50"]),
]


@pytest.mark.parametrize("name, module, make, lines", CASES, ids=[c[0] for c in CASES])
def test_a_sections_result_comes_back_as_its_type_and_renders_the_same(tmp_path, name, module, make, lines):
    result = make()
    table = module.report(result)
    for line in lines:
        assert line in table.splitlines(), table
    path = tmp_path / "out.json"
    path.write_bytes(sections.ENCODER.encode(sections.SectionOutput(result=result, table=table)))
    got = sections.read_output(name, str(path))
    assert type(got.result) is sections.RESULT_TYPES[name] and got.result == result
    assert got.skipped is None and got.table == table
    # Its JSON form (the section's entry of results.json) renders the same table.
    as_json = json.loads(msgspec.json.encode(result))
    assert module.report(as_json) == table


def test_the_ring_and_contention_results_keep_their_json_layout():
    data = json.loads(msgspec.json.encode(ring_bench()))
    assert data["round_trip"]["64 B"]["zmq_p50_us"] == 20.0
    assert data["ring_stats_after_round_trips"]["capacity"] == 1
    assert data["machine"] == {"cpus": 2, "load_1m": 0.25, "python": "3.11.7"}
    cell = json.loads(msgspec.json.encode(contention_result()))["cells"]["busy_0"]
    assert list(cell) == ["sync-shm", "sync-zmq", "async-shm", "async-zmq", "wall_s",
                          "sync_target_met", "async_target_met"]
    fair = json.loads(msgspec.json.encode(fairness_result()))
    assert "output_batches" not in fair["shm_idle"] and fair["shm_busy"]["output_batches"] == 900


def test_a_result_of_the_wrong_shape_is_refused_not_guessed():
    with pytest.raises(msgspec.ValidationError):
        dp.report({"settings": {"requests": 8}})
    with pytest.raises(msgspec.ValidationError):
        typed({"round_trip": {}}, RingBench)
    made = ring_bench()
    assert typed(made, RingBench) is made


def test_every_section_run_in_a_child_has_a_result_type():
    from shmclient_bench import __main__ as bench_main

    assert set(bench_main.EXTERNAL) == set(sections.RESULT_TYPES) == set(sections.RENDERERS)


def test_skipped_encodes_with_its_status():
    assert json.loads(msgspec.json.encode(Skipped("no vLLM"))) == {"status": "skipped", "reason": "no vLLM"}


def vllm_comparison() -> VllmComparison:
    def figures(hop: float, tpot: float) -> ConfigFigures:
        p = Percentiles(n=10, p50=hop, p90=hop * 2, p99=hop * 3, mean=hop)
        t = Percentiles(n=10, p50=tpot, p90=tpot, p99=tpot, mean=tpot)
        return ConfigFigures(hop_us=p, ttft_ms={1: t, 16: t}, tpot_ms={1: t, 16: t},
                             hops_sample_us=[hop, hop * 2])
    quiet = {"sync-stock": figures(200.0, 5.0), "sync-shm": figures(40.0, 5.0),
             "async-stock": figures(200.0, 5.0), "async-shm": figures(56.0, 5.0)}
    return VllmComparison(vllm_version="0.11", rounds=2, tokens=32, streams=[1, 16], model={"model_type": "llama"},
                          configs=quiet, passes=1, load_before=(1.25, 1.0, 0.5), load_after=(1.5, 1.0, 0.5),
                          busy=BusyHost(processes=2, configs=quiet))


def test_the_vllm_sections_result_and_its_skip_come_back_typed(tmp_path):
    """The figures as a VllmComparison (stream counts as keys, "1" and "16" in the JSON),
    the same table from their JSON form; a skipped section as Skipped, which
    SectionOutput.skipped reports."""
    path = tmp_path / "out.json"
    for value in (vllm_comparison(), Skipped("vLLM is not installed (none here)")):
        table = vllm.format_table(value)
        path.write_bytes(sections.ENCODER.encode(sections.SectionOutput(result=value, table=table)))
        got = sections.read_output("vllm", str(path))
        assert got.result == value and type(got.result) is type(value) and got.table == table
        assert vllm.format_table(json.loads(msgspec.json.encode(value))) == table
    assert got.skipped == "vLLM is not installed (none here)"
    assert table == "vllm: skipped: vLLM is not installed (none here)"
    measured = vllm.format_table(vllm_comparison()).splitlines()
    assert "| sync-shm | 40 | 80 | 120 | 5.00 / 5.00 | 5.00 / 5.00 |" in measured
    assert "sync: shm output hop p50 = 0.20 x stock (target <= 0.25)" in measured
    assert "async: shm output hop p50 = 0.28 x stock (target <= 0.3)" in measured
    assert "sync: shm / stock: hop p50 0.20x, TPOT p50 1.00x (1 stream) / 1.00x (16): target met" in measured
    data = json.loads(msgspec.json.encode(vllm_comparison()))
    assert data["status"] == "measured" and set(data["configs"]["sync-shm"]["ttft_ms"]) == {"1", "16"}
    assert "dp" not in data


def test_an_old_skip_without_its_status_is_refused():
    """Before the typed results a skipped section was {"skipped": why}: not a result now."""
    with pytest.raises(msgspec.ValidationError):
        vllm.format_table({"skipped": "why"})


def test_the_vllm_section_is_skipped_without_vllm(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    got = vllm.run(True)
    assert isinstance(got, Skipped) and got.reason.startswith("vLLM is not installed")


def _made_up_vllm_engines(monkeypatch, hops):
    """``vllm_engines`` with a made-up vLLM module and its passes replaced by made-up
    timings: ``hops(n)`` gives the n-th pass's hop samples (s). Returns the module and the
    list each pass appends its "kind-transport" to."""
    import types

    from shmclient_bench import vllm_engines

    fake = types.ModuleType("vllm")
    fake.__version__ = "0.0-made-up"
    plugins = types.ModuleType("vllm.plugins")
    plugins.load_general_plugins = lambda: None
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setitem(sys.modules, "vllm.plugins", plugins)
    monkeypatch.setenv("SHMCLIENT_VLLM", "0")  # _child sets it; restored afterwards
    calls: list[str] = []

    def timing(kind: str):
        def bench(model, transport, rounds, tokens, engine_kw=None):
            calls.append(f"{kind}-{transport}")
            t = vllm_engines._Timing()
            t.hops += hops(len(calls))
            t.record(1, 0.0, 0.010, 0.010 + 0.002 * (tokens - 1), tokens)
            t.record(16, 0.0, 0.030, 0.030 + 0.004 * (tokens - 1), tokens)
            return t
        return bench

    monkeypatch.setattr(vllm_engines, "_bench_sync", timing("sync"))
    monkeypatch.setattr(vllm_engines, "_bench_async", timing("async"))
    return vllm_engines, calls


def test_the_vllm_child_sums_its_timings_up_by_part(monkeypatch):
    """``_child`` with the engines replaced by made-up timings: each configuration's two
    passes (a full run) merged, summed up per part as percentiles in a VllmComparison."""
    vllm_engines, calls = _made_up_vllm_engines(monkeypatch, lambda n: [100e-6, 300e-6])
    monkeypatch.setattr(vllm_engines, "_pinned_busy", lambda n: [])
    got = vllm_engines._child(False, ("quiet", "dp"))
    assert got.vllm_version == "0.0-made-up" and got.passes == 2 and got.busy is None
    assert len(calls) == 2 * (len(vllm_engines.CONFIGS) + len(vllm_engines.DP_CONFIGS))
    assert list(got.configs) == [f"{k}-{t}" for k, t in vllm_engines.CONFIGS]
    shm = got.configs["sync-shm"]
    assert shm.hop_us.n == 4 and shm.hop_us.p50 == pytest.approx(200.0)  # both passes, in µs
    assert shm.ttft_ms[1].p50 == pytest.approx(10.0) and shm.tpot_ms[16].p50 == pytest.approx(4.0)
    assert got.dp.engines == vllm_engines.DP and set(got.dp.configs) == {"async-stock", "async-shm", "async-shm-inline"}
    back = msgspec.json.decode(msgspec.json.encode(got), type=VllmComparison)
    assert back == got and vllm.format_table(back).startswith(
        "vLLM 0.0-made-up, tiny dummy Llama, 64 tokens a request, 5 rounds x 2 passes; load average")


def _busy_figures(hop: float, tpot1: float, tpot16: float) -> ConfigFigures:
    def p(v: float) -> Percentiles:
        return Percentiles(n=10, p50=v, p90=v, p99=v, mean=v)
    return ConfigFigures(hop_us=p(hop), ttft_ms={1: p(5.0), 16: p(5.0)}, tpot_ms={1: p(tpot1), 16: p(tpot16)},
                         hops_sample_us=[])


def _busy_pair(hop: float, tpot1: float, tpot16: float) -> dict[str, ConfigFigures]:
    """One pair: stock at hop 100 µs and TPOT 10 ms; shm at the given ratios of them."""
    stock, shm = _busy_figures(100.0, 10.0, 10.0), _busy_figures(100.0 * hop, 10.0 * tpot1, 10.0 * tpot16)
    return {"sync-stock": stock, "sync-shm": shm, "async-stock": stock, "async-shm": shm}


def _busy_line(pairs: list[dict[str, ConfigFigures]]) -> str:
    merged = _busy_pair(1.0, 1.0, 1.0)  # the merged passes: the verdict must not come from these
    lines = vllm._busy_table(BusyHost(processes=2, configs=merged, pairs=pairs))
    return next(line for line in lines if line.startswith("sync:"))


def test_the_busy_cell_is_judged_on_the_median_of_the_pairs_ratios():
    """Each pair's shm / stock ratio, the median over the pairs against the target, and
    where a median is above 1: "no difference shown" when the pairs lie on both sides of
    1, "above 1 in every pair" when none is at or below it."""
    met = _busy_line([_busy_pair(0.6, 0.9, 1.2), _busy_pair(0.5, 1.1, 0.95), _busy_pair(0.7, 0.95, 0.9)])
    assert met == ("sync: shm / stock, median over 3 pairs: hop p50 0.60x, TPOT p50 0.95x (1 stream) / 0.95x (16) "
                   "(pairs: hop 0.50-0.70, TPOT 1 0.90-1.10, TPOT 16 0.90-1.20): target met")
    mixed = _busy_line([_busy_pair(0.6, 0.9, 1.0), _busy_pair(0.6, 1.2, 1.0), _busy_pair(0.6, 1.1, 1.0)])
    assert mixed.endswith("target NOT met: TPOT (1 stream) no difference shown (pairs 0.90-1.20)")
    slower = _busy_line([_busy_pair(1.3, 1.05, 1.0), _busy_pair(1.2, 1.1, 1.0)])
    assert "median over 2 pairs: hop p50 1.25x, TPOT p50 1.08x" in slower
    assert slower.endswith("target NOT met: hop above 1 in every pair (1.20-1.30); "
                           "TPOT (1 stream) above 1 in every pair (1.05-1.10)")
    # Without pairs (a result written before they were kept) the merged passes decide.
    old = vllm._busy_table(BusyHost(processes=2, configs=_busy_pair(0.5, 1.2, 0.9)))
    assert "sync: shm / stock: hop p50 0.50x, TPOT p50 1.20x (1 stream) / 0.90x (16): target NOT met: " \
           "TPOT (1 stream) above 1 in every pair (1.20-1.20)" in old


def test_the_vllm_childs_busy_part_runs_in_pairs_of_alternating_order(monkeypatch):
    """``_child`` with made-up timings: the busy part runs ``busy_pairs`` pairs, each one
    pass of every configuration, the order reversed from one pair to the next; each
    pair's figures are kept (without hop samples) beside the merged ones, and survive
    the JSON round trip."""
    vllm_engines, calls = _made_up_vllm_engines(monkeypatch, lambda n: [100e-6 * n])  # a hop per pass
    hogs: list[int] = []
    monkeypatch.setattr(vllm_engines, "_pinned_busy", lambda n: hogs.append(n) or [])
    got = vllm_engines._child(True, ("busy",), busy_pairs=3)
    forward = [f"{k}-{t}" for k, t in vllm_engines.BUSY_CONFIGS]
    assert calls == forward + forward[::-1] + forward
    assert hogs == [vllm_engines.BUSY] * 12 and got.configs == {}
    assert len(got.busy.pairs) == 3 and all(list(p) == forward for p in got.busy.pairs)
    # The second pair's sync-stock was the 8th pass: hop 800 µs.
    assert got.busy.pairs[1]["sync-stock"].hop_us.p50 == pytest.approx(800.0)
    assert got.busy.pairs[1]["sync-stock"].hops_sample_us == []
    assert got.busy.configs["sync-stock"].hop_us.n == 3  # merged over the three passes
    back = msgspec.json.decode(msgspec.json.encode(got), type=VllmComparison)
    assert back == got
    assert vllm.format_table(back).splitlines()[0] == \
        "vLLM 0.0-made-up, tiny dummy Llama, 32 tokens a request, busy part 2 rounds x 3 pairs of passes"
    assert vllm_engines._child(True, ("busy",)).busy.pairs.__len__() == vllm_engines.BUSY_PAIRS[True]


def test_the_vllm_title_of_a_run_with_no_part_ends_with_the_request_size():
    """No configuration measured (every part skipped): the title names the version and the
    request size, without a dangling separator."""
    empty = VllmComparison(vllm_version="0.0-made-up", rounds=2, tokens=32, streams=[1], model={},
                           configs={}, passes=2, load_before=(), load_after=())
    assert vllm.format_table(empty).splitlines()[0] == \
        "vLLM 0.0-made-up, tiny dummy Llama, 32 tokens a request"


def test_the_quota_cell_warms_up_until_the_spin_gates_can_have_seen_the_quota(monkeypatch):
    """The 1-CPU quota cell measured at once after its processes entered the cgroup:
    each spin gate reads the quota again at most once a second, so most of the cell
    (~0.8 s in a quick run) measured waiters spinning as if there were no quota. It
    warms up for QUOTA_SETTLE_S first; the other cells warm up once."""
    clock = [0.0]
    monkeypatch.setattr(contention.time, "monotonic", lambda: clock[0])

    class Fake:
        def __init__(self) -> None:
            self.warm_blocks = 0

        def latency_block(self, n: int, warmup: int) -> list[int]:
            clock[0] += 0.1
            if n == 3:  # a warm-up block
                self.warm_blocks += 1
            return [1000] * n

    def warm_blocks(settle_s: float) -> int:
        sessions = {k: Fake() for k in contention.KINDS}
        contention._cell(sessions, 5, 2, 3, settle_s=settle_s)
        counts = {s.warm_blocks for s in sessions.values()}
        assert len(counts) == 1
        return counts.pop()

    assert warm_blocks(0.0) == 1
    assert contention.QUOTA_SETTLE_S > 1.0  # (the gate's quota period, GATE_QUOTA_S)
    assert warm_blocks(contention.QUOTA_SETTLE_S) * len(contention.KINDS) * 0.1 >= contention.QUOTA_SETTLE_S
