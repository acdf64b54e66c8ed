"""A producer's quiet publishes: the records are there for a consumer that looks, but a
sleeping consumer is not woken (its sleep flag stays set, its wake pipe stays empty)
until ``wake_owed()``, which wakes it exactly once; a publish that wakes settles what was
owed; after close nothing is owed."""

from __future__ import annotations

import select
import struct
import threading
import time

import pytest

from shmclient.errors import WouldBlock
from shmclient.ring_consumer import RingConsumer
from shmclient.ring_producer import RingProducer

OFF_C_WAIT = 448  # the consumer's sleep flag (see _ring.c's layout)


@pytest.fixture
def pair():
    made = []

    def make(**kw):
        p = RingProducer.create(4096, spin_us=0, **kw)
        c = RingConsumer.attach(p.spec, spin_us=0)
        made.append((p, c))
        return p, c

    try:
        yield make
    finally:
        for p, c in made:
            c.close()
            p.close()
            c.unlink()
            p.unlink()


def _wait_flag(p: RingProducer) -> int:
    return struct.unpack_from("<I", p._res.seg.buf, OFF_C_WAIT)[0]


def _readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


def _until(pred, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")


def test_a_quiet_publish_leaves_a_sleeping_consumer_asleep_until_wake_owed(pair):
    p, c = pair()
    result: dict = {}

    def wait() -> None:
        result["ready"] = c.wait_readable(20.0, spin=0.0)

    t = threading.Thread(target=wait)
    t.start()
    try:
        _until(lambda: _wait_flag(p) & 1)  # asleep on the futex
        p.quiet = True
        p.send_nowait(1, b"a")
        p.quiet = False
        assert _wait_flag(p) & 1  # nobody cleared the flag: no wake-up was given
        assert t.is_alive() and "ready" not in result
        assert p.wake_owed() is True
        t.join(10)
        assert not t.is_alive() and result["ready"] is True
        assert p.wake_owed() is False  # given once
        assert c.try_recv() == [(1, b"a")]
    finally:
        p.wake_owed()
        t.join(10)


def test_quiet_publishes_keep_the_wake_pipe_empty_until_wake_owed(pair):
    p, c = pair(consumer_wake_fd=True)
    fd = c.fileno()
    assert not _readable(fd)
    p.quiet = True
    assert p.quiet is True
    p.send_nowait(1, b"a")
    assert p.send_batch_nowait([(2, b"b"), (3, b"c")]) == 2
    p.quiet = False
    assert not _readable(fd)  # published, but the event loop is not woken
    assert c.has_data()  # a consumer that looks finds the records
    assert p.wake_owed() is True
    assert _readable(fd)
    c.drain_wake_fd()
    assert c.try_recv() == [(1, b"a"), (2, b"b"), (3, b"c")]
    c.drain_wake_fd()
    assert not _readable(fd)
    assert p.wake_owed() is False


def test_a_publish_that_wakes_settles_what_was_owed(pair):
    p, c = pair(consumer_wake_fd=True)
    fd = c.fileno()
    p.quiet = True
    p.send_nowait(1, b"a")
    p.quiet = False
    p.send_nowait(2, b"b")  # wakes, for both records
    assert _readable(fd)
    assert p.wake_owed() is False
    assert c.try_recv() == [(1, b"a"), (2, b"b")]


def test_a_waking_send_that_does_not_fit_still_gives_the_wake_up_owed(pair):
    """A send with its wake-up (not quiet) that found no room published nothing, so it
    gave nothing: the wake-up the quiet publishes before it owed stayed owed, and a
    consumer asleep could sleep on a full ring of records it had not seen while the
    producer waited for room."""
    for send in ("try_send", "send_nowait", "send_batch_nowait"):
        p, c = pair(consumer_wake_fd=True)
        fd = c.fileno()
        p.quiet = True
        while p.try_send(1, b"z" * 500):
            pass
        p.quiet = False
        assert not _readable(fd)
        if send == "try_send":
            assert p.try_send(1, b"z" * 500) is False
        else:
            with pytest.raises(WouldBlock):
                getattr(p, send)(*((1, b"z" * 500) if send == "send_nowait" else ([(1, b"z" * 500)],)))
        assert _readable(fd), send
        assert p.wake_owed() is False, send


def test_nothing_is_owed_after_close(pair):
    p, c = pair(consumer_wake_fd=True)
    fd = c.fileno()
    p.quiet = True
    p.send_nowait(1, b"a")
    p.close()  # close wakes every waiter and the pipe, quiet or not
    assert p.quiet is False
    assert _readable(fd)
    assert p.wake_owed() is False
    assert c.try_recv() == [(1, b"a")]


# ---------------------------------------------------------------- the channel


@pytest.fixture
def channels():
    from shmclient.channel import ShmChannel

    front, spec = ShmChannel.create(ring_capacity=4096, arena_bytes=0, spin_us=0.0, wake_fd=True)
    engine = ShmChannel.attach(spec)
    front.peer_attached()
    try:
        yield front, engine
    finally:
        engine.close()
        front.close()


def test_a_channel_send_without_wake_owes_the_peer_its_wake_up(channels):
    front, engine = channels
    fd = front.recv_fd()
    engine.send_nowait(5, b"held", wake=False)
    assert not _readable(fd) and front.readable()
    assert engine.wake_owed() is True and _readable(fd)
    assert engine.wake_owed() is False
    assert front.rx.try_recv() == [(5, b"held")]
    front.arm_recv()
    engine.send_nowait(5, b"woken")  # the default wakes at once
    assert _readable(fd) and engine.wake_owed() is False
