"""A channel's receive with a limit (the async readers read at most 16 at a time): the
limit counts the ring's records, and a tensor release is a record but no message."""

from __future__ import annotations

import pytest
import torch

from shmclient.channel import REC_OUTPUTS, REQ_UTILITY, ShmChannel
from shmclient.errors import PeerDeadError, WouldBlock
from shmclient.messages import EngineCoreOutputs, UtilityRequest


@pytest.mark.parametrize("releases", [15, 16, 40])
def test_messages_behind_more_releases_than_the_limit_are_received(releases):
    """The engine released ``releases`` tensors one receive at a time (one release record
    each), then wrote an output and died. A receive of at most 16 found only releases
    among its 16 records and said "nothing to receive" with the output still in the
    ring: a reader reading a dead engine's last messages took that for the end and
    dropped the output."""
    front, spec = ShmChannel.create(ring_capacity=1 << 16, arena_bytes=1 << 20, spin_us=0.0, wake_fd=False)
    engine = ShmChannel.attach(spec)
    front.peer_attached()
    try:
        for i in range(releases):  # each tensor in the arena, released on its own
            t = torch.full((4096,), float(i))  # 16 KiB: out of band
            front.send_nowait(REQ_UTILITY, front.encode(UtilityRequest(0, i, "echo", [t])))
            [(_, req)] = engine.recv_nowait()
            assert torch.equal(req.args[0], t)
            del req
            engine.flush_releases()
        assert front.statistics().tensors.blocks_in_flight == releases
        engine.send_nowait(REC_OUTPUTS, engine.encode(EngineCoreOutputs(engine_index=7)))
        engine.close()

        [(rtype, out)] = front.recv_nowait(16)
        assert rtype == REC_OUTPUTS and out.engine_index == 7
        assert front.statistics().tensors.blocks_in_flight == 0  # every release read
        with pytest.raises(PeerDeadError):
            front.recv_nowait(16)
    finally:
        engine.close()
        front.close()


def test_only_releases_in_the_ring_is_nothing_to_receive():
    front, spec = ShmChannel.create(ring_capacity=1 << 16, arena_bytes=1 << 20, spin_us=0.0, wake_fd=False)
    engine = ShmChannel.attach(spec)
    front.peer_attached()
    try:
        for i in range(20):
            front.send_nowait(REQ_UTILITY, front.encode(UtilityRequest(0, i, "echo", [torch.zeros(4096)])))
            engine.recv_nowait()
            engine.flush_releases()
        with pytest.raises(WouldBlock):
            front.recv_nowait(16)
        assert front.statistics().tensors.blocks_in_flight == 0
        assert front.try_recv(16) == []
    finally:
        engine.close()
        front.close()
