"""The waiting layer at its edges: a descriptor closed under a waiter, a wait's later
liveness slices."""

from __future__ import annotations

import asyncio
import os

import pytest

from shmclient import WouldBlock, _ring, waiting
from shmclient.channel import ShmChannel


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
