"""A channel's statistics: one frozen record of its two rings' counters and its tensor
sender's, from each side; a ZMQ channel has neither (every field None)."""

from __future__ import annotations

import time

import msgspec
import pytest
import torch
import zmq

from shmclient.channel import REQ_UTILITY, ChannelStatistics, ShmChannel
from shmclient.channel_zmq import ZmqChannel
from shmclient.errors import WouldBlock
from shmclient.messages import UtilityRequest
from shmclient.stats import RingStatistics, TensorStatistics


@pytest.fixture
def channels():
    front, spec = ShmChannel.create(ring_capacity=1 << 16, arena_bytes=1 << 20, spin_us=0.0, wake_fd=False)
    engine = ShmChannel.attach(spec)
    front.peer_attached()
    yield front, engine
    engine.close()
    front.close()


def test_shm_channel_statistics_name_each_side_s_rings_and_tensors(channels):
    front, engine = channels
    t = torch.arange(4096, dtype=torch.float32)  # 16 KiB: out of band, in the arena
    front.send_nowait(REQ_UTILITY, front.encode(UtilityRequest(0, 1, "echo", [t])))
    [(rtype, got)] = engine.recv_nowait()
    assert rtype == REQ_UTILITY and torch.equal(got.args[0], t)

    s = front.statistics()
    assert type(s) is ChannelStatistics and type(s.tx) is RingStatistics and type(s.rx) is RingStatistics
    assert type(s.tensors) is TensorStatistics
    assert s.tx.tx_records == s.tx.rx_records == 1 and s.rx.tx_records == 0
    assert s.tensors.sent_arena == 1 and s.tensors.blocks_in_flight == 1 and s.tensors.arena_bytes == 1 << 20
    # the engine's side sees the same rings the other way round, and its own sender
    e = engine.statistics()
    assert (e.rx, e.tx) == (s.tx, s.rx) and e.tensors.sent_arena == 0
    with pytest.raises(AttributeError):
        s.tx = None  # a snapshot: frozen
    assert msgspec.structs.asdict(s)["tensors"] is s.tensors

    del got
    engine.flush_releases()  # the release rides back on the output ring
    assert front.try_recv() == []
    after = front.statistics()
    assert after.tensors.blocks_in_flight == 0 and after.tensors.released == 1
    assert after.rx.tx_records == 1 and s.tensors.blocks_in_flight == 1  # the old one unchanged


def test_zmq_channel_statistics_have_no_rings_and_no_arena():
    ctx = zmq.Context()
    front, _ = ZmqChannel.create(ctx, f"ipc://@shmc-test-{time.monotonic_ns()}")
    try:
        assert front.statistics() == ChannelStatistics(tx=None, rx=None, tensors=None)
    finally:
        front.close()
        ctx.term()


def test_more_releases_than_one_record_holds_all_go_back():
    # 600 arena blocks freed at once: their release (8 bytes an id) is longer than a
    # record of a 4 KiB ring. It used to be sent as one record, which never fits (a
    # release is not fragmented): it was held for ever, and every later release behind it.
    front, spec = ShmChannel.create(ring_capacity=4096, arena_bytes=1 << 20, spin_us=0.0, wake_fd=False)
    engine = ShmChannel.attach(spec)
    front.peer_attached()
    try:
        ts = [torch.full((64,), i, dtype=torch.float32) for i in range(600)]
        payload = front.encode(UtilityRequest(0, 1, "echo", ts))
        assert front.statistics().tensors.blocks_in_flight == 600
        got = []
        while True:  # the message goes in fragments as the engine reads them
            try:
                front.send_nowait(REQ_UTILITY, payload)
                break
            except WouldBlock:
                got += engine.try_recv()
        while not got:
            got += engine.try_recv()
        [(_, req)] = got
        assert len(req.args) == 600 and all(torch.equal(a, b) for a, b in zip(req.args, ts))
        del got, req
        for _ in range(4):  # each flush sends what room allows; the frontend reads it back
            engine.flush_releases()
            assert front.try_recv() == []
        s = front.statistics().tensors
        assert s.blocks_in_flight == 0 and s.released == 600
        assert engine._held_release is None
    finally:
        engine.close()
        front.close()
