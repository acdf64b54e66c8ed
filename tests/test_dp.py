"""Data-parallel clients: routing, balance, aborts, utilities, death of one engine.

Each test builds its own client (two mock engines start in about a second); the autouse
``no_leaks`` fixture checks that no process, thread or /dev/shm entry survives. The
routing score is also tested without engines, on a client whose state is set by hand.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import select
import signal
import socket
import threading
import time

import pytest

from shmclient import (
    AsyncMPClient,
    ClientClosedError,
    ConfigError,
    DPAsyncMPClient,
    DPLBAsyncMPClient,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineDeadError,
    FinishReason,
    InvalidRequestError,
    PeerNotConsumingError,
    PeerNotProducingError,
    SamplingParams,
    SchedulerStats,
    UtilityCallError,
    make_async_mp_client,
    make_client,
)
from shmclient.config import EngineConfig

from .conftest import sigstop
from .drivers import LoopTurns, add_until_one_parks
from .test_waiting import Stopped

#: Least-loaded routing under a skewed load may put at most this many requests more
#: than its even share on one engine (the share is rounded up; the margin covers a
#: request that finishes while the burst is being routed).
BALANCE_MARGIN = 1


def cfg(**kw) -> EngineConfig:
    kw.setdefault("data_parallel_size", 2)
    kw.setdefault("max_model_len", 512)
    return EngineConfig(model="mock", **kw)


def req(rid: str, max_tokens: int = 4, rank: int | None = None, prompt=(1, 2, 3)) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=rid, prompt_token_ids=list(prompt), data_parallel_rank=rank,
        sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0))


async def collect(client, ids, timeout: float = 20.0) -> dict[str, tuple[list[int], FinishReason, int]]:
    """Run until every id in ``ids`` finished: id -> (tokens, finish reason, engine_index)."""
    want, got, tokens = set(ids), {}, {}
    deadline = time.monotonic() + timeout
    while want - got.keys():
        outs = await asyncio.wait_for(client.get_output_async(), deadline - time.monotonic())
        for o in outs.outputs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                got[o.request_id] = (tokens[o.request_id], o.finish_reason, outs.engine_index)
    return got


# -- selection ---------------------------------------------------------------------------


def test_make_client_selection_follows_vllms_rules():
    # Refused before anything starts.
    with pytest.raises(ConfigError, match="data_parallel_rank=None"):
        make_client(True, True, cfg(data_parallel_external_lb=True))
    with pytest.raises(ConfigError, match="data_parallel_rank=1"):
        make_async_mp_client(cfg(data_parallel_rank=1))
    clients = []
    try:
        clients.append(make_client(True, True, cfg(data_parallel_size=1)))
        assert type(clients[-1]) is AsyncMPClient
        clients.append(make_client(True, True, cfg()))
        assert type(clients[-1]) is DPLBAsyncMPClient and clients[-1].engine_ranks == (0, 1)
        clients.append(make_async_mp_client(cfg(data_parallel_external_lb=True, data_parallel_rank=1)))
        assert type(clients[-1]) is DPAsyncMPClient and clients[-1].engine_ranks == (1,)
        lb = clients[1]
        # Capacity as vLLM reports it: blocks summed, the shortest max_model_len.
        assert lb.num_gpu_blocks == sum(e.num_gpu_blocks for e in lb.engines)
        assert lb.max_model_len == min(e.max_model_len for e in lb.engines) == 512
        assert len(set(lb.engine_pids)) == 2
    finally:
        for c in clients:
            c.shutdown()


def test_engine_core_stamps_its_rank_and_reports_its_load():
    from shmclient_engine.core import EngineCore

    core = EngineCore(cfg(data_parallel_rank=1, num_gpu_blocks=64, max_model_len=256,
                          max_num_seqs=2))
    try:
        for i in range(3):
            core.add_request(req(f"r{i}", max_tokens=3, prompt=range(1, 17)))
        outs = core.step()[0]
        assert outs.engine_index == 1
        s = outs.scheduler_stats
        assert isinstance(s, SchedulerStats)
        # Two run (max_num_seqs=2), one waits; each 16-token prompt holds 1 of the 64
        # blocks of 16 tokens.
        assert (s.num_running_reqs, s.num_waiting_reqs) == (2, 1)
        assert s.kv_cache_usage == pytest.approx(2 / 64)
    finally:
        core.shutdown()
    core0 = EngineCore(cfg(data_parallel_size=1, num_gpu_blocks=64, max_model_len=256))
    try:
        core0.add_request(req("a", max_tokens=1))
        outs = core0.step()[0]
        assert outs.engine_index == 0 and outs.scheduler_stats.num_running_reqs == 0
    finally:
        core0.shutdown()


# -- routing -----------------------------------------------------------------------------


async def test_requests_go_to_the_rank_they_name():
    c = make_client(True, True, cfg(step_delay_s=0.005))
    try:
        ids = [f"r{i}" for i in range(6)]
        for i, rid in enumerate(ids):
            await c.add_request_async(req(rid, rank=i % 2))
        got = await collect(c, ids)
        assert {rid: got[rid][2] for rid in ids} == {rid: i % 2 for i, rid in enumerate(ids)}
        assert c.requests_routed == [3, 3]
        with pytest.raises(InvalidRequestError, match="data_parallel_rank=2"):
            await c.add_request_async(req("bad", rank=2))
        with pytest.raises(InvalidRequestError, match="already live"):
            await c.add_request_async(req("dup", max_tokens=400))
            await c.add_request_async(req("dup"))
        assert c.requests_routed == [4, 3] or c.requests_routed == [3, 4]
        await c.abort_requests_async(["dup"])
        assert (await collect(c, ["dup"]))["dup"][1] is FinishReason.ABORT
        assert c.reqs_in_flight == {} and c.engine_inflight == [0, 0]
    finally:
        c.shutdown()


async def test_least_loaded_routing_evens_out_a_skewed_load():
    """A third of the requests are pinned to engine 0; the balancer sends the free ones
    mostly to engine 1, so that both hold about half (round robin would leave 2/3 on
    engine 0)."""
    c = make_client(True, True, cfg(step_delay_s=0.02))
    try:
        pinned = [f"pin{i}" for i in range(12)]
        free = [f"free{i}" for i in range(24)]
        for rid in pinned:
            await c.add_request_async(req(rid, max_tokens=300, rank=0))
        for rid in free:
            await c.add_request_async(req(rid, max_tokens=300))
        share = -(-(len(pinned) + len(free)) // 2)
        assert max(c.requests_routed) <= share + BALANCE_MARGIN, c.requests_routed
        assert max(c.engine_inflight) <= share + BALANCE_MARGIN, c.engine_inflight
        await c.abort_requests_async(pinned + free)
        got = await collect(c, pinned + free)
        assert all(got[r][2] == 0 for r in pinned)
        assert all(v[1] is FinishReason.ABORT for v in got.values())
    finally:
        c.shutdown()


async def test_requests_and_timeouts_are_checked_as_the_single_engine_client_checks_them():
    """A malformed request gets ``AsyncMPClient``'s InvalidRequestError naming the field
    before routing reads it: nothing is counted in flight and the tie-break rotation does
    not move. ``add_request_async`` takes ``AsyncMPClient``'s ``timeout`` (checked, then
    the engine's wait for room in its request ring); ``get_output_async`` checks its
    ``timeout`` as ``AsyncMPClient``'s does."""
    c = make_client(True, True, cfg(ring_capacity_bytes=4096))
    try:
        sp = lambda **kw: SamplingParams(**{"max_tokens": 2, **kw})  # noqa: E731
        bad = {
            "prompt_token_ids": EngineCoreRequest(request_id="a", prompt_token_ids=5, sampling_params=sp()),
            "sampling_params": EngineCoreRequest(request_id="b", prompt_token_ids=[1],
                                                 sampling_params={"max_tokens": 2}),
            "sampling_params.max_tokens": EngineCoreRequest(request_id="c", prompt_token_ids=[1],
                                                            sampling_params=sp(max_tokens="8")),
            "sampling_params.max_tokens=None": EngineCoreRequest(request_id="d", prompt_token_ids=[1],
                                                                 sampling_params=sp(max_tokens=None)),
        }
        for field, r in bad.items():
            with pytest.raises(InvalidRequestError, match=field.replace(".", r"\.")):
                await c.add_request_async(r)
        for t in (float("nan"), -1, "0.5", True):
            with pytest.raises(InvalidRequestError, match=r"add_request_async\(\): timeout="):
                await c.add_request_async(req("t"), timeout=t)
            with pytest.raises(InvalidRequestError, match=r"get_output_async\(\): timeout="):
                await c.get_output_async(timeout=t)
        assert (c._start, c.requests_routed, c.reqs_in_flight) == (0, [0, 0], {})
        # The timeout reaches the engine's add: a stopped engine's full request ring.
        ids = []
        with Stopped(c.engine_pids[0]):
            for k in range(50):
                r = req(f"f{k}", max_tokens=1, rank=0, prompt=[1000] * 400)
                try:
                    await c.add_request_async(r, timeout=0.05)
                except PeerNotConsumingError:
                    break
                ids.append(r.request_id)
            else:
                pytest.fail("the stopped engine's request ring never filled")
            assert f"f{len(ids)}" not in c.reqs_in_flight
            assert c.engine_inflight == [len(ids), 0] and c.requests_routed == [len(ids), 0]
        await c.add_request_async(req("ok"), timeout=5)
        await c.abort_requests_async(ids)
        got = await collect(c, ids + ["ok"])
        assert got["ok"][1] is FinishReason.LENGTH
    finally:
        c.shutdown()


