"""The shared-memory ring within one process: both ends on one segment.

Records, wrap-around, fragments, batches, backpressure and timeouts, liveness, close,
names and modes in /dev/shm, the wake FIFO, threads, zero-copy reads and statistics. The
ends never wait more than once themselves; waits with a deadline and a liveness check go
through ``shmclient.waiting``, as everywhere in the package. Cross-process behaviour lives
in ``test_ring_procs``.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import select
import stat
import tempfile
import threading
import time
import zlib

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shmclient import _ring, doorbell, ring as ring_mod, waiting
from shmclient.errors import (
    ClientClosedError,
    PeerDeadError,
    PeerNotConsumingError,
    PeerNotProducingError,
    ShmCapacityError,
    WouldBlock,
)
from shmclient.ring import DEFAULT_CAPACITY, Ring, RingSpec
from shmclient.ring_consumer import RingConsumer
from shmclient.ring_producer import RingProducer
from shmclient.shm import Segment
from shmclient.stats import RingStatistics

SHM = "/dev/shm"


def _shm_path(name: str) -> str:
    return os.path.join(SHM, name.lstrip("/"))


def _sem_path(name: str) -> str:
    return os.path.join(SHM, "sem." + name.lstrip("/"))


class Pair:
    """A producer that owns the ring and a consumer attached to it, in this process."""

    def __init__(self, capacity: int = 4096, **kw) -> None:
        cw = kw.pop("consumer_wake_fd", False)
        self.p = RingProducer.create(capacity, consumer_wake_fd=cw, **kw)
        try:
            self.c = RingConsumer.attach(self.p.spec, **kw)
        except BaseException:
            self.p.close()
            raise
        self.p.unlink()

    def close(self) -> None:
        self.p.close()
        self.c.close()

    def drain(self) -> list[tuple[int, bytes]]:
        out = []
        while True:
            got = self.c.try_recv()
            if not got:
                return out
            out += got


@pytest.fixture
def pair():
    made = []

    def make(capacity: int = 4096, **kw) -> Pair:
        pr = Pair(capacity, **kw)
        made.append(pr)
        return pr

    yield make
    for pr in made:
        pr.close()


def send_batches(p: RingProducer, records, *, timeout: float | None = None, alive=None) -> int:
    """Send every record, in order: as many as fit go together (``send_batch_nowait``),
    and when none fits, the next one waits for room through ``waiting.send``. Returns
    how many batches ``send_batch_nowait`` published."""
    records = list(records)
    i = batches = 0
    while i < len(records):
        try:
            i += p.send_batch_nowait(records[i:])
            batches += 1
        except WouldBlock:
            waiting.send(p, *records[i], timeout=timeout, alive=alive)
            i += 1
    return batches


def payload(i: int, n: int) -> bytes:
    """``n`` bytes determined by ``i`` (cheap, and different for neighbours)."""
    block = i.to_bytes(8, "little") * 2 + bytes([i & 0xFF]) * 15 + b"\x5a"
    return (block * (n // len(block) + 1))[:n]


# ---------------------------------------------------------------- records and layout


def test_round_trip_types_and_payload_kinds(pair):
    pr = pair()
    assert pr.p.try_send(0, b"")
    assert pr.p.try_send(255, b"abc")
    assert pr.p.try_send(7, bytearray(b"bytearray"))
    assert pr.p.try_send(8, memoryview(b"xxmemoryview")[2:])
    import numpy as np

    arr = np.arange(6, dtype=np.uint32)
    assert pr.p.try_send(9, arr)  # any contiguous buffer, taken as its bytes
    assert pr.c.try_recv() == [
        (0, b""),
        (255, b"abc"),
        (7, b"bytearray"),
        (8, b"memoryview"),
        (9, arr.tobytes()),
    ]
    assert pr.c.try_recv() == []


def test_spec_is_msgpack_able(pair):
    pr = pair()
    spec = msgspec.msgpack.decode(msgspec.msgpack.encode(pr.p.spec), type=RingSpec)
    assert spec == pr.p.spec
    assert pr.p.capacity == spec.capacity == 4096
    assert pr.p.max_record == 4096 - 8


def test_default_capacity():
    r = RingConsumer.create()
    try:
        assert r.capacity == DEFAULT_CAPACITY == 4 << 20
    finally:
        r.close()


@pytest.mark.parametrize("rtype", [-1, 256, "a", None])
def test_bad_record_type(pair, rtype):
    pr = pair()
    with pytest.raises(ValueError, match="0..255"):
        pr.p.try_send(rtype, b"x")
    with pytest.raises(ValueError, match="0..255"):
        pr.p.send_nowait(rtype, b"x" * 10_000)  # fragmented path checks too
    with pytest.raises(ValueError, match="0..255"):
        pr.p.send_batch_nowait([(rtype, b"x")])
    assert pr.c.try_recv() == []
    assert pr.p.try_send(1, b"ok") and pr.c.try_recv() == [(1, b"ok")]


def test_payload_larger_than_u32_is_refused(pair):
    pr = pair()
    big = mmap.mmap(-1, (1 << 32) + 1)  # address space only; never touched
    try:
        with pytest.raises(ValueError, match=str((1 << 32) + 1)):
            pr.p.send_nowait(1, big)
        with pytest.raises(ValueError, match=str((1 << 32) + 1)):
            pr.p.try_send(1, big)
        with pytest.raises(ValueError, match=str((1 << 32) + 1)):
            pr.p.send_batch_nowait([(1, big)])
    finally:
        big.close()


@pytest.mark.parametrize("capacity", [63, 100, 0, 32])
def test_bad_capacity(capacity):
    with pytest.raises(ValueError, match="capacity"):
        RingProducer.create(capacity)


def test_only_an_end_is_made_and_tuning_is_checked():
    for call in (lambda: Ring.create(1024), Ring, RingProducer, RingConsumer,
                 lambda: Ring.attach(RingSpec("memfd:1:2:3", 1024))):
        with pytest.raises(TypeError, match="RingProducer.create"):
            call()
    # no role strings: the class is the end
    role = "producer"
    for call in (lambda: Ring.create(role, 1024), lambda: RingProducer.create(role, 1024),
                 lambda: RingConsumer.attach(RingSpec("memfd:1:2:3", 1024), role)):
        with pytest.raises(TypeError):
            call()
    with pytest.raises(ValueError, match="capacity"):
        RingProducer.create("producer")
    with pytest.raises(ValueError, match="spin_us"):
        RingProducer.create(1024, spin_us=-1)
    with pytest.raises(ValueError, match="spin_us"):
        RingConsumer.create(1024, spin_us=float("nan"))


def test_each_end_is_the_wait_handle_of_its_direction(pair):
    """A producer is something ``waiting.send`` waits on, a consumer something
    ``waiting.recv`` / ``waiting.recv_into`` waits on; neither has the other's calls."""
    pr = pair()
    assert isinstance(pr.p, Ring) and isinstance(pr.c, Ring)
    producer = {"try_send", "send_nowait", "send_batch_nowait", "wait_send", "wait_writable", "abandon",
                "space_fileno", "arm_space", "poke", "partial_pending"}
    consumer = {"try_recv", "recv_nowait", "recv_into", "wait_recv", "wait_readable", "has_data",
                "fileno", "drain_wake_fd", "pinned"}
    assert all(hasattr(pr.p, n) for n in producer) and not any(hasattr(pr.p, n) for n in consumer)
    assert all(hasattr(pr.c, n) for n in consumer) and not any(hasattr(pr.c, n) for n in producer)
    assert RingProducer.wait_send is RingProducer.wait_writable
    assert RingConsumer.wait_recv is RingConsumer.wait_readable
    with pytest.raises(AttributeError):
        waiting.recv(pr.p, timeout=1)  # refused at once, never a wait on the wrong end
    with pytest.raises(AttributeError):
        waiting.send(pr.c, 1, b"x", timeout=1)


