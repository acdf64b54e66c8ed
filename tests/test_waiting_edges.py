"""The waiting layer at its edges: a descriptor closed under a waiter, a wait's later
liveness slices, and an event loop closed while one of its sends was half-way through
the ring."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import weakref

import pytest

from shmclient import AsyncMPClient, EngineConfig, WouldBlock, _ring, waiting
from shmclient.channel import ShmChannel

from .conftest import sigstop
from .drivers import add_until_one_parks, req


# ------------------------------------------------------------------ wait_fd


async def test_wait_fd_on_a_closed_descriptor_leaves_nothing_parked():
    """add_reader refuses a closed descriptor: no entry may stay behind, or a later wait
    on a new descriptor of the same number registers no reader and only times out."""
    loop = asyncio.get_running_loop()
    r, w = os.pipe()
    os.close(r)
    os.close(w)
    with pytest.raises(OSError):
        await waiting.wait_fd(r, 1.0)
    assert (id(loop), r) not in waiting._parked
    r2, w2 = os.pipe()  # (most likely the same number again)
    try:
        os.write(w2, b"x")
        assert await waiting.wait_fd(r2, 2.0) is True
    finally:
        os.close(r2)
        os.close(w2)
    assert not waiting._parked


# ------------------------------------------------------------------ spinning


class _EmptyFor:
    """A receiver with nothing to read for its first ``tries`` tries, then one message;
    it records the spin each wait asked for (a wait returns at once: not ready)."""

    def __init__(self, tries: int) -> None:
        self.tries = tries
        self.waits: list[tuple[float | None, bool]] = []

    def recv_nowait(self, limit: int = 0) -> list:
        if self.tries:
            self.tries -= 1
            raise WouldBlock("nothing to receive")
        return [(1, "x")]

    def wait_recv(self, timeout: float, *, spin: float | None = None, first: bool = True) -> bool:
        self.waits.append((spin, first))
        return False


def test_waiting_recv_spends_an_explicit_spin_on_its_first_slice_only():
    """An idle waiter with spin=s must not spin s in every liveness slice (s/0.1 of a
    CPU): the later slices sleep at once."""
    receiver = _EmptyFor(5)
    assert waiting.recv(receiver, timeout=None, spin=0.02) == [(1, "x")]
    assert receiver.waits == [(0.02, True)] + [(0.0, False)] * 4


def test_a_ring_wait_spins_an_explicit_spin_on_a_first_wait_only():
    """The ring end's wait: an explicit spin, like the adaptive budget, is for the first
    wait of a call; a later slice (first=False) sleeps at once."""
    front, spec = ShmChannel.create(ring_capacity=4096, arena_bytes=1 << 16, spin_us=0, wake_fd=False)
    engine = ShmChannel.attach(spec)
    front.peer_attached()
    budgets: list[float] = []

    def wait(budget: float, timeout: float, first: bool) -> int:
        budgets.append(budget)
        return _ring.TIMEOUT

    try:
        assert front.rx._wait_once(wait, 0.2, 0.05, True) is False
        assert front.rx._wait_once(wait, 0.2, 0.05, False) is False
        assert front.rx._wait_once(wait, 0.2, None, False) is False
        assert budgets == [0.05, 0.0, 0.0]
    finally:
        engine.close()
        front.close()


# ------------------------------------------------------------------ a closed loop


def _request(rid: str, n: int):
    return req(rid, prompt=[(i % 1000) + 1 for i in range(n)], max_tokens=1)


def test_a_loop_closed_with_a_send_half_way_does_not_wedge_the_next_loop():
    """A loop closed while a request bigger than the ring was half-way through it: the
    client's next loop must send at once (no "another message is half-way" refusal, no
    false stall), and the closed loop's parked wait must not keep that loop alive."""
    loop1 = asyncio.new_event_loop()
    client = loop1.run_until_complete(AsyncMPClient.create(
        EngineConfig(ring_capacity_bytes=4096, max_model_len=100_000)))
    try:
        pid = client.engine_pid
        sigstop(pid)
        try:
            async def park_a_big_one() -> None:
                task, _ = await add_until_one_parks(client.add_request_async, lambda n: _request(f"f{n}", 50))
                task.cancel()  # (nothing of it went: the ring is full)
                await asyncio.wait((task,), timeout=10.0)
                big = asyncio.ensure_future(client.add_request_async(_request("big", 3000)))
                await asyncio.wait((big,), timeout=0.05)  # (it stays parked: the engine is stopped)
                assert not big.done()
                assert client.channel.tx.partial_pending

            loop1.run_until_complete(park_a_big_one())
            loop1.run_until_complete(loop1.shutdown_default_executor())
            loop1.close()  # with the big request's task still parked half-way
        finally:
            os.kill(pid, signal.SIGCONT)
        closed = weakref.ref(loop1)
        del loop1

        async def on_a_new_loop() -> None:
            await client.add_request_async(_request("small", 5), timeout=5.0)
            assert not any(f.get_loop().is_closed() for futs in waiting._parked.values() for f in futs)
            gc.collect()  # (the closed loop's task is freed: its coroutine closes, touching nothing)
            assert closed() is None
            finished = False
            while not finished:
                outs = await client.get_output_async(timeout=10.0)
                finished = any(o.request_id == "small" and o.finish_reason is not None for o in outs.outputs)
            await client.shutdown_async()

        asyncio.run(on_a_new_loop())
    finally:
        client.shutdown()