async def test_a_request_is_checked_once_against_the_limits_of_the_engine_it_names(monkeypatch):
    """A group whose engines differ (ready-made engines: rank 0 takes prompts up to 64
    tokens, rank 1 up to 512): a request that names rank 1 may be longer than rank 0
    takes; one that names no rank is held to the group's limit (any engine may get
    it). A rejected request moves neither the counts nor the rotation. Each request is
    checked once (by the DP client; the engine's client does not check it again)."""
    from shmclient import client_dp, client_mp
    from shmclient.client_dp import engine_config

    config = cfg()
    engines = [AsyncMPClient(engine_config(config, 0).replace(max_model_len=64))]
    try:
        engines.append(AsyncMPClient(engine_config(config, 1)))
    except BaseException:
        engines[0].shutdown()
        raise
    c = DPLBAsyncMPClient(config, engines=engines)
    try:
        assert c.max_model_len == 64
        checks = []
        for mod in (client_dp, client_mp):
            monkeypatch.setattr(mod, "check_request",
                                lambda *a, _f=mod.check_request, **kw: (checks.append(1), _f(*a, **kw))[1])
        long = [7] * 100
        await c.add_request_async(req("pinned", max_tokens=2, rank=1, prompt=long))
        assert len(checks) == 1, f"the request was checked {len(checks)} times"
        for rid, rank in (("free", None), ("to-0", 0)):
            with pytest.raises(InvalidRequestError, match="max_model_len=64"):
                await c.add_request_async(req(rid, rank=rank, prompt=long))
        assert (c._start, c.requests_routed, list(c.reqs_in_flight)) == (0, [0, 1], ["pinned"])
        got = await collect(c, ["pinned"])
        assert got["pinned"][1:] == (FinishReason.LENGTH, 1)
    finally:
        c.shutdown()


async def test_a_request_no_rank_names_is_checked_against_the_sizes_its_engines_have():
    """Ready-made engines whose vocabulary (512) is not the one of the client's config
    (1024): a request naming no rank was checked against the config's only, and the
    engine's client no longer checked it, so a token id outside the engines' vocabulary
    reached an engine (a real model indexes out of range). It is checked against the
    sizes the engines share."""
    from shmclient.client_dp import engine_config

    config = cfg()
    assert config.vocab_size == 1024
    engines = [AsyncMPClient(engine_config(config, 0).replace(vocab_size=512, eos_token_id=2))]
    try:
        engines.append(AsyncMPClient(engine_config(config, 1).replace(vocab_size=512, eos_token_id=2)))
    except BaseException:
        engines[0].shutdown()
        raise
    c = DPLBAsyncMPClient(config, engines=engines)
    try:
        for rid, rank in (("free", None), ("to-1", 1)):
            with pytest.raises(InvalidRequestError, match="vocab"):
                await c.add_request_async(req(rid, rank=rank, prompt=[1, 700]))
        assert (c.requests_routed, list(c.reqs_in_flight)) == ([0, 0], [])
    finally:
        c.shutdown()


class _NoEngine:
    is_dead = False