def test_exact_fit_and_max_record(pair):
    pr = pair(64)
    assert pr.p.max_record == 56
    for i in range(5):  # a record that fills the whole ring, several times over
        assert pr.p.try_send(i, payload(i, 56))
        assert not pr.p.try_send(9, b"")  # full: not even an empty record
        assert pr.c.try_recv() == [(i, payload(i, 56))]
    assert pr.p.try_send(1, payload(1, 20))  # now at offset 32
    assert pr.c.try_recv() == [(1, payload(1, 20))]
    # Must wrap: the 32 bytes to the end are padded and published, but the record needs
    # the whole ring, so it fits only once the consumer has released the padding.
    assert not pr.p.try_send(2, payload(2, 56))
    assert pr.c.try_recv() == []
    assert pr.p.try_send(2, payload(2, 56))
    assert pr.c.try_recv() == [(2, payload(2, 56))]
    s = pr.p.statistics()
    assert s.wraps >= 6 and s.tx_records == s.rx_records == 7


def test_wrap_with_pad_in_the_middle_of_a_batch(pair):
    pr = pair(128)
    assert pr.p.try_send(1, payload(1, 64))  # 72 bytes used
    assert pr.c.try_recv() == [(1, payload(1, 64))]
    recs = [(2, payload(2, 30)), (3, payload(3, 40))]  # 40 fits at 72..112, 48 wraps
    assert pr.p.send_batch_nowait(recs) == 2
    assert pr.c.try_recv() == recs
    assert pr.p.statistics().tx_batches == 2


