"""``shmclient_bench.vllm_hop_trace``: matching the engine's and the frontend's records of
a batch, the table, and (with vLLM) a traced run that leaves nothing behind."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import tempfile

import pytest

from shmclient_bench import vllm_hop_trace as trace


def test_records_are_matched_by_stamp_and_a_held_back_wake_is_the_next_one_given():
    s = 1000.0
    u = 1e-6
    writes = {
        s: (s + 10 * u, s + 20 * u, True),  # woke with its write
        s + 1: (s + 1 + 12 * u, s + 1 + 18 * u, False),  # held back: the next wake-up given
        s + 2: (s + 2 + 11 * u, s + 2 + 50 * u, True),
        s + 3: (s + 3 + 5 * u, s + 3 + 9 * u, True),
    }
    wakes = [s + 1 - 1e-3, s + 1 + 100 * u, s + 1 + 300 * u]  # the first is before the write
    front = [
        (s, s + 30 * u, s + 35 * u, s + 45 * u, 1),
        (s + 1, s + 1 + 130 * u, s + 1 + 140 * u, s + 1 + 150 * u, 1),
        (s + 2, s + 2 + 60 * u, s + 2 + 65 * u, s + 2 + 70 * u, 1),
        (s + 3, 0.0, s + 3 + 30 * u, s + 3 + 40 * u, 3),  # returned without waiting
        (s + 5, s + 5, s + 5, s + 5, 1),  # no engine record: left out
    ]
    got = trace.summarise(writes, wakes, front)
    one = got["1 output"]
    assert one["batches"] == 3 and one["held back"] == 1

    def us(moment):
        return tuple(round(v, 3) for v in one["us"][moment])

    assert us("write start") == (11, 12)
    assert us("write end") == (20, 50)
    assert us("wake-up given") == (50, 100)  # the held-back one's is the wake-up after its write
    assert us("frontend woke") == (60, 130)
    assert us("frontend read") == (65, 140)
    assert us("get_output returned") == (70, 150)
    several = got["several"]
    assert several["batches"] == 1 and several["held back"] == 0
    assert several["us"]["frontend woke"] is None and several["us"]["get_output returned"][0] == pytest.approx(40)
    table = trace.format_table({"adaptive": got})
    assert "| adaptive, 1 output | 3 | 1 | 11 / 12 | 20 / 50 | 50 / 100 | 60 / 130 | 65 / 140 | 70 / 150 |" in table
    assert "| adaptive, several | 1 | 0 | 5 / 5 | 9 / 9 | 9 / 9 | - | 30 / 30 | 40 / 40 |" in table


def test_an_owed_wake_never_given_leaves_the_moment_out():
    got = trace.summarise({1.0: (1.0, 1.0001, False)}, [], [(1.0, 1.0002, 1.00025, 1.0003, 1)])
    assert got["1 output"]["us"]["wake-up given"] is None


def test_the_engine_hooks_are_installed_only_with_the_trace_folder_named():
    code = ("import shmclient.vllm.engine_outputs as eo; send = eo._InlineOutputs.send; "
            "import shmclient_bench.vllm_hop_trace; print(eo._InlineOutputs.send is send)")
    env = {k: v for k, v in os.environ.items() if k != trace.TRACE_ENV}
    plain = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    with tempfile.TemporaryDirectory() as folder:
        hooked = subprocess.run([sys.executable, "-c", code], env={**env, trace.TRACE_ENV: folder},
                                capture_output=True, text=True, timeout=60)
    assert plain.stdout.split() == ["True"], plain.stderr
    assert hooked.stdout.split() == ["False"], hooked.stderr


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_a_traced_run_matches_batches_and_leaves_no_files(tmp_path):
    from .conftest import importorskip_vllm
    importorskip_vllm()  # an error, not a skip, under SHMCLIENT_REQUIRE_VLLM=1
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "shmc-hop-trace-*")))
    out = tmp_path / "trace.json"
    run = subprocess.run([sys.executable, "-m", "shmclient_bench.vllm_hop_trace", "--modes", "inline,adaptive",
                          "--clients", "sync,async", "--rounds", "1", "--json", str(out)],
                         capture_output=True, text=True, timeout=540)
    assert run.returncode == 0, run.stderr[-3000:]
    import json

    got = json.loads(out.read_text())
    assert set(got) == {"inline, sync", "adaptive, sync", "inline, async", "adaptive, async"}
    for key, kinds in got.items():
        one = kinds["1 output"]
        # 4 one-stream requests of 64 tokens a round (the warm-up's batches are of 16).
        assert one["batches"] >= 200, key
        if key.startswith("inline"):
            assert one["held back"] == 0, key
        for moment in trace.MOMENTS:
            assert one["us"][moment] is not None, (key, moment)
    assert "| inline, sync, 1 output |" in run.stdout and "| adaptive, async, 1 output |" in run.stdout
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "shmc-hop-trace-*"))) == before