def _hand_made(n: int) -> DPLBAsyncMPClient:
    """A DPLBAsyncMPClient with routing state only (no engines), to test the score."""
    c = DPLBAsyncMPClient.__new__(DPLBAsyncMPClient)
    c.engines = [_NoEngine()] * n
    c.engine_inflight = [0] * n
    c.engine_work = [0] * n
    c.lb_engines = [SchedulerStats()] * n
    c.reqs_in_flight, c.requests_routed = {}, [0] * n
    c.max_model_len, c.config, c._closed, c._dead_reason = 512, cfg(), False, None
    c._limits, c._group_limits = {}, (512, c.config)
    c._start = 0
    return c


def test_score_follows_the_engines_stats_and_kv_pressure():
    c = _hand_made(2)
    # Engine 0 reports requests of another frontend: the free request goes to engine 1.
    c.lb_engines = [SchedulerStats(num_running_reqs=5), SchedulerStats()]
    assert [c.get_core_engine_for_request(req(f"a{i}")) for i in range(2)] == [1, 1]
    # Waiting requests on a KV-bound engine weigh more than running ones (vLLM's penalty):
    # 4 waiting at 100 % KV use count 4 + 4 * 3 = 16 against 10 running.
    c.lb_engines = [SchedulerStats(num_waiting_reqs=4, kv_cache_usage=1.0),
                    SchedulerStats(num_running_reqs=10, kv_cache_usage=0.2)]
    assert c.get_core_engine_for_request(req("b")) == 1
    # The local in-flight count wins over a stale, lower snapshot.
    c.lb_engines = [SchedulerStats(), SchedulerStats()]
    c.engine_inflight = [3, 1]
    assert c.get_core_engine_for_request(req("c")) == 1
    # Equal loads: the engine with less work (prompt + max_tokens) in flight.
    c.engine_inflight = [2, 2]
    c.engine_work = [400, 10]
    assert c._start == 0  # the rotation alone would pick engine 0
    assert c.get_core_engine_for_request(req("d")) == 1


def test_alternating_long_and_short_requests_do_not_pile_up_on_one_engine():
    """Round robin sends every long request of an alternating burst to the same engine;
    the work tie-break keeps the engines' work within one long request of each other."""
    c = _hand_made(2)
    long_per_engine = [0, 0]
    for i in range(40):
        r = req(f"r{i}", max_tokens=200 if i % 2 == 0 else 2)
        pos, _ = c._route(r)
        long_per_engine[pos] += i % 2 == 0
    assert abs(c.engine_work[0] - c.engine_work[1]) <= 203, c.engine_work
    assert max(long_per_engine) <= 11, long_per_engine
    assert abs(c.requests_routed[0] - c.requests_routed[1]) <= 1


# -- aborts and utilities ----------------------------------------------------------------


async def test_aborts_reach_the_engine_that_owns_the_request():
    c = make_client(True, True, cfg(step_delay_s=0.01))
    try:
        ids = [f"r{i}" for i in range(4)]
        for i, rid in enumerate(ids):
            await c.add_request_async(req(rid, max_tokens=400, rank=i % 2))
        with pytest.raises(InvalidRequestError):
            await c.abort_requests_async("r0")  # a bare str, not a list of ids
        await c.abort_requests_async(ids + ["never-added"])
        got = await collect(c, ids)
        assert {rid: (v[1], v[2]) for rid, v in got.items()} == {
            rid: (FinishReason.ABORT, i % 2) for i, rid in enumerate(ids)}
        assert c.engine_inflight == [0, 0] and not c.dp_engines_running()
    finally:
        c.shutdown()


async def test_utilities_reach_every_engine():
    c = make_client(True, True, cfg())
    try:
        assert await c.call_utility_all_async("echo", {"x": 1}) == [{"x": 1}, {"x": 1}]
        await c.set_weight_version_async("v7")
        assert await c.call_utility_all_async("get_weight_version") == ["v7", "v7"]
        assert await c.get_weight_version_async() == "v7"
        await c.sleep_async(0)
        assert await c.call_utility_all_async("is_scheduler_paused") == [True, True]
        assert await c.wake_up_async() is True
        assert await c.is_sleeping_async() is False
        # Engines that disagree: the common answer does not exist.
        await c.engines[1].call_utility_async("set_weight_version", "other")
        with pytest.raises(UtilityCallError, match="different get_weight_version"):
            await c.get_weight_version_async()
        with pytest.raises(UtilityCallError, match="no_such_method"):
            await c.call_utility_async("no_such_method")
        with pytest.raises(InvalidRequestError):
            await c.call_utility_async("")
        with pytest.raises(PeerNotProducingError):
            await c.get_output_async(timeout=0.05)
    finally:
        c.shutdown()


# -- outputs -----------------------------------------------------------------------------


async def test_same_tokens_as_a_single_engine():
    ids = [f"r{i}" for i in range(10)]
    reqs = lambda: [req(rid, max_tokens=3 + i, prompt=range(i + 1, i + 5))  # noqa: E731
                    for i, rid in enumerate(ids)]
    single = make_client(True, True, cfg(data_parallel_size=1))
    try:
        for r in reqs():
            await single.add_request_async(r)
        want = await collect(single, ids)
    finally:
        single.shutdown()
    c = make_client(True, True, cfg())
    try:
        for r in reqs():
            await c.add_request_async(r)
        got = await collect(c, ids)
    finally:
        c.shutdown()
    assert {k: v[:2] for k, v in got.items()} == {k: v[:2] for k, v in want.items()}
    assert {v[2] for v in got.values()} == {0, 1}  # both engines served


@pytest.mark.parametrize("local", [None, 1])
async def test_external_lb_client_serves_its_own_rank(local):
    """vLLM's external load balancer: each rank's client starts its own engine here,
    with data_parallel_size_local 1 or unset (1 made rank 1 "remote": refused without an
    address, awaited over tcp with one)."""
    c = make_client(True, True, cfg(data_parallel_external_lb=True, data_parallel_rank=1,
                                    data_parallel_size_local=local))
    try:
        await c.add_request_async(req("a"))
        await c.add_request_async(req("b", rank=1))
        with pytest.raises(InvalidRequestError, match="serves rank 1 only"):
            await c.add_request_async(req("c", rank=0))
        got = await collect(c, ["a", "b"])
        assert [v[2] for v in got.values()] == [1, 1]
        assert await c.echo_async(3) == 3
        assert c.num_gpu_blocks == c.engines[0].num_gpu_blocks
    finally:
        c.shutdown()


# -- death and shutdown ------------------------------------------------------------------