def _sizes_near(cap: int):
    mr = cap - 8
    edge = st.sampled_from([0, 1, 7, 8, 9, mr - 9, mr - 8, mr - 7, mr - 1, mr, cap // 2 - 8, cap // 2])
    return st.one_of(edge, st.integers(0, mr), st.integers(0, min(64, mr)))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    cap=st.sampled_from([64, 128, 200, 1024]),
    data=st.data(),
)
def test_random_sizes_one_process(cap, data):
    """Interleave try_send / try_recv at random; order and content must survive wraps."""
    sizes = data.draw(st.lists(_sizes_near(cap), min_size=1, max_size=60))
    recv_every = data.draw(st.integers(1, 6))
    pr = Pair(cap)
    try:
        sent, got = [], []
        for i, n in enumerate(sizes):
            rec = (i % 256, payload(i, n))
            if pr.p.try_send(*rec):
                sent.append(rec)
            else:
                got += pr.drain()
                if not pr.p.try_send(*rec):  # it had to wrap: padding published first
                    got += pr.drain()
                    assert pr.p.try_send(*rec), "an empty ring takes any record <= max_record"
                sent.append(rec)
            if i % recv_every == 0:
                got += pr.c.try_recv()
        got += pr.drain()
        assert got == sent
        s = pr.p.statistics()
        assert s.tx_records == s.rx_records == len(sent)
        assert s.tx_bytes == s.rx_bytes == sum(len(b) for _, b in sent)
        assert s.head == s.tail  # everything published was released
    finally:
        pr.close()


# ---------------------------------------------------------------- batches


def test_batch_is_one_doorbell_and_read_in_one_call(pair):
    pr = pair(4096)
    recs = [(i, payload(i, i * 3)) for i in range(20)]
    assert pr.p.send_batch_nowait(recs) == 20
    assert pr.p.send_batch_nowait(recs[:3]) == 3
    assert pr.p.statistics().tx_batches == 2
    assert pr.c.try_recv() == recs + recs[:3]  # every batch available, one call
    s = pr.c.statistics()
    assert s.rx_batches == 1 and s.rx_records == 23  # one read took both


def test_a_batch_writes_what_fits_and_says_how_many(pair):
    pr = pair(256)
    recs = [(i, payload(i, 50)) for i in range(30)]  # 58-byte records, 256 bytes of room
    assert pr.p.send_batch_nowait(recs) == 4  # what fits, published together
    assert pr.p.statistics().tx_batches == 1
    with pytest.raises(WouldBlock, match="full"):
        pr.p.send_batch_nowait(recs[4:])  # not even the first fits
    assert pr.p.send_batch_nowait([]) == 0
    assert pr.c.try_recv() == recs[:4]
    assert pr.p.send_batch_nowait(recs[4:]) == 4  # the rest resume where it stopped
    assert pr.c.try_recv() == recs[4:8]
    # a record longer than one record of the ring ends a batch before it...
    assert pr.p.send_batch_nowait([(1, b"a"), (2, payload(2, 300)), (3, b"c")]) == 1
    # ... and is refused when it comes first (it goes alone, in fragments)
    with pytest.raises(ValueError, match="send_nowait"):
        pr.p.send_batch_nowait([(2, payload(2, 300))])
    assert pr.c.try_recv() == [(1, b"a")]


def test_batch_larger_than_free_space_is_split_not_deadlocked(pair):
    pr = pair(256)
    recs = [(i, payload(i, 50)) for i in range(30)]  # ~1.7 KiB through 256 bytes
    got = []
    t = threading.Thread(target=send_batches, args=(pr.p, recs), kwargs={"timeout": 10})
    t.start()
    while len(got) < len(recs):
        got += waiting.recv(pr.c, timeout=10)
    t.join(10)
    assert got == recs
    assert pr.p.statistics().waits_on_full > 0


# ---------------------------------------------------------------- messages larger than the ring


def test_oversize_messages_intact_in_order_with_small_ones(pair):
    pr = pair(1024)
    msgs = []
    for i in range(12):
        n = [5000, 1017, 3 * 1024 + 1, 10, 1016][i % 5]
        msgs.append((i, payload(i, n)))
    errors = []

    def produce():
        try:
            for rtype, body in msgs:
                waiting.send(pr.p, rtype, body, timeout=10)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    t = threading.Thread(target=produce)
    t.start()
    got = []
    while len(got) < len(msgs):
        got += waiting.recv(pr.c, timeout=10)
    t.join(10)
    assert not errors
    assert got == msgs
    s = pr.c.statistics()
    assert s.fragments > 0 and s.rx_records == len(msgs)


def test_oversize_message_zero_copy(pair):
    pr = pair(512)
    body = payload(3, 40_000)
    t = threading.Thread(target=waiting.send, args=(pr.p, 4, body), kwargs={"timeout": 10})
    t.start()
    seen = []
    while not seen:
        waiting.recv_into(pr.c, lambda rt, v: seen.append((rt, zlib.crc32(v), len(v))), timeout=10)
    t.join(10)
    assert seen == [(4, zlib.crc32(body), len(body))]


def test_try_send_never_fragments(pair):
    pr = pair(256)
    assert pr.p.try_send(1, b"x" * 249) is False  # > max_record: use send_nowait()
    assert pr.c.try_recv() == []


def test_abandoned_fragmented_message_is_dropped(pair):
    pr = pair(256)
    with pytest.raises(PeerNotConsumingError):
        waiting.send(pr.p, 1, payload(1, 2000), timeout=0.05)  # nobody reads: stalls mid-message
    pr.c.try_recv()  # reads the fragments that got through; nothing complete
    waiting.send(pr.p, 2, b"after", timeout=1)
    got = pr.drain()
    assert got == [(2, b"after")]


# ---------------------------------------------------------------- zero-copy reads


def test_a_fragmented_bytearray_resized_before_the_retry_is_sent_anew(pair):
    """A retry passing the same mutable buffer, resized meanwhile, resumed after the
    fragments already written: they no longer added up to the total the first one
    announced, and the consumer closed the ring (RingCorruptError, blaming the peer)."""
    pr = pair(4096)
    buf = bytearray(b"A" * 10_000)
    with pytest.raises(WouldBlock):
        pr.p.send_nowait(1, buf)
    buf += b"B" * 100
    got = []
    reader = threading.Thread(target=lambda: got.extend(waiting.recv(pr.c, timeout=10)))
    reader.start()
    waiting.send(pr.p, 1, buf, timeout=10)
    reader.join(20)
    assert got == [(1, bytes(buf))]


def test_recv_into_views_are_released_after_the_call(pair):
    pr = pair()
    assert pr.p.send_batch_nowait([(1, b"one"), (2, b"two")]) == 2
    kept = []

    def handler(rtype, view):
        assert bytes(view) == {1: b"one", 2: b"two"}[rtype]
        kept.append(view)

    assert pr.c.recv_into(handler) == 2
    with pytest.raises(ValueError):
        bytes(kept[0])  # released: cannot read bytes the producer may overwrite
    assert pr.c.recv_into(handler) == 0


def test_recv_into_handler_error_consumes_that_record_only(pair):
    pr = pair(128)
    recs = [(i, payload(i, 20)) for i in range(3)]
    assert pr.p.send_batch_nowait(recs) == 3

    def bad(rtype, view):
        if rtype == 1:
            raise KeyError("boom")
        got.append((rtype, bytes(view)))

    got = []
    with pytest.raises(KeyError):
        pr.c.recv_into(bad)
    assert got == [recs[0]]
    assert pr.c.recv_into(bad) == 1
    assert got == [recs[0], recs[2]]
    s = pr.c.statistics()  # everything handled (or failed) was released
    assert s.tx_batches == 1 and s.rx_records == 3 and s.head == s.tail
    assert not pr.p.try_send(5, payload(5, 120))  # needs the whole ring: pads first
    assert pr.c.try_recv() == []
    assert pr.p.try_send(5, payload(5, 120))
    assert pr.c.try_recv() == [(5, payload(5, 120))]


def test_close_inside_handler_with_exported_view(pair):
    import numpy as np

    pr = pair()
    assert pr.p.send_batch_nowait([(1, b"12345678"), (2, b"x")]) == 2
    keep = []

    def handler(rtype, view):
        keep.append(np.frombuffer(view, dtype=np.uint8))  # an export outlives the call
        pr.c.close()

    with pytest.raises(ClientClosedError):
        pr.c.recv_into(handler)
    assert bytes(keep[0]) == b"12345678"  # mapping stays alive while the export does
    keep.clear()


# ---------------------------------------------------------------- waiting


def test_full_ring_times_out_saying_peer_not_consuming(pair, monkeypatch):
    monkeypatch.setattr(waiting, "LIVENESS_S", 0.02)  # several slices in the timeout
    pr = pair(128)
    assert pr.p.try_send(1, payload(1, 100))
    t0 = time.perf_counter()
    with pytest.raises(PeerNotConsumingError, match="the peer is not consuming") as ei:
        waiting.send(pr.p, 2, payload(2, 100), timeout=0.15)
    dt = time.perf_counter() - t0
    assert 0.14 <= dt < 1.0
    msg = str(ei.value).lower()
    assert "bigger" not in msg and "larger" not in msg and "shm-size" not in msg
    assert pr.p.statistics().waits_on_full == 1


def test_empty_ring_times_out_saying_peer_not_producing(pair, monkeypatch):
    monkeypatch.setattr(waiting, "LIVENESS_S", 0.02)
    pr = pair()
    t0 = time.perf_counter()
    with pytest.raises(PeerNotProducingError, match="the peer is not producing"):
        waiting.recv(pr.c, timeout=0.15)
    assert 0.14 <= time.perf_counter() - t0 < 1.0
    with pytest.raises(PeerNotProducingError):
        waiting.recv_into(pr.c, print, timeout=0.01)
    with pytest.raises(PeerNotProducingError):
        waiting.recv(pr.c, timeout=0)


@pytest.mark.parametrize("side", ["consumer", "producer"])
def test_liveness_check_runs_at_the_interval_and_raises(pair, side, monkeypatch):
    monkeypatch.setattr(waiting, "LIVENESS_S", 0.03)
    pr = pair(128, spin_us=0)
    calls = []

    def alive():
        calls.append(time.perf_counter())
        return len(calls) < 4

    t0 = time.perf_counter()
    with pytest.raises(PeerDeadError, match="liveness"):
        if side == "consumer":
            waiting.recv(pr.c, alive=alive)  # timeout None: forever, but liveness still checked
        else:
            assert pr.p.try_send(1, payload(1, 100))
            waiting.send(pr.p, 2, payload(2, 100), alive=alive)
    dt = time.perf_counter() - t0
    assert len(calls) == 4
    assert 0.08 <= dt < 1.0  # a slice of 0.03 s before each check, bounded
    gaps = [b - a for a, b in zip(calls, calls[1:])]
    assert max(gaps) < 0.5


def test_dead_peer_that_published_first_is_read_before_the_error(pair, monkeypatch):
    monkeypatch.setattr(waiting, "LIVENESS_S", 0.02)
    pr = pair()
    pr.p.try_send(1, b"last words")
    assert waiting.recv(pr.c, alive=lambda: False) == [(1, b"last words")]
    with pytest.raises(PeerDeadError):
        waiting.recv(pr.c, alive=lambda: False)


def test_blocked_waiter_uses_no_cpu(pair):
    pr = pair(spin_us=30)  # waits in slices of waiting.LIVENESS_S (0.1 s)
    used = []

    def wait():
        t0 = time.thread_time()
        with pytest.raises(PeerNotProducingError):
            waiting.recv(pr.c, timeout=0.5)
        used.append(time.thread_time() - t0)

    t = threading.Thread(target=wait)
    t.start()
    t.join(5)
    assert used and used[0] < 0.05  # < 10 % of the 0.5 s, in practice ~1 ms


def test_zero_spin_budget_still_delivers(pair):
    pr = pair(spin_us=0)
    t = threading.Thread(target=lambda: waiting.send(pr.p, 3, b"z", timeout=5))
    t.start()
    assert waiting.recv(pr.c, timeout=5) == [(3, b"z")]
    t.join(5)


# ---------------------------------------------------------------- close


def test_producer_close_seen_after_pending_data(pair):
    pr = pair()
    assert pr.p.send_batch_nowait([(1, b"a"), (2, b"b")]) == 2
    assert not pr.c.peer_closed
    pr.p.close()
    assert pr.c.peer_closed
    assert waiting.recv(pr.c, timeout=1) == [(1, b"a"), (2, b"b")]
    with pytest.raises(PeerDeadError, match="closed"):
        waiting.recv(pr.c, timeout=1)
    with pytest.raises(PeerDeadError):
        pr.c.try_recv()


def test_consumer_close_seen_by_blocked_producer(pair, monkeypatch):
    monkeypatch.setattr(waiting, "LIVENESS_S", 5.0)  # the close post wakes it, not the liveness tick
    pr = pair(128)
    assert pr.p.try_send(1, payload(1, 100))
    errors = []

    def produce():
        try:
            waiting.send(pr.p, 2, payload(2, 100), timeout=20)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=produce)
    t.start()
    t0 = time.perf_counter()
    pr.c.close()
    t.join(10)
    assert isinstance(errors[0], PeerDeadError)
    assert time.perf_counter() - t0 < 4.0
    assert pr.p.peer_closed
    with pytest.raises(PeerDeadError):
        pr.p.try_send(3, b"x")


