"""Real vLLM with data parallelism (internal load balancing, one API server) over the
rings: one pair of rings per engine core, vLLM's DP client and coordinator unchanged.

Run with ``python -m pytest -m vllm``; skipped when vLLM is not importable. One stock and
one plug-in ``AsyncLLM`` with two engine cores each are shared by the module (~1 min
each to start here); the kill test starts its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import signal
import time

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(400)]

from .conftest import importorskip_vllm  # noqa: E402
vllm = importorskip_vllm()  # an error, not a skip, under SHMCLIENT_REQUIRE_VLLM=1

import vllm.v1.engine.coordinator as coordinator_module  # noqa: E402
from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: E402
from vllm.v1.engine.async_llm import AsyncLLM  # noqa: E402
from vllm.v1.engine.core_client import DPLBAsyncMPClient  # noqa: E402
from vllm.v1.engine.exceptions import EngineDeadError  # noqa: E402

from shmclient.vllm.frontend_async import ShmDPLBAsyncMPClient  # noqa: E402

from .test_tensors import _resource_tracker  # noqa: E402,F401 - started once, before the kill test
from .conftest import sweep_orphaned_vllm_segments  # noqa: E402
from .test_vllm import (  # noqa: E402,F401 - fixtures and helpers of the one-engine tests
    ENGINE_KW,
    STREAM_PROMPTS,
    full_request_ring,
    _shutdown_async,
    concurrent,
    greedy,
    model_dir,
    plugin_loaded,
    stock_and_shm_on_one_loop,
    stream,
    switch,
    tokens,
)

DP = 2


@contextlib.contextmanager
def forked_coordinator():
    """vLLM forks its DP coordinator by default (``VLLM_WORKER_MULTIPROC_METHOD``), as
    on a GPU host; its CPU platform switches every start to spawn. The coordinator is
    forked here as there (the engine cores are still spawned)."""
    stock = coordinator_module.get_mp_context
    coordinator_module.get_mp_context = lambda: multiprocessing.get_context("fork")
    try:
        yield
    finally:
        coordinator_module.get_mp_context = stock


def make_dp(model_dir: str, shm: bool) -> AsyncLLM:
    with switch(shm), forked_coordinator():
        return AsyncLLM.from_engine_args(AsyncEngineArgs(
            model=model_dir, data_parallel_size=DP, gpu_memory_utilization=0.08, **ENGINE_KW))


def engine_pids(client) -> dict[int, int]:
    return {int(p.name.rsplit("DP", 1)[1]): p.pid for p in client.resources.engine_manager.processes}


def requests_carried(client) -> list[int]:
    """Records each engine's request ring has carried, by engine index."""
    return [client._links[i.to_bytes(2, "little")].channel.statistics().tx.tx_records for i in range(DP)]


@pytest.fixture(scope="module")
def dp_pair(model_dir):
    """(loop, stock, shm) AsyncLLMs with two engine cores each, on one event loop."""
    yield from stock_and_shm_on_one_loop(lambda shm: make_dp(model_dir, shm), embeds_too=False)


def test_dp_clients_are_the_expected_classes(dp_pair):
    _, stock, shm = dp_pair
    assert type(stock.engine_core) is DPLBAsyncMPClient
    assert type(shm.engine_core) is ShmDPLBAsyncMPClient
    assert sorted(shm.engine_core._links) == [i.to_bytes(2, "little") for i in range(DP)]


def memfds_held(pid: int) -> list[str]:
    """The project's memfds (rings, arenas, parked pages) process ``pid`` holds an fd of."""
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("/memfd:shmc"):
            out.append(link)
    return out


def test_dp_coordinator_holds_none_of_the_rings(dp_pair):
    """vLLM forks its DP coordinator (``forked_coordinator``) while the frontend's
    channels are open: it keeps
    none of their fds (it never uses them; they would keep every ring and arena
    allocated while it lives), nor do the engine cores (spawned here) once attached, nor
    the frontend that made them, once both had."""
    _, _, shm = dp_pair
    coordinator = shm.engine_core.resources.coordinator.proc
    assert type(coordinator._popen).__module__ == "multiprocessing.popen_fork"
    assert memfds_held(coordinator.pid) == []
    for pid in engine_pids(shm.engine_core).values():
        assert memfds_held(pid) == []


def test_dp_sixteen_streams_identical_and_spread_over_both_engines(dp_pair):
    loop, stock, shm = dp_pair
    before = requests_carried(shm.engine_core)
    want = loop.run_until_complete(concurrent(stock, "s", STREAM_PROMPTS, 24))
    got = loop.run_until_complete(concurrent(shm, "m", STREAM_PROMPTS, 24))
    assert got == want
    assert all(len(t) == 24 for t in got)
    after = requests_carried(shm.engine_core)
    # vLLM's balancing spreads the burst (round robin, unless a coordinator stats update
    # lands in the middle of it): every request went through one ring, each ring a share
    carried = [a - b for a, b in zip(after, before)]
    assert sum(carried) == len(STREAM_PROMPTS) and min(carried) >= len(STREAM_PROMPTS) // (2 * DP), carried
    assert not shm.engine_core.reqs_in_flight  # vLLM's per-output hook saw every finish