async def test_one_engine_killed_fails_everything_pending_and_stops_the_others():
    c = make_client(True, True, cfg(step_delay_s=0.01))
    try:
        for i in range(4):
            await c.add_request_async(req(f"r{i}", max_tokens=400, rank=i % 2))
        await asyncio.wait_for(c.get_output_async(), 10)
        # Waits until the requests drained on every engine: pending on the survivor too.
        util = asyncio.ensure_future(c.pause_scheduler_async("wait"))

        async def drain():
            while True:
                await c.get_output_async()

        getter = asyncio.ensure_future(drain())
        await asyncio.sleep(0)  # let both start waiting
        survivor = os.pidfd_open(c.engine_pids[0])
        os.kill(c.engine_pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        for fut in (util, getter):
            with pytest.raises(EngineDeadError, match="engine 1"):
                await asyncio.wait_for(fut, 2.0)
        assert time.monotonic() - t0 < 2.0
        assert c.is_dead
        with pytest.raises(EngineDeadError):
            await c.add_request_async(req("late"))
        with pytest.raises(EngineDeadError):
            await c.echo_async(1)
        await c.abort_requests_async(["r0"])  # a quiet no-op, as on a dead AsyncMPClient
        # As vLLM: the death of one engine stops the others (readable once it exited).
        try:
            readable, _, _ = await asyncio.to_thread(select.select, [survivor], [], [], 10)
            assert readable, "the surviving engine was not stopped"
        finally:
            os.close(survivor)
    finally:
        c.shutdown()


async def test_the_merged_output_stream_keeps_only_what_is_unread_and_lets_the_loop_turn():
    """Two findings on the merged stream of the engines' batches: a consumer that stayed
    a few batches behind kept every batch it had taken referenced (memory grew with the
    output, not the backlog), and one that found a batch queued at every call never
    let the loop run its other tasks."""
    c = await DPLBAsyncMPClient.create(cfg())
    try:
        for _ in range(3):
            c._take(0, EngineCoreOutputs(engine_index=0))
        for _ in range(100):  # three behind all along
            c._take(1, EngineCoreOutputs(engine_index=1))
            await c.get_output_async(timeout=5)
        assert len(c._outputs) == 3

        for _ in range(100):
            c._take(0, EngineCoreOutputs(engine_index=0))
        counter = LoopTurns().start()
        await asyncio.sleep(0)
        start = counter.turns
        for _ in range(100):
            await c.get_output_async(timeout=5)
            end = time.perf_counter() + 0.0005  # the consumer's own work on a batch
            while time.perf_counter() < end:
                pass
        assert counter.stop() - start >= 50, counter.turns - start
    finally:
        await c.shutdown_async()


async def test_a_batch_queued_at_shutdown_is_not_handed_out_after_it():
    c = await DPLBAsyncMPClient.create(cfg())
    c._take(0, EngineCoreOutputs(engine_index=0))  # read, not taken
    await c.shutdown_async()
    with pytest.raises(EngineDeadError):
        await c.get_output_async(timeout=1.0)


async def test_shutdown_fails_pending_calls_and_is_idempotent():
    c = make_client(True, True, cfg(step_delay_s=0.01))
    await c.add_request_async(req("r", max_tokens=400))
    getter = asyncio.ensure_future(c.get_output_async())
    util = asyncio.ensure_future(c.pause_scheduler_async("wait"))
    await asyncio.sleep(0)
    c.shutdown()
    c.shutdown()
    for fut in (getter, util):
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(fut, 2.0)
    with pytest.raises(EngineDeadError):
        await c.add_request_async(req("late"))


async def test_a_blocking_shutdown_in_the_loop_leaves_no_closed_descriptor_watched():
    """``shutdown()`` (the blocking form) called in the bound loop's thread: the loop
    stops watching the engines' channels before they close, so a reader that the loop
    gets right after on a reused descriptor number (a connection a server accepts)
    is not removed by a removal queued for the old descriptor."""
    c = make_client(True, True, cfg())
    assert await c.echo_async(1) == 1  # bound: the loop watches each engine's channel
    old = {e.channel.recv_fd() for e in c.engines}
    c.shutdown()
    loop, fired = asyncio.get_running_loop(), asyncio.Event()
    r, w = os.pipe()
    held, mine = [r], None
    try:
        for _ in range(4096):  # the lowest free number first: an old one comes soon
            d = os.dup(r)
            if d in old:
                mine = d
                break
            held.append(d)
        assert mine is not None, "no descriptor number of the engines' channels came back"
        loop.add_reader(mine, fired.set)
        os.write(w, b"x")
        await asyncio.wait_for(fired.wait(), 2.0)
    finally:
        if mine is not None:
            loop.remove_reader(mine)
            os.close(mine)
        for fd in (*held, w):
            os.close(fd)


def _exited(fds: list[int]) -> list[bool]:
    """For each pidfd: has its process exited (now, without waiting)?"""
    readable = select.select(fds, [], [], 0)[0]
    return [fd in readable for fd in fds]


def _kill_all(fds: list[int]) -> None:
    """SIGKILL what is left of the processes behind ``fds`` (a failed test's cleanup)."""
    for fd in fds:
        try:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_shutdown_tells_every_engine_at_once_and_a_retry_after_ctrl_c_ends_the_stops():
    """Engine 0 hangs (SIGSTOP): shutdown(timeout=2) tells engine 1 to stop without
    waiting for engine 0, so engine 1 exits at once. Ctrl-C then interrupts only the
    wait: another shutdown() waits for engine 0's stop (killed once its 2 s ran out)."""
    c = make_client(True, True, cfg())
    fds = [os.pidfd_open(p) for p in c.engine_pids]
    armed, main = [False], threading.main_thread().ident

    def on_sigint(*_):
        if armed[0]:
            raise KeyboardInterrupt

    def interrupt_once_engine_1_exited():
        # Bounded: engine 0's stop alone takes 2 s, then SIGTERM, then SIGKILL 2 s later.
        if select.select([fds[1]], [], [], 4.0)[0]:
            signal.pthread_kill(main, signal.SIGINT)

    old = signal.signal(signal.SIGINT, on_sigint)
    watcher = threading.Thread(target=interrupt_once_engine_1_exited)
    try:
        sigstop(c.engine_pids[0])
        armed[0] = True
        watcher.start()
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            c.shutdown(timeout=2)
        armed[0] = False
        assert time.monotonic() - t0 < 2.0, "engine 1 was told to stop after engine 0's stop"
        assert _exited(fds) == [False, True]
        c.shutdown()  # waits for engine 0's stop under way (2 s, SIGTERM, 2 s, SIGKILL)
        # (a new stop, with the default 5 s, would end 7 s after this call)
        assert time.monotonic() - t0 < 6.0
        assert _exited(fds) == [True, True]
        assert all(e._closed and e.is_dead for e in c.engines)
    finally:
        armed[0] = False
        watcher.join(10)
        signal.signal(signal.SIGINT, old)
        _kill_all(fds)
        for e in c.engines:
            e.shutdown(timeout=0)
        for fd in fds:
            os.close(fd)


class _StoppingEngine:
    """An engine client whose first ``shutdown`` blocks until ``release`` is set (5 s
    at most); later ones return at once."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls = 0

    def shutdown(self, timeout):
        self.calls += 1
        if self.calls == 1:
            self.release.wait(5)


class _Threads:
    """``dp_engines``'s view of ``threading``, with ``Thread.start`` replaced."""

    def __init__(self, start) -> None:
        self.Thread = type("Thread", (threading.Thread,), {"start": start})
        self.Event, self.Lock = threading.Event, threading.Lock


def test_stops_run_inline_where_no_thread_can_start(monkeypatch):
    """Python 3.12.0/3.12.1 refuse a new thread at interpreter shutdown (RuntimeError):
    a DP ``shutdown()`` from an atexit handler still stops every engine, inline."""
    from shmclient import dp_engines

    def start(self):
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(dp_engines, "threading", _Threads(start))
    engines = [_StoppingEngine(), _StoppingEngine()]
    for e in engines:
        e.release.set()
    stops = dp_engines.EngineStops(engines)
    stops.stop(range(2), 1.0)
    assert [e.calls for e in engines] == [1, 1]
    assert stops.over() and stops.join(1.0)


@pytest.mark.parametrize("thread_started", [True, False], ids=["after", "before"])
def test_a_stop_interrupted_while_its_thread_starts_is_waited_for(monkeypatch, thread_started):
    """Ctrl-C inside ``Thread.start`` (after the stop's thread started, or before): the
    retry neither loses the stop under way (its join waits for that very shutdown) nor
    leaves the engine unstopped."""
    from shmclient import dp_engines

    interrupted = []

    def start(self):
        if not interrupted:
            interrupted.append(1)
            if thread_started:
                threading.Thread.start(self)
            raise KeyboardInterrupt
        threading.Thread.start(self)

    monkeypatch.setattr(dp_engines, "threading", _Threads(start))
    engine = _StoppingEngine()
    stops = dp_engines.EngineStops([engine])
    try:
        with pytest.raises(KeyboardInterrupt):
            stops.stop([0], 1.0)
        stops.stop([0], 1.0)  # the retry
        if thread_started:
            assert not stops.join(0.2), "join reported a stop over that still runs"
    finally:
        engine.release.set()
        over = stops.join(5.0)
        for t in threading.enumerate():
            if t.name.startswith("dp-stop-engine-"):
                t.join(5)
    assert over and engine.calls == 1


def test_a_retry_with_a_shorter_timeout_waits_for_the_stop_under_way():
    """``shutdown(timeout=60)`` interrupted by Ctrl-C leaves the engines' stops running
    with their 60 s; a retry ``shutdown(timeout=0)`` waited only 0 s and the grace, and
    returned with the engines still running (the single-engine client waits for the
    longer stop). Now the join waits for each stop's own timeout and the grace."""
    from shmclient import dp_engines

    class HungEngine:  # its shutdown takes its whole timeout (SIGTERM ignored, say)
        def __init__(self) -> None:
            self.never = threading.Event()

        def shutdown(self, timeout):
            self.never.wait(timeout)

    stops = dp_engines.EngineStops([HungEngine(), HungEngine()])
    try:
        stops.stop(range(2), 0.6)  # the first call's timeout; its join interrupted
        stops.stop(range(2), 0.0)  # the retry's: starts nothing new
        assert stops.join(0.0, grace=0.2), "the retry returned before the stops under way"
        assert stops.over()
    finally:
        for t in threading.enumerate():
            if t.name.startswith("dp-stop-engine-"):
                t.join(5)


async def test_a_death_seen_off_the_loop_leaves_the_apps_new_sockets_watched():
    """Engine 1 dies while the loop is busy: the survivor's stop ran in the monitor's
    thread and closed its channel at once, the loop still watching its descriptor; the
    app's next socket got that number, and the loop's queued unwatch removed the app's
    reader (its connection hung). The stop now runs on the loop, which unwatches first."""
    loop = asyncio.get_running_loop()
    c = make_client(True, True, cfg())
    fired = asyncio.Event()
    made: list = []
    try:
        assert await c.echo_async(1) == 1  # bound to this loop
        fd0 = c.engines[0]._reader._watch.fd

        def closed(fd: int) -> bool:
            try:
                os.fstat(fd)
                return False
            except OSError:
                return True

        def busy() -> None:  # the loop at work while the engine dies
            os.kill(c.engine_pids[1], signal.SIGKILL)
            deadline = time.monotonic() + 1.0  # the off-loop close took milliseconds
            while not closed(fd0) and time.monotonic() < deadline:
                time.sleep(0.005)

        def app_connects() -> None:  # already scheduled: runs right after
            for _ in range(64):
                made.append(socket.socketpair())
                if not closed(fd0) or fd0 in (made[-1][0].fileno(), made[-1][1].fileno()):
                    break
            a, b = made[-1]
            mine, peer = (b, a) if b.fileno() == fd0 else (a, b)
            loop.add_reader(mine.fileno(), fired.set)
            made.append((mine, peer))

        loop.call_soon(busy)
        loop.call_soon(app_connects)
        await asyncio.sleep(0)  # (both callbacks run before this task resumes)
        mine, peer = made[-1]
        peer.send(b"x")
        try:
            await asyncio.wait_for(fired.wait(), 5)
        finally:
            loop.remove_reader(mine.fileno())
        with pytest.raises(EngineDeadError, match="engine 1"):
            await c.get_output_async(timeout=5)
    finally:
        for a, b in made[:-1]:
            a.close()
            b.close()
        await c.shutdown_async()


async def test_a_utility_call_given_up_by_its_caller_logs_nothing():
    """A DP utility under ``wait_for`` that runs out (an engine stopped) left its
    gather's CancelledError unread: asyncio logged "_GatheringFuture exception was
    never retrieved", with a traceback, at ERROR level, for every such call."""
    loop = asyncio.get_running_loop()
    reported = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context["message"]))
    c = make_client(True, True, cfg())
    try:
        assert await c.echo_async(1) == 1  # bound to this loop
        sigstop(c.engine_pids[1])
        for _ in range(2):
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(c.is_sleeping_async(), 0.2)
        os.kill(c.engine_pids[1], signal.SIGCONT)
        assert await c.is_sleeping_async() is False
        gc.collect()  # (a future unread is reported as it is collected)
        assert reported == []
    finally:
        os.kill(c.engine_pids[1], signal.SIGCONT)
        loop.set_exception_handler(None)
        await c.shutdown_async()