def test_close_wakes_own_blocked_thread(pair, monkeypatch):
    monkeypatch.setattr(waiting, "LIVENESS_S", 5.0)  # the close wakes it, not the liveness tick
    pr = pair()
    errors = []

    def consume():
        try:
            waiting.recv(pr.c, timeout=20)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=consume)
    t.start()
    t0 = time.perf_counter()
    pr.c.close()
    t.join(10)
    assert isinstance(errors[0], ClientClosedError)
    assert time.perf_counter() - t0 < 4.0


def test_arm_space_after_close_is_refused_and_reads_no_descriptor():
    """A task parked for room runs ``arm_space`` once more after its channel closed: it
    drained the space pipe by its old number, raising EBADF, or reading away the bytes
    of whatever file had the number by then (and blocking, on a blocking one)."""
    p = RingProducer.create(4096, producer_wake_fd=True)
    c = RingConsumer.attach(p.spec)
    fd = p.space_fileno()
    p.close()
    r, w = os.pipe()  # a file of someone else's under the pipe's old number
    try:
        if r != fd:
            os.dup2(r, fd)
            os.close(r)
        os.set_blocking(fd, False)
        os.write(w, b"not yours")
        with pytest.raises(ClientClosedError):
            p.arm_space()
        assert os.read(fd, 100) == b"not yours"
    finally:
        os.close(fd)
        os.close(w)
        c.close()


