"""MP clients under concurrency and pressure.

1. SyncMPClient.get_output from several threads at once: every batch reaches exactly one
   caller (no IndexError when two see the same batch arrive).
2. AsyncMPClient: several tasks parked in get_output_async are all woken, also by the
   engine's death.
3. shutdown() from another thread fails a pending call with EngineDeadError (not a
   closed-channel or socket error).
4. Full rings in both directions never deadlock client and engine: the engine keeps
   taking requests while its output ring is full, and add_request_async never blocks the
   event loop on a full request ring.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections import deque

import pytest

from shmclient.config import EngineConfig
from shmclient import EngineDeadError, make_client

from .conftest import sigstop
from .drivers import ctrl_c_when, req

TRANSPORTS = ("shm", "zmq")


def cfg(transport: str = "shm", **kw) -> EngineConfig:
    return EngineConfig(model="mock", transport=transport, max_model_len=2048, **kw)


def test_concurrent_get_output_threads_never_index_error():
    c = make_client(True, False, cfg(step_delay_s=0.001))

    class YieldingDeque(deque):
        def popleft(self):  # widen the window between done() and popleft(): give up the GIL
            os.sched_yield()
            return super().popleft()

    c._outputs = YieldingDeque()
    errors: list[BaseException] = []
    lock = threading.Lock()
    taken = [0]
    try:
        for i in range(32):
            c.add_request(req(f"r{i}", max_tokens=800, ignore_eos=True))

        def worker() -> None:
            # The engine makes 800 batches; stop well before the last.
            try:
                while True:
                    with lock:
                        if taken[0] >= 600:
                            return
                        taken[0] += 1
                    c.get_output(timeout=30.0)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        ts = [threading.Thread(target=worker) for _ in range(3)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    finally:
        c.shutdown()
    assert not errors, errors


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_two_output_waiters_both_get_engine_death(transport):
    c = make_client(True, True, cfg(transport))
    try:
        assert await c.echo_async(1) == 1
        t1 = asyncio.create_task(c.get_output_async())
        t2 = asyncio.create_task(c.get_output_async())
        await asyncio.sleep(0)  # a yield: both tasks run to their park point
        os.kill(c.engine_pid, signal.SIGKILL)
        done, pending = await asyncio.wait({t1, t2}, timeout=3.0)
        for t in pending:
            t.cancel()
        assert not pending, "a concurrent get_output_async never learnt of the engine's death"
        for t in done:
            assert isinstance(t.exception(), EngineDeadError)
    finally:
        c.shutdown()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_shutdown_fails_pending_utility_call_with_engine_dead(transport):
    c = make_client(True, False, cfg(transport, step_delay_s=0.01))
    res: dict[str, BaseException] = {}
    try:
        c.add_request(req("long", max_tokens=100000, ignore_eos=True))
        c.get_output(timeout=30)  # the engine is stepping: sleep(mode="wait") stays pending

        def call() -> None:
            try:
                c.call_utility("sleep", 1, "wait")
            except BaseException as e:  # noqa: BLE001
                res["e"] = e

        t = threading.Thread(target=call)
        t.start()
        while not c._futures and t.is_alive():  # the call is registered (state, not time)
            pass
    finally:
        c.shutdown()
    t.join(10)
    assert not t.is_alive()
    assert isinstance(res.get("e"), EngineDeadError), repr(res.get("e"))


def test_async_add_burst_does_not_deadlock_small_rings():
    c = make_client(True, True, cfg(ring_capacity_bytes=4096))
    outcome: dict[str, object] = {}

    async def main() -> None:
        async def reader() -> None:
            while True:
                await c.get_output_async()

        rt = asyncio.create_task(reader())
        await asyncio.sleep(0)
        try:
            for i in range(2000):
                await c.add_request_async(req(f"r{i}", max_tokens=4, ignore_eos=True))
            outcome["ok"] = True
        except BaseException as e:  # noqa: BLE001
            outcome["e"] = e
        finally:
            rt.cancel()

    t = threading.Thread(target=lambda: asyncio.run(main()))
    t.start()
    t.join(30)
    hung = t.is_alive()
    if hung:  # unblock the loop: the dead engine makes add_request raise
        os.kill(c.engine_pid, signal.SIGKILL)
        t.join(10)
    c.shutdown()
    assert not hung, "add_request_async blocked the event loop: client and engine deadlocked"
    assert outcome.get("ok"), outcome


def test_sync_adds_without_reading_never_deadlock_small_rings():
    """A frontend that adds many requests before reading any output: the output ring
    fills, then the request ring; the engine must keep taking requests meanwhile."""
    c = make_client(True, False, cfg(ring_capacity_bytes=4096))
    ids = [f"r{i}" for i in range(1500)]
    outcome: dict[str, object] = {}

    def adder() -> None:
        try:
            for rid in ids:
                c.add_request(req(rid, max_tokens=4, ignore_eos=True))
            outcome["ok"] = True
        except BaseException as e:  # noqa: BLE001
            outcome["e"] = e

    t = threading.Thread(target=adder)
    t.start()
    t.join(60)
    hung = t.is_alive()
    try:
        if hung:  # unblock the adder: a dead engine makes add_request raise
            os.kill(c.engine_pid, signal.SIGKILL)
            t.join(10)
        assert not hung, "add_request and the engine waited on each other"
        assert outcome.get("ok"), outcome
        finished = set()
        while len(finished) < len(ids):
            for o in c.get_output(timeout=30).outputs:
                if o.finished:
                    assert len(o.new_token_ids) <= 4
                    finished.add(o.request_id)
        assert finished == set(ids)
    finally:
        c.shutdown()


@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_tensors_of_aborted_and_finished_requests_are_released(mode):
    """prompt_embeds placed in the shared arena come back to the frontend's arena once the
    engine drops them, for an aborted request as for a finished one."""
    import torch

    from shmclient import EngineCoreRequest, SamplingParams

    c = make_client(True, mode == "async", cfg(step_delay_s=0.01))

    def in_flight() -> int:  # blocks of the frontend's arena the engine still holds
        return c.channel.statistics().tensors.blocks_in_flight

    async def call(name, *args):
        if mode == "async":
            return await getattr(c, f"{name}_async")(*args)
        return getattr(c, name)(*args)

    try:
        assert in_flight() == 0
        embeds = torch.randn(512, 64)  # 128 KiB: out of band, read in place by the engine
        for rid in ("keep", "drop"):
            await call(
                "add_request",
                EngineCoreRequest(
                    request_id=rid, prompt_embeds=embeds,
                    sampling_params=SamplingParams(max_tokens=1000, ignore_eos=True),
                ),
            )
        assert in_flight() == 2
        await call("abort_requests", ["drop", "keep"])
        # Each round trip carries the engine's pending releases back; a bounded number of
        # them must bring the frontend's arena back to empty.
        for _ in range(50):
            await call("echo", 0)
            if in_flight() == 0:
                break
        assert in_flight() == 0
    finally:
        c.shutdown()


def test_ctrl_c_while_an_add_waits_for_room_gives_its_tensors_blocks_back():
    """An add with prompt_embeds placed in the arena waits for room in a full request
    ring (the engine is stopped); Ctrl-C lands in that wait. Nothing of the message went,
    so the blocks its tensors took come back at once (they stayed taken for good: only a
    timeout or the engine's death freed them)."""
    import torch

    from shmclient import EngineCoreRequest, PeerNotConsumingError, SamplingParams

    c = make_client(True, False, cfg(ring_capacity_bytes=16384))
    waiting_for_room = threading.Event()
    real_wait = c.channel.wait_send

    def wait_send(*args, **kwargs):
        waiting_for_room.set()
        return real_wait(*args, **kwargs)

    try:
        sigstop(c.engine_pid)
        n = 0
        with pytest.raises(PeerNotConsumingError):
            while True:  # fill the request ring
                c.add_request(req(f"fill-{n}", prompt=list(range(1, 400))), timeout=0)
                n += 1
        assert c.channel.statistics().tensors.blocks_in_flight == 0
        c.channel.wait_send = wait_send
        with ctrl_c_when(waiting_for_room), pytest.raises(KeyboardInterrupt):
            c.add_request(EngineCoreRequest(
                request_id="embeds", prompt_embeds=torch.randn(512, 64),  # 128 KiB: arena
                sampling_params=SamplingParams(max_tokens=4)))
        assert c.channel.statistics().tensors.blocks_in_flight == 0
    finally:
        os.kill(c.engine_pid, signal.SIGCONT)
        c.shutdown()