async def test_a_shutdown_leaves_no_error_unread_in_the_utility_calls_waiting_for_room():
    """Utility calls fanned out to every engine, one engine's request ring full (its
    engine stopped): at shutdown that engine client failed each call's future and the
    call raised from its send, leaving the future unread; asyncio logged "Future
    exception was never retrieved" at ERROR level, once per call."""
    loop = asyncio.get_running_loop()
    reported: list = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context["message"]))
    c = make_client(True, True, cfg(ring_capacity_bytes=1 << 14))
    try:
        assert await c.echo_async(1) == 1  # bound to this loop
        sigstop(c.engine_pids[1])  # its request ring fills up
        add, _ = await add_until_one_parks(c.add_request_async, lambda i: req(f"fill-{i}", rank=1))
        calls = [asyncio.ensure_future(c.echo_async(k)) for k in range(3)]
        for _ in range(20):  # a few turns: each call's fan-out registers a future on
            await asyncio.sleep(0)  # engine 1 and parks there, behind the add
            if len(c.engines[1]._futures) == 3:
                break
        assert len(c.engines[1]._futures) == 3 and not any(f.done() for f in calls)
        await c.shutdown_async(timeout=0.5)
        results = await asyncio.wait_for(asyncio.gather(add, *calls, return_exceptions=True), 10)
        assert [type(r) for r in results] == [ClientClosedError] * 4
        del add, calls, results
        gc.collect()  # (a future unread is reported as it is collected)
        assert reported == []
    finally:
        loop.set_exception_handler(None)
        await c.shutdown_async()


