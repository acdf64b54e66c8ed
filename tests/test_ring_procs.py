"""The shared-memory ring between two processes (spawn start method).

Checksummed stress, random sizes across wrap-around, messages larger than the ring, a
producer SIGKILLed mid-stream, the close flag and name removal as the peer sees them.
Child targets are module-level functions; every child is joined with a timeout and
killed if it is still there.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import time
import zlib

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shmclient import waiting
from shmclient.errors import PeerDeadError
from shmclient.ring import Ring, RingSpec
from shmclient.ring_consumer import RingConsumer
from shmclient.ring_producer import RingProducer

from .test_ring import send_batches

CTX = mp.get_context("spawn")
SHM = "/dev/shm"


def _spec_bytes(r: Ring) -> bytes:
    return msgspec.msgpack.encode(r.spec)


def _spec(b: bytes) -> RingSpec:
    return msgspec.msgpack.decode(b, type=RingSpec)


def _record(seq: int, n: int) -> bytes:
    """``seq`` (8 bytes) + crc32 (4) + body; the body is derived from ``seq``."""
    body = (seq.to_bytes(8, "little") * (n // 8 + 1))[:n]
    head = seq.to_bytes(8, "little")
    return head + zlib.crc32(head + body).to_bytes(4, "little") + body


def _check(seq: int, rec: bytes) -> None:
    assert len(rec) >= 12, f"record {seq} truncated to {len(rec)} bytes"
    got = int.from_bytes(rec[:8], "little")
    assert got == seq, f"expected record {seq}, got {got}"
    crc = zlib.crc32(rec[:8] + rec[12:])
    assert crc == int.from_bytes(rec[8:12], "little"), f"record {seq} corrupt"


def _sizes(seed: int, count: int, big: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.choice((rnd.randrange(0, 64), rnd.randrange(0, 600), rnd.randrange(0, big))) for _ in range(count)]


@pytest.fixture(scope="module", autouse=True)
def _resource_tracker():
    """Spawning starts multiprocessing's resource tracker, which lives as long as this
    process; start it before any test so the per-test leak check does not count it."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()


# ---------------------------------------------------------------- child targets


def _producer_main(spec: bytes, count: int, seed: int, big: int, batch: bool) -> None:
    r = RingProducer.attach(_spec(spec))
    try:
        rnd = random.Random(seed ^ 0x5EED)
        sizes = _sizes(seed, count, big)
        i = 0
        while i < count:
            k = rnd.randrange(1, 9) if batch else 1
            recs = [(j % 256, _record(j, sizes[j])) for j in range(i, min(count, i + k))]
            if len(recs) == 1:
                waiting.send(r, *recs[0], timeout=30)
            else:
                send_batches(r, recs, timeout=30)
            i += len(recs)
    finally:
        r.close()


def _sizes_producer_main(spec: bytes, sizes: list[int]) -> None:
    r = RingProducer.attach(_spec(spec), spin_us=10)
    try:
        for i, n in enumerate(sizes):
            waiting.send(r, i % 256, _record(i, n), timeout=30)
    finally:
        r.close()


def _endless_producer_main(spec: bytes, seed: int) -> None:
    """Writes checksummed records until killed; large ones so a kill often lands mid-copy."""
    r = RingProducer.attach(_spec(spec))
    rnd = random.Random(seed)
    seq = 0
    while True:
        n = rnd.choice((rnd.randrange(0, 100), rnd.randrange(0, 70_000), rnd.randrange(0, 300_000)))
        if rnd.random() < 0.3:
            recs = [(1, _record(seq + j, rnd.randrange(0, 5000))) for j in range(rnd.randrange(1, 6))]
            send_batches(r, recs)
            seq += len(recs)
        else:
            waiting.send(r, 1, _record(seq, n))
            seq += 1


def _consumer_main(spec: bytes, expect: int, conn) -> None:
    """Reads ``expect`` records, reports attach and the count, then closes."""
    r = RingConsumer.attach(_spec(spec))
    conn.send("attached")
    n = 0
    try:
        while n < expect:
            n += len(waiting.recv(r, timeout=30))
    finally:
        r.close()
        conn.send(n)


# ---------------------------------------------------------------- helpers


class Child:
    def __init__(self, target, *args) -> None:
        self.proc = CTX.Process(target=target, args=args, daemon=True)
        self.proc.start()

    def alive(self) -> bool:
        return self.proc.is_alive()

    def finish(self, timeout: float = 30) -> int:
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
            pytest.fail("child did not exit in time")
        return self.proc.exitcode


def _consume(c: RingConsumer, count: int, child: Child) -> list[int]:
    seen = 0
    types = []
    while seen < count:
        for rtype, rec in waiting.recv(c, timeout=30, alive=child.alive):
            _check(seen, rec)
            assert rtype == seen % 256
            types.append(rtype)
            seen += 1
    return types


# ---------------------------------------------------------------- tests