def test_use_after_close_and_idempotence(pair):
    pr = pair()
    pr.p.try_send(1, b"x")
    pr.c.try_recv()
    pr.p.close()
    pr.p.close()
    pr.p.unlink()
    for call in (lambda: pr.p.try_send(1, b""), lambda: pr.p.send_nowait(1, b""), lambda: waiting.send(pr.p, 1, b""),
                 lambda: pr.p.send_batch_nowait([]), lambda: pr.p.wait_send(0.0)):
        with pytest.raises(ClientClosedError):
            call()
    assert pr.p.statistics().tx_records == 1  # as it was at close
    pr.c.close()
    with pytest.raises(ClientClosedError):
        pr.c.try_recv()
    with pytest.raises(ClientClosedError):
        waiting.recv(pr.c, timeout=0)
    # has_data reaches the C end without a check of its own: it raised a bare ValueError
    # there (so did any call racing a close from another thread).
    for call in (lambda: pr.c.recv_nowait(), lambda: pr.c.recv_nowait(1), lambda: pr.c.recv_into(print),
                 lambda: waiting.recv_into(pr.c, print, timeout=0), lambda: pr.c.wait_recv(0.0),
                 lambda: pr.c.has_data()):
        with pytest.raises(ClientClosedError, match=r"this (consumer|producer) end of the ring was closed"):
            call()
    assert pr.c.closed