def test_dp_abort_goes_to_the_owning_engine_and_utilities_to_every_engine(dp_pair):
    loop, stock, shm = dp_pair
    client = shm.engine_core

    async def scenario():
        got: list[int] = []
        finish = owner = before = after = None
        async for out in shm.generate(tokens([1, 2, 3]), greedy(200), request_id="dp-abort-me"):
            got = list(out.outputs[0].token_ids)
            finish = out.outputs[0].finish_reason
            if len(got) >= 3 and finish is None and owner is None:
                # vLLM's request id carries a suffix of its own: find ours by its prefix
                owner = next(e for r, e in client.reqs_in_flight.items() if r.startswith("dp-abort-me"))
                before = requests_carried(client)
                await shm.abort("dp-abort-me")
                after = requests_carried(client)
        other = await stream(shm, "dp-after-abort", [5, 6, 7, 8], 6)
        utility_before = requests_carried(client)
        reset = await shm.reset_prefix_cache()
        utility_after = requests_carried(client)
        return got, finish, owner, before, after, other, reset, utility_before, utility_after

    got, finish, owner, before, after, other, reset, ub, ua = loop.run_until_complete(scenario())
    assert 3 <= len(got) < 200 and finish in (None, "abort")
    assert got == loop.run_until_complete(stream(stock, "dp-ref", [1, 2, 3], len(got)))
    owner_index = int.from_bytes(owner, "little")
    assert [a - b for a, b in zip(after, before)] == [int(i == owner_index) for i in range(DP)]
    assert other == loop.run_until_complete(stream(stock, "dp-ref-after", [5, 6, 7, 8], 6))
    assert reset is True
    assert [a - b for a, b in zip(ua, ub)] == [1] * DP  # one utility call to each engine


def test_dp_request_whose_add_timed_out_leaves_no_request_in_flight(dp_pair, monkeypatch):
    """A request for engine 1 whose ADD gives up on that engine's full request ring (the
    engine stopped; SEND_TIMEOUT_S shortened): vLLM's DP client had counted it in flight
    on engine 1 and its output processor had registered it, for good. Now it finishes
    with an error through vLLM's per-output hook: neither keeps it."""
    from vllm.v1.engine.exceptions import EngineGenerateError

    from shmclient.vllm import frontend_async

    loop, stock, shm = dp_pair
    client = shm.engine_core
    pid = engine_pids(client)[1]
    monkeypatch.setattr(frontend_async, "SEND_TIMEOUT_S", 0.3)
    before = shm.output_processor.get_num_unfinished_requests()

    async def scenario():
        with pytest.raises(EngineGenerateError):
            gen = shm.generate(tokens([5, 6, 7, 8]), greedy(4), request_id="dp-undelivered",
                               data_parallel_rank=1)
            await asyncio.wait_for(gen.__anext__(), 30)
        await asyncio.sleep(0)
        return (shm.output_processor.get_num_unfinished_requests(),
                [r for r in client.reqs_in_flight if r.startswith("dp-undelivered")])

    with full_request_ring(pid, client._links[(1).to_bytes(2, "little")].channel):
        unfinished, in_flight = loop.run_until_complete(scenario())
    assert unfinished == before and in_flight == []
    got = loop.run_until_complete(concurrent(shm, "dp-after-undelivered", STREAM_PROMPTS[:4], 6))
    assert got == loop.run_until_complete(concurrent(stock, "dp-ref-undelivered", STREAM_PROMPTS[:4], 6))