def _stress(count: int, capacity: int) -> None:
    c = RingConsumer.create(capacity)
    child = None
    try:
        child = Child(_producer_main, _spec_bytes(c), count, 1234 + count, 3000, True)
        # Read nothing until the producer has hit a full ring (state, not time), so the
        # run always covers backpressure however fast this side would otherwise be.
        deadline = time.monotonic() + 30
        while c.statistics().waits_on_full == 0:
            assert child.alive() and time.monotonic() < deadline, "producer never filled the ring"
        _consume(c, count, child)
        with pytest.raises(PeerDeadError):
            waiting.recv(c, timeout=30, alive=child.alive)  # then its close() is seen
        assert child.finish() == 0
        s = c.statistics()
        assert s.tx_records == s.rx_records == count
        assert s.wraps > 0 and s.waits_on_full > 0
    finally:
        if child is not None and child.proc.is_alive():
            child.proc.kill()
            child.proc.join(5)
        c.close()


def test_stress_checksummed_records_between_processes():
    _stress(100_000, 64 << 10)


@pytest.mark.slow
def test_stress_a_million_records():
    _stress(1_000_000, 256 << 10)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    cap=st.sampled_from([64, 256, 1000]),
    data=st.data(),
)
def test_random_sizes_two_processes(cap, data):
    mr = cap - 8 - 12  # 12 bytes of sequence number and checksum
    sizes = data.draw(
        st.lists(
            st.one_of(st.sampled_from([0, 1, 7, 8, mr - 8, mr - 1, mr, mr + 1, 3 * cap]), st.integers(0, 2 * cap)),
            min_size=1,
            max_size=300,
        )
    )
    c = RingConsumer.create(cap)
    child = None
    try:
        child = Child(_sizes_producer_main, _spec_bytes(c), sizes)
        seen = 0
        while seen < len(sizes):
            recs = waiting.recv(c, timeout=30, alive=child.alive)
            c.unlink()  # something arrived: the producer has attached
            for rtype, rec in recs:
                _check(seen, rec)
                assert len(rec) == sizes[seen] + 12
                seen += 1
        assert child.finish() == 0
    finally:
        if child is not None and child.proc.is_alive():
            child.proc.kill()
            child.proc.join(5)
        c.close()


def test_oversize_messages_between_processes():
    cap = 4096
    sizes = [10, 5 * cap, 1, cap - 20, 3 * cap + 7, 0, 2 * cap, 100] * 3
    c = RingConsumer.create(cap)
    child = None
    try:
        child = Child(_sizes_producer_main, _spec_bytes(c), sizes)
        got = []

        def handler(rtype, view):
            _check(len(got), bytes(view))
            got.append(len(view))

        while len(got) < len(sizes):
            waiting.recv_into(c, handler, timeout=30, alive=child.alive)
        assert got == [n + 12 for n in sizes]
        assert child.finish() == 0
        assert c.statistics().fragments > 0
    finally:
        if child is not None and child.proc.is_alive():
            child.proc.kill()
            child.proc.join(5)
        c.close()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sigkilled_producer_never_yields_a_partial_record(seed, monkeypatch):
    monkeypatch.setattr(waiting, "LIVENESS_S", 0.05)
    rnd = random.Random(seed)
    c = RingConsumer.create(256 << 10)
    child = Child(_endless_producer_main, _spec_bytes(c), seed)
    try:
        kill_after = rnd.randrange(50, 2000)
        seen = 0
        killed = False
        t0 = None
        with pytest.raises(PeerDeadError):
            while True:
                for _, rec in waiting.recv(c, timeout=30, alive=child.alive):
                    _check(seen, rec)
                    seen += 1
                c.unlink()  # the producer has attached
                if not killed and seen >= kill_after:
                    os.kill(child.proc.pid, signal.SIGKILL)
                    killed = True
                    t0 = time.perf_counter()
        assert killed and seen >= kill_after
        assert time.perf_counter() - t0 < 2.0  # noticed within a few liveness intervals
        assert c.try_recv() == []  # nothing half-written ever shows up
    finally:
        if child.proc.is_alive():
            child.proc.kill()
        child.proc.join(5)
        c.close()


def test_consumer_close_and_unlink_seen_across_processes():
    p = RingProducer.create(4096)
    parent, kid = CTX.Pipe()
    child = Child(_consumer_main, _spec_bytes(p), 10, kid)
    try:
        assert parent.poll(30) and parent.recv() == "attached"
        p.unlink()  # owner releases its handle once the peer is in
        with pytest.raises(FileNotFoundError):
            RingConsumer.attach(p.spec)
        for i in range(10):
            waiting.send(p, 1, b"%d" % i, timeout=10)
        assert parent.poll(30) and parent.recv() == 10
        assert child.finish() == 0
        assert p.peer_closed
        with pytest.raises(PeerDeadError, match="consumer closed"):
            while True:  # fills the ring, then learns the consumer has gone
                waiting.send(p, 2, b"x" * 500, timeout=10)
    finally:
        if child.proc.is_alive():
            child.proc.kill()
            child.proc.join(5)
        p.close()
        parent.close()
        kid.close()