def test_recv_nowait_raises_where_try_recv_returns_nothing(pair):
    pr = pair()
    with pytest.raises(WouldBlock):
        pr.c.recv_nowait()
    with pytest.raises(WouldBlock):
        pr.c.recv_nowait(limit=2)
    assert pr.p.send_batch_nowait([(1, b"a"), (2, bytearray(b"b")), (3, b"c")]) == 3
    assert pr.c.recv_nowait(limit=2) == [(1, b"a"), (2, b"b")]  # the rest stay
    got = pr.c.recv_nowait()
    assert got == [(3, b"c")] and type(got[0][1]) is bytes  # copied out
    assert pr.p.try_send(4, b"last")
    pr.p.close()
    assert pr.c.recv_nowait() == [(4, b"last")]  # what came before the close first
    with pytest.raises(PeerDeadError, match="closed"):
        pr.c.recv_nowait()
    with pytest.raises(PeerDeadError):
        pr.c.recv_nowait(limit=1)
    with pytest.raises(PeerDeadError):
        pr.c.recv_into(print)


# ---------------------------------------------------------------- names and lifecycle


def _fd_targets() -> set[str]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return out


def test_nothing_is_named_and_handles_stop_opening_after_unlink():
    tmp = tempfile.gettempdir()  # (the session's private folder; the shared ones churn)
    before_tmp = set(os.listdir(tmp))
    p = RingConsumer.create(1024, consumer_wake_fd=True, prefix="shmctest")
    try:
        spec = p.spec
        assert not [n for n in os.listdir(SHM) if n.startswith("shmctest")]
        assert set(os.listdir(tmp)) == before_tmp
        assert spec.segment.startswith("memfd:") and spec.wake_pipe.startswith("pipe:")
        c = RingProducer.attach(spec)
        try:
            p.unlink()
            p.unlink()
            with pytest.raises(FileNotFoundError, match="gone"):
                RingProducer.attach(spec)  # the handle no longer opens
            assert c.try_send(1, b"still works")  # mappings and fds stay
            p.drain_wake_fd()
            assert p.try_recv() == [(1, b"still works")]
        finally:
            c.close()
    finally:
        p.close()


def test_close_without_unlink_leaves_no_fd_or_mapping():
    fds = _fd_targets()
    p = RingProducer.create(1024, consumer_wake_fd=True)
    c = RingConsumer.attach(p.spec)
    spec = p.spec
    c.close()
    p.close()
    with pytest.raises(FileNotFoundError):
        RingConsumer.attach(spec)
    assert _fd_targets() <= fds | {f"/proc/{os.getpid()}/fd"}


def test_attached_side_never_releases_the_handle(pair):
    pr = Pair.__new__(Pair)
    pr.p = RingProducer.create(1024)
    try:
        pr.c = RingConsumer.attach(pr.p.spec)
        pr.c.unlink()
        pr.c.close()
        again = RingConsumer.attach(pr.p.spec)  # the owner's handle still opens
        again.close()
    finally:
        pr.p.close()


def test_a_recycled_fd_number_is_refused():
    seg = Segment.create(8192)
    handle = seg.name
    seg.release_handle()
    other = Segment.create(8192)  # very likely gets the same fd number
    try:
        kind, pid, fd, ino = handle.split(":")
        stale = f"memfd:{pid}:{other.fd}:{ino}"
        with pytest.raises(FileNotFoundError, match="gone"):
            Segment.attach(stale)
    finally:
        seg.close()
        other.close()
        other.release_handle()


def test_ring_larger_than_memory_fails_at_create_and_leaves_nothing(monkeypatch):
    before = _fd_targets()

    def no_room(fd, off, size):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    with pytest.raises(ShmCapacityError, match=str(8192 + ring_mod.HEADER_BYTES)):
        RingProducer.create(8192)
    assert _fd_targets() <= before | {f"/proc/{os.getpid()}/fd"}