async def test_a_cancelled_shutdown_async_after_a_death_is_finished_by_the_next_call():
    """Engine 1 dies while engine 0 hangs (its stop: 1 s, then SIGTERM, SIGKILL 2 s
    later). A shutdown_async() cancelled meanwhile leaves the stops running; the next
    call waits for them, and every engine client ends shut down, the dead one's too."""
    c = make_client(True, True, cfg())
    fds = [os.pidfd_open(p) for p in c.engine_pids]
    try:
        assert await c.echo_async(1) == 1  # bound to this loop
        sigstop(c.engine_pids[0])
        os.kill(c.engine_pids[1], signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="engine 1"):
            await c.get_output_async(timeout=5)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(c.shutdown_async(), 0.2)
        assert _exited(fds) == [False, True]
        await asyncio.wait_for(c.shutdown_async(), 10)
        assert _exited(fds) == [True, True]
        assert all(e._closed for e in c.engines)
    finally:
        _kill_all(fds)
        for e in c.engines:
            e.shutdown(timeout=0)
        for fd in fds:
            os.close(fd)


def test_an_engine_clients_own_shutdown_is_no_engine_death(caplog):
    """An engine client shut down by its finalizer (what the interpreter's exit runs for
    a client never shut down) is no death: nothing is logged as one and no other
    engine is stopped for it."""
    c = make_client(True, True, cfg())
    try:
        with caplog.at_level(logging.WARNING, logger="shmclient"):
            c.engines[1]._finalizer()
        assert [r.getMessage() for r in caplog.records] == []
        assert c._death is None and not c._stops._over and not c.engines[0].is_dead
    finally:
        c.shutdown()


@pytest.mark.parametrize("loop_before", [False, True], ids=["never-bound", "its-loop-closed"])
def test_a_death_no_event_loop_sees_still_stops_the_other_engines(loop_before):
    """An engine dies while no event loop uses the client (built from sync code, or
    between two asyncio.run calls): the other engines are stopped all the same, and the
    next call says which engine died and why."""
    c = make_client(True, True, cfg())
    survivor = os.pidfd_open(c.engine_pids[0])
    try:
        if loop_before:
            assert asyncio.run(c.echo_async(1)) == 1
        os.kill(c.engine_pids[1], signal.SIGKILL)
        readable, _, _ = select.select([survivor], [], [], 10)
        assert readable, "the surviving engine was not stopped"
        with pytest.raises(EngineDeadError, match=r"engine 1 \(pid \d+\) died: .*SIGKILL"):
            asyncio.run(c.echo_async(1))
    finally:
        os.close(survivor)
        c.shutdown()


def test_a_death_while_the_bound_loop_is_idle_stops_the_other_engines_at_once():
    """An engine dies while the loop the client is bound to is idle (open, between two
    run_until_complete calls): the stop of the others was only queued to that loop, and
    they ran on until it turned or shutdown() was called. Their processes are stopped
    at once now; the next call on the loop says which engine died."""
    c = make_client(True, True, cfg())
    loop = asyncio.new_event_loop()
    survivor = os.pidfd_open(c.engine_pids[0])
    try:
        assert loop.run_until_complete(c.echo_async(1)) == 1  # bound to this loop
        os.kill(c.engine_pids[1], signal.SIGKILL)
        readable, _, _ = select.select([survivor], [], [], 10)
        assert readable, "the surviving engine was not stopped"
        with pytest.raises(EngineDeadError, match=r"engine 1 \(pid \d+\) died: .*SIGKILL"):
            loop.run_until_complete(c.echo_async(1))
    finally:
        os.close(survivor)
        loop.run_until_complete(c.shutdown_async())
        loop.close()


def test_a_start_up_failure_leaves_nothing_behind():
    with pytest.raises(ConfigError, match="device"):
        make_client(True, True, cfg(device="cuda:7"))