def test_dp_sigkill_of_one_engine_raises_engine_dead(model_dir, _resource_tracker):
    """SIGKILL one of two engine cores: the client is dead as a whole, at once. The
    victim and the streams on the killed engine raise EngineDeadError soon after the
    kill; a stream on the other engine either raises it at the same moment, or had
    completed (all its tokens) before the death was seen (the kernel tells only once the
    process has exited: 0.05-0.1 s on a 2-vCPU VM, longer on a busy host, while the
    survivor keeps decoding), or ends aborted at the same moment: vLLM's engine monitor,
    which sees the exit too, stops the other engines before it marks the client dead,
    and a stopped engine aborts what it runs (vLLM's own outcome for such a stream)."""
    loop = asyncio.new_event_loop()
    shm_before = set(os.listdir("/dev/shm"))
    engine = make_dp(model_dir, shm=True)
    try:
        assert type(engine.engine_core) is ShmDPLBAsyncMPClient
        killed: list[float] = []

        async def run(request_id: str, prompt, rank: int):
            toks: list[int] = []
            finish = None
            try:
                async for out in engine.generate(tokens(prompt), greedy(240), request_id=request_id,
                                                  data_parallel_rank=rank):
                    toks = list(out.outputs[0].token_ids)
                    finish = out.outputs[0].finish_reason
                    if request_id == "victim" and toks and not killed:
                        os.kill(engine_pids(engine.engine_core)[1], signal.SIGKILL)
                        killed.append(time.monotonic())
            except EngineDeadError as e:
                return rank, e, time.monotonic()
            return rank, (toks, finish), time.monotonic()

        async def scenario():
            streams = [asyncio.ensure_future(run(f"long-{i}", p, i % DP))
                       for i, p in enumerate(STREAM_PROMPTS[:4])]
            victim = await run("victim", [5, 6, 7, 8], 1)
            return victim, await asyncio.gather(*streams)

        (_, victim_end, victim_at), results = loop.run_until_complete(asyncio.wait_for(scenario(), 30))
        assert isinstance(victim_end, EngineDeadError), victim_end
        assert victim_at - killed[0] < 2.0
        for rank, end, at in results:
            if rank == 1 or not isinstance(end, tuple):
                assert isinstance(end, EngineDeadError), (rank, end)
                assert abs(at - victim_at) < 0.5  # failed together with the victim
            elif end[1] == "abort":  # its engine stopped by vLLM's monitor, with the victim
                assert len(end[0]) < 240 and abs(at - victim_at) < 0.5, (len(end[0]), at - victim_at)
            else:
                # ended before the death was seen (its last output came first)
                assert (len(end[0]), end[1]) == (240, "length") and at - victim_at < 0.25, \
                    (len(end[0]), end[1], at - victim_at)
        with pytest.raises(EngineDeadError):
            loop.run_until_complete(asyncio.wait_for(stream(engine, "after", [1, 2], 2), 10))
        # vLLM's engine monitor shuts the client down, its DP coordinator process too,
        # unless it finds the engine-dead flag set: the plug-in sets it first (at once,
        # where the monitor first waits for the other engine to stop), and that shutdown
        # was left to the caller, the coordinator running meanwhile. Done in its place.
        coordinator = engine.engine_core.resources.coordinator.proc
        deadline = time.monotonic() + 60
        while engine.engine_core._finalizer.alive or coordinator.is_alive():
            assert time.monotonic() < deadline, "the client was not shut down"
            loop.run_until_complete(asyncio.sleep(0.05))  # (polling; the loop runs meanwhile)
    finally:
        loop.run_until_complete(_shutdown_async(engine))
        loop.close()
        sweep_orphaned_vllm_segments(shm_before)  # vLLM's own, left by the engine it lost
    assert sorted(n for n in set(os.listdir("/dev/shm")) - shm_before if n.startswith("shmc")) == []


def test_dp_outputs_read_once_the_client_is_dead_are_not_handed_on(model_dir, _resource_tracker):
    """vLLM's engine monitor marks the client dead (``resources.engine_dead``) before it
    stops the other engines, which then abort what they run. From that mark on no output
    is handed on, as vLLM's output task does (``validate_alive`` on every message): every
    stream raises EngineDeadError, none runs on. Marked here by hand, both engines alive
    and decoding."""
    loop = asyncio.new_event_loop()
    shm_before = set(os.listdir("/dev/shm"))
    engine = make_dp(model_dir, shm=True)
    try:
        started = [asyncio.Event() for _ in range(4)]

        async def run(i: int, prompt):
            toks: list[int] = []
            try:
                async for out in engine.generate(tokens(prompt), greedy(240), request_id=f"marked-{i}",
                                                  data_parallel_rank=i % DP):
                    toks = list(out.outputs[0].token_ids)
                    started[i].set()
            except EngineDeadError as e:
                return e, len(toks)
            return None, len(toks)

        async def scenario():
            streams = [asyncio.ensure_future(run(i, p)) for i, p in enumerate(STREAM_PROMPTS[:4])]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            engine.engine_core.resources.engine_dead = True  # what vLLM's monitor does first
            return await asyncio.gather(*streams)

        ends = loop.run_until_complete(asyncio.wait_for(scenario(), 60))
        assert [(type(e).__name__, n < 240) for e, n in ends] == [("EngineDeadError", True)] * 4, ends
    finally:
        loop.run_until_complete(_shutdown_async(engine))
        loop.close()
        sweep_orphaned_vllm_segments(shm_before)
    assert sorted(n for n in set(os.listdir("/dev/shm")) - shm_before if n.startswith("shmc")) == []