def test_attach_checks_the_segment_is_a_ring():
    p = RingProducer.create(1024)
    try:
        spec = p.spec
        # (a segment of another size than the ring's is refused before it is mapped)
        with pytest.raises(ValueError, match=r"bytes, not the \d+ expected"):
            RingConsumer.attach(RingSpec(spec.segment, 2048))
        seg = Segment.create(8192)
        try:
            with pytest.raises(ValueError, match=r"bytes, not the \d+ expected"):
                RingConsumer.attach(RingSpec(seg.name, 1024))
        finally:
            seg.close()
            seg.unlink()
        seg = Segment.create(ring_mod.HEADER_BYTES + 1024)  # the right size, not a ring
        try:
            with pytest.raises(ValueError, match="not a version"):
                RingConsumer.attach(RingSpec(seg.name, 1024))
        finally:
            seg.close()
            seg.unlink()
        with pytest.raises(ValueError, match="handle"):
            RingConsumer.attach(RingSpec("/shmc-old-name", 1024))
    finally:
        p.close()


# ---------------------------------------------------------------- threads


def _stamp(tid: int, seq: int, n: int) -> bytes:
    body = payload(tid * 1_000_003 + seq, n)
    head = tid.to_bytes(2, "little") + seq.to_bytes(4, "little")
    return head + zlib.crc32(head + body).to_bytes(4, "little") + body


def test_threaded_producer_keeps_records_intact(pair):
    pr = pair(2048)
    n_threads, per = 4, 400
    errors = []

    def produce(tid):
        try:
            for seq in range(per):
                size = (seq * 37 + tid * 11) % 700
                if seq % 3:
                    waiting.send(pr.p, tid, _stamp(tid, seq, size), timeout=10)
                else:
                    send_batches(pr.p, [(tid, _stamp(tid, seq, size))], timeout=10)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=produce, args=(t,)) for t in range(n_threads)]
    for t in threads:
        t.start()
    nxt = [0] * n_threads
    total = 0
    while total < n_threads * per:
        for rtype, body in waiting.recv(pr.c, timeout=10):
            tid = int.from_bytes(body[:2], "little")
            seq = int.from_bytes(body[2:6], "little")
            assert rtype == tid
            assert zlib.crc32(body[:6] + body[10:]) == int.from_bytes(body[6:10], "little")
            assert seq == nxt[tid]  # per-thread order kept
            nxt[tid] += 1
            total += 1
    for t in threads:
        t.join(10)
    assert not errors


def test_threaded_consumer_shares_one_end(pair):
    pr = pair(1024)
    n = 2000
    got: list[int] = []
    lock = threading.Lock()
    done = threading.Event()

    def consume():
        while not done.is_set():
            try:
                recs = waiting.recv(pr.c, timeout=0.05)
            except PeerNotProducingError:
                continue
            with lock:
                got.extend(int.from_bytes(b, "little") for _, b in recs)
                if len(got) >= n:
                    done.set()

    threads = [threading.Thread(target=consume) for _ in range(3)]
    for t in threads:
        t.start()
    for i in range(n):
        waiting.send(pr.p, 1, i.to_bytes(4, "little"), timeout=10)
    assert done.wait(10)
    for t in threads:
        t.join(10)
    assert sorted(got) == list(range(n))


# ---------------------------------------------------------------- wake fd


def _readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


@pytest.mark.parametrize("owner", ["consumer", "producer"])
def test_wake_fd_readable_when_a_batch_is_published(owner):
    if owner == "consumer":
        c = RingConsumer.create(1024, consumer_wake_fd=True)
        p = RingProducer.attach(c.spec)
        c.unlink()
    else:
        p = RingProducer.create(1024, consumer_wake_fd=True)
        c = RingConsumer.attach(p.spec)
        p.unlink()  # the producer opens its end before the name goes
    try:
        fd = c.fileno()
        assert not _readable(fd)
        assert p.send_batch_nowait([(1, b"a"), (2, b"b")]) == 2
        assert _readable(fd)
        c.drain_wake_fd()
        assert _readable(fd)  # records still unread: it stays readable
        assert c.try_recv() == [(1, b"a"), (2, b"b")]
        c.drain_wake_fd()
        assert not _readable(fd)
        p.close()
        assert _readable(fd)  # close wakes too; never a POLLHUP storm afterwards
        c.drain_wake_fd()
        assert not _readable(fd)
        with pytest.raises(PeerDeadError):
            c.try_recv()
    finally:
        p.close()
        c.close()


def test_fileno_needs_the_flag(pair):
    pr = pair()
    with pytest.raises(ValueError, match="consumer_wake_fd"):
        pr.c.fileno()


async def test_wake_fd_with_an_event_loop(pair):
    pr = pair(consumer_wake_fd=True)
    loop = asyncio.get_running_loop()
    got: list = []
    done = loop.create_future()

    def on_wake():
        pr.c.drain_wake_fd()
        got.extend(pr.c.try_recv())
        if len(got) >= 50 and not done.done():
            done.set_result(None)

    loop.add_reader(pr.c.fileno(), on_wake)
    try:
        t = threading.Thread(target=lambda: [waiting.send(pr.p, 1, payload(i, i), timeout=5) for i in range(50)])
        t.start()
        await asyncio.wait_for(done, 5)
        t.join(5)
    finally:
        loop.remove_reader(pr.c.fileno())
    assert got == [(1, payload(i, i)) for i in range(50)]