def test_an_interrupted_start_stops_every_engine_that_started(monkeypatch):
    """Ctrl-C while a group starts: rank 0's engine is up, rank 1's starts after the
    interrupt landed. make_client re-raises the KeyboardInterrupt once both starts are
    over, with both engines stopped."""
    from shmclient import dp_engines

    made: list[AsyncMPClient] = []
    rank0_up, starts_over, armed = threading.Event(), threading.Event(), [True]
    main = threading.main_thread().ident

    def start(config, **_kw):
        try:
            if config.data_parallel_rank == 1:
                assert rank0_up.wait(30)
                signal.pthread_kill(main, signal.SIGINT)  # Ctrl-C, while rank 1 starts
            made.append(AsyncMPClient(config))
            if config.data_parallel_rank == 0:
                rank0_up.set()
            return made[-1]
        finally:
            if len(made) == 2:
                starts_over.set()

    def on_sigint(*_):
        if armed[0]:
            raise KeyboardInterrupt

    monkeypatch.setattr(dp_engines, "_async_client_class", lambda: start)
    old = signal.signal(signal.SIGINT, on_sigint)
    try:
        with pytest.raises(KeyboardInterrupt):
            make_client(True, True, cfg())
        armed[0] = False
        assert len(made) == 2, "make_client returned before every start was over"
        assert all(c.is_dead for c in made)
        for c in made:  # reaped by the shutdown: no such child any more
            with pytest.raises(ChildProcessError):
                os.waitpid(c.engine_pid, os.WNOHANG)
    finally:
        armed[0] = False
        signal.signal(signal.SIGINT, old)
        starts_over.wait(30)
        for c in made:
            c.shutdown(timeout=0.0)


@contextlib.contextmanager
def _group_start_interrupted(monkeypatch, start, stop_started, made: dict, *waiting_on: threading.Event):
    """start_engines with ``start`` building each rank's client and ``stop_started``
    as its stop of an abandoned start, SIGINT raising KeyboardInterrupt in the main
    thread until the Event yielded is set. At the end that Event and ``waiting_on``
    are set, the starts' threads joined and every engine in ``made`` (rank: client)
    stopped."""
    from shmclient import dp_engines

    returned = threading.Event()

    def on_sigint(*_):
        if not returned.is_set():
            raise KeyboardInterrupt

    monkeypatch.setattr(dp_engines, "_async_client_class", lambda: start)
    monkeypatch.setattr(dp_engines, "_stop_started", stop_started)
    old = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield returned
    finally:
        returned.set()
        for e in waiting_on:
            e.set()
        signal.signal(signal.SIGINT, old)
        for t in threading.enumerate():
            if t.name.startswith("dp-start"):
                t.join(30)
        for c in made.values():
            c.shutdown(timeout=0.0)


def _until_every_engine_stopped(made: dict, n: int) -> None:
    deadline = time.monotonic() + 30
    while not (len(made) == n and all(c.is_dead for c in made.values())):
        assert time.monotonic() < deadline, f"left running: {[r for r, c in made.items() if not c.is_dead]}"
        time.sleep(0.01)


def test_a_second_ctrl_c_while_a_group_start_winds_down_returns_at_once(monkeypatch):
    """The first Ctrl-C makes start_engines wait for the starts under way (to stop what
    they start); a second one must let the caller go, each start stopping its engine
    when it completes. The pool's shutdown waited for them again: it took a third."""
    from shmclient import dp_engines

    made: dict[int, AsyncMPClient] = {}
    rank0_up, winding_down, released = (threading.Event() for _ in range(3))
    main = threading.main_thread().ident
    real_stop = dp_engines._stop_started

    def stop_started(fut):
        winding_down.set()  # (called at once for rank 0's start, which is done)
        real_stop(fut)

    def start(config, **_kw):
        rank = config.data_parallel_rank
        if rank == 1:
            assert rank0_up.wait(30)
            signal.pthread_kill(main, signal.SIGINT)  # Ctrl-C, while rank 1 starts
            assert winding_down.wait(30)
            signal.pthread_kill(main, signal.SIGINT)  # and again
            released.wait(10)  # (without the fix make_client waits for this)
        made[rank] = AsyncMPClient(config)
        if rank == 0:
            rank0_up.set()
        return made[rank]

    with _group_start_interrupted(monkeypatch, start, stop_started, made, released) as returned:
        with pytest.raises(KeyboardInterrupt):
            make_client(True, True, cfg())
        assert not released.is_set(), "the second Ctrl-C waited for the start under way"
        returned.set()
        released.set()
        _until_every_engine_stopped(made, 2)


def test_a_second_ctrl_c_in_the_stop_of_one_started_engine_skips_no_other(monkeypatch):
    """Ranks 0 and 1 are up, rank 2 starting, at the first Ctrl-C; the second lands
    in the stop of rank 0's engine: rank 1's must still be stopped (the loop over the
    engines that were up ended there)."""
    from shmclient import dp_engines

    made: dict[int, AsyncMPClient] = {}
    up, winding_down, second_sent = (threading.Event() for _ in range(3))
    main = threading.main_thread().ident
    real_stop = dp_engines._stop_started
    stops: list[int] = []

    def stop_started(fut):
        real_stop(fut)
        stops.append(fut.result().config.data_parallel_rank)
        if len(stops) == 1:
            winding_down.set()
            second_sent.wait(10)  # the second Ctrl-C lands here, in the first stop

    def start(config, **_kw):
        rank = config.data_parallel_rank
        if rank == 2:
            assert up.wait(30)
            signal.pthread_kill(main, signal.SIGINT)
            assert winding_down.wait(30)
            signal.pthread_kill(main, signal.SIGINT)
            second_sent.set()
        made[rank] = AsyncMPClient(config)
        if len(made) == 2 and rank != 2:
            up.set()
        return made[rank]

    with _group_start_interrupted(monkeypatch, start, stop_started, made, second_sent) as returned:
        with pytest.raises(KeyboardInterrupt):
            make_client(True, True, cfg(data_parallel_size=3))
        returned.set()
        _until_every_engine_stopped(made, 3)


# -- the benchmark section ---------------------------------------------------------------