# ---------------------------------------------------------------- statistics


def test_statistics_from_both_sides_are_one_frozen_record(pair):
    pr = pair(256)
    assert pr.p.send_batch_nowait([(1, b"x" * 10), (2, b"y" * 20)]) == 2
    assert pr.c.try_recv()
    a, b = pr.p.statistics(), pr.c.statistics()
    assert type(a) is RingStatistics and a == b
    assert a.tx_records == 2 and a.tx_bytes == 30 and a.tx_batches == 1
    assert a.rx_records == 2 and a.rx_bytes == 30 and a.rx_batches == 1
    # every counter the C end reads from the header, under its name, and nothing else
    counters, _ = _ring.stats(pr.p._res.seg.buf)
    assert msgspec.structs.asdict(a) == counters
    with pytest.raises(AttributeError):
        a.tx_records = 0  # a snapshot: frozen
    pr.p.try_send(3, b"z")
    assert pr.p.statistics().tx_records == 3 and a.tx_records == 2


def test_statistics_after_close_are_those_at_close(pair):
    pr = pair(256)
    assert pr.p.try_send(1, b"x")
    pr.p.close()
    at_close = pr.p.statistics()
    assert at_close.tx_records == 1 and pr.p.statistics() is at_close
    assert pr.c.try_recv() == [(1, b"x")]
    assert pr.c.statistics().rx_records == 1 and at_close.rx_records == 0


def test_spin_budget_stretches_only_while_the_peer_answers_right_after_we_block():
    s = doorbell.Spin(30e-6)
    s.after(False, 50e-6)  # the data came just after the spin gave up
    assert s.budget == pytest.approx(60e-6)
    for _ in range(3):
        s.after(False, 10e-6)
    assert s.budget == pytest.approx(30e-6 * doorbell.Spin.STRETCH)  # bounded
    s.after(True, 0.0)  # the longer spin paid
    s.after(False, 0.05)  # the peer was idle: back to the configured budget
    assert s.budget == pytest.approx(30e-6)
    z = doorbell.Spin(0.0)
    z.after(False, 1e-6)
    assert z.budget == 0.0  # zero means never spin


def test_spin_backs_off_when_it_keeps_failing_and_probes_to_resume():
    s = doorbell.Spin(30e-6)
    for _ in range(doorbell.Spin.MISSES):
        s.after(False, 0.01)  # every spin ended in a sleep anyway (a busy host)
    assert s.budget == 0.0
    for _ in range(doorbell.Spin.PROBE - 1):
        s.after(False, 1e-6)  # a quick answer after sleeping proves nothing
        assert s.budget == 0.0
    s.after(False, 0.01)
    assert s.budget == pytest.approx(30e-6)  # a probe
    s.after(False, 0.01)
    assert s.budget == 0.0  # the probe failed: back off again
    for _ in range(doorbell.Spin.PROBE):
        s.after(False, 0.01)
    assert s.budget == pytest.approx(30e-6)
    s.after(True, 0.0)  # the probe paid: spinning resumes for good
    s.after(False, 0.01)
    assert s.budget == pytest.approx(30e-6)


def test_a_timed_out_fragmented_send_resumes_and_nothing_slips_between_its_fragments(pair):
    pr = pair(4096)
    big = payload(3, 20_000)  # five ring-fulls
    with pytest.raises(PeerNotConsumingError):
        waiting.send(pr.p, 7, big, timeout=0.05)  # the consumer is not reading yet
    assert pr.c.try_recv() == []  # it reads the fragments so far: the ring has room now
    assert not pr.p.try_send(1, b"release")  # would land between two fragments
    got = []
    reader = threading.Thread(target=lambda: got.extend(waiting.recv(pr.c, timeout=5)))
    reader.start()
    waiting.send(pr.p, 7, big, timeout=5)  # resumes after the fragments already written
    reader.join(10)
    waiting.send(pr.p, 1, b"next", timeout=5)
    while len(got) < 2:
        got += waiting.recv(pr.c, timeout=5)
    assert got == [(7, big), (1, b"next")]
    assert pr.p.statistics().fragments <= 20_000 // pr.p._frag_chunk + 2  # no restart from 0


def test_short_receive_windows_that_time_out_do_not_switch_the_spin_off(pair):
    """A caller polling with windows shorter than the spin (an event loop's reader) times
    out often; that is no evidence against spinning, so the spin stays on."""
    pr = pair(4096, spin_us=50)
    for _ in range(3 * doorbell.Spin.MISSES):
        with pytest.raises(PeerNotProducingError):
            waiting.recv(pr.c, timeout=20e-6)
    assert pr.c._spin.budget > 0