def test_bench_dp_section_is_registered_and_rendered():
    from shmclient_bench import __main__ as bench_main
    from shmclient_bench import dp, report

    assert "dp" in bench_main.SECTIONS and "dp" in bench_main.EXTERNAL
    res = {
        "settings": {"requests": 8, "max_tokens": 4, "rounds": 1, "step_delay_s": 0.005,
                     "max_num_seqs": 8},
        "throughput": {k: {"requests_per_s": v, "tokens_per_s": 4 * v, "rounds": [v]}
                       for k, v in (("async_1_engine", 100.0), ("dp_lb_1_engine", 99.0),
                                    ("dp_lb_2_engines", 190.0))},
        "speedup_2_vs_1_engine": 1.9, "dp_layer_cost": 0.99,
        "overhead_no_delay": {"requests": 64, "async_1_engine": {"requests_per_s": 5000.0},
                              "dp_lb_1_engine": {"requests_per_s": 4000.0},
                              "us_per_request_added": 50.0},
        "balance_pinned": {"pinned_to_rank_0": 1 / 3, "request_share": [0.5, 0.5],
                           "token_share": [0.5, 0.5], "round_robin_request_share": [2 / 3, 1 / 3],
                           "elapsed_s": 1.0},
        "balance_alternating": {"long_tokens": 16, "short_tokens": 2, "request_share": [0.5, 0.5],
                                "token_share": [0.48, 0.52],
                                "round_robin_token_share": [16 / 18, 2 / 18], "elapsed_s": 1.0},
    }
    text = dp.report(res)
    for needle in ("dp_lb_2_engines", "190.0", "1.90x", "+50.0 us", "0.50 / 0.50",
                   "round robin 0.67 / 0.33", "0.48 / 0.52"):
        assert needle in text, needle
    full = report.format_report({"machine": {}, "dp": res, "tables": {"dp": text}})
    assert "Data parallelism, 1 and 2 engines" in full and "dp_lb_2_engines" in full


async def test_async_with_stops_every_engine_without_blocking_the_loop():
    async with await DPLBAsyncMPClient.create(cfg()) as c:
        assert await c.echo_async("hi") == "hi"
        pids = list(c.engine_pids)
        fds = [os.pidfd_open(p) for p in pids]
    try:
        with pytest.raises(EngineDeadError):
            await c.echo_async("late")
        readable, _, _ = select.select(fds, [], [], 10)
        assert len(readable) == 2, "an engine outlived the async with block"
    finally:
        for fd in fds:
            os.close(fd)
    await c.shutdown_async()  # idempotent
    c.shutdown()


def test_each_rank_gets_its_own_gpu_unless_one_is_named():
    from shmclient.client_dp import engine_config

    c = engine_config(cfg(data_parallel_size=3, device="cuda"), 2)
    assert (c.data_parallel_rank, c.device) == (2, "cuda:2")
    assert engine_config(cfg(device="cuda:0"), 1).device == "cuda:0"
    assert engine_config(cfg(), 1).device == "cpu"
    assert engine_config(cfg(data_parallel_size=1, device="cuda"), 0).device == "cuda"
    ext = cfg(device="cuda", data_parallel_external_lb=True, data_parallel_rank=1)
    assert engine_config(ext, 1).device == "cuda"


async def test_a_group_of_an_shm_engine_and_a_zmq_engine_gives_one_engines_tokens():
    """Ranks over different transports in one group (the seam for engines on another
    host): rank 0 over the shared-memory rings, rank 1 over zmq."""
    from shmclient.client_dp import engine_config

    ids = [f"r{i}" for i in range(8)]
    reqs = lambda: [req(rid, max_tokens=2 + i, prompt=range(i + 1, i + 6))  # noqa: E731
                    for i, rid in enumerate(ids)]
    config = cfg()
    with pytest.raises(ConfigError, match="one per rank"):
        DPLBAsyncMPClient(config, engines=[])
    single = AsyncMPClient(cfg(data_parallel_size=1))
    try:
        for r in reqs():
            await single.add_request_async(r)
        want = await collect(single, ids)
    finally:
        single.shutdown()
    engines = [AsyncMPClient(engine_config(config, 0))]
    try:
        engines.append(AsyncMPClient(engine_config(config, 1).replace(transport="zmq")))
    except BaseException:
        engines[0].shutdown()
        raise
    c = DPLBAsyncMPClient(config, engines=engines)
    try:
        for r in reqs():
            await c.add_request_async(r)
        got = await collect(c, ids)
        assert await c.call_utility_all_async("echo", 1) == [1, 1]
    finally:
        c.shutdown()
    assert {k: v[:2] for k, v in got.items()} == {k: v[:2] for k, v in want.items()}
    assert {v[2] for v in got.values()} == {0, 1}
    assert all(e.is_dead for e in engines)  # stopped with the group


async def test_an_abort_is_not_held_up_by_another_engines_full_ring():
    """An abort naming requests of two engines: each engine's abort goes after what was
    sent to that engine before it, and not after the other engine's. Engine 0 is stopped
    with a full request ring and an add parked behind it; the abort of a request on
    engine 1 still reaches engine 1 at once (the engines' aborts went one after the
    other before: engine 1's waited for engine 0's)."""
    # 10 ms steps: "running" would take 4 s to finish by itself
    async with await DPLBAsyncMPClient.create(cfg(ring_capacity_bytes=4096, step_delay_s=0.01)) as c:
        await c.add_request_async(req("running", max_tokens=400, rank=1))
        sigstop(c.engine_pids[0])
        try:
            add, n = await add_until_one_parks(
                c.add_request_async, lambda k: req(f"f{k}", max_tokens=1, rank=0, prompt=[1000] * 400))
            abort = asyncio.ensure_future(c.abort_requests_async([f"f{n}", "running"]))
            got = await collect(c, ["running"])
            assert got["running"][1] is FinishReason.ABORT
            assert not abort.done()  # engine 0's part waits behind its parked add
        finally:
            os.kill(c.engine_pids[0], signal.SIGCONT)
        await asyncio.wait_for(asyncio.gather(add, abort), 20)


async def test_a_dp_utility_call_to_a_stalled_engine_gives_up_at_its_timeout():
    """One engine of two stopped: ``call_utility_all_async(..., timeout=)`` (and the
    first-result and consensus forms) raise PeerNotProducingError naming that engine
    at the timeout, with nothing left registered; once it goes on, calls are answered
    by both."""
    c = make_client(True, True, cfg())
    try:
        assert await c.echo_async(1) == 1  # bound to this loop
        with Stopped(c.engine_pids[1]):
            for call in (c.call_utility_all_async, c.call_utility_async,
                         c.call_utility_consensus_async):
                t0 = time.monotonic()
                with pytest.raises(PeerNotProducingError,
                                   match=f"pid {c.engine_pids[1]}.*call to is_sleeping"):
                    await call("is_sleeping", timeout=0.2)
                assert 0.2 <= time.monotonic() - t0 < 5
            with pytest.raises(InvalidRequestError, match=r"call_utility_all_async\(\): timeout="):
                await c.call_utility_all_async("echo", 1, timeout=-1)
            assert [e._futures for e in c.engines] == [{}, {}]
        assert await c.call_utility_all_async("echo", 2, timeout=30) == [2, 2]
        assert [e._futures for e in c.engines] == [{}, {}]
    finally:
        await c.shutdown_async()
