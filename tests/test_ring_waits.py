"""The ring's C wait with several threads on one end and with odd timeouts: a thread
leaving its wait never takes the sleep flag from another still asleep (its wake-up would be
lost); a release after a failed write ends every wait for room, whatever loaded the tail
meanwhile; an infinite timeout sleeps without a deadline (no polling); NaN or negative ones
are refused with ValueError."""

from __future__ import annotations

import math
import struct
import threading
import time

import pytest

from shmclient import _ring, waiting
from shmclient.errors import PeerNotProducingError
from shmclient.ring import Ring
from shmclient.ring_consumer import RingConsumer
from shmclient.ring_producer import RingProducer

OFF_C_WAIT = 448  # the consumer's sleep flag (see _ring.c's layout)


@pytest.fixture
def pair():
    p = RingProducer.create(4096, spin_us=0)
    c = RingConsumer.attach(p.spec, spin_us=0)
    try:
        yield p, c
    finally:
        c.close()
        p.close()
        c.unlink()
        p.unlink()


def _sleep_flag(p: Ring) -> int:
    return struct.unpack_from("<I", p._res.seg.buf, OFF_C_WAIT)[0] & 1


def _until(pred, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")


def _thread_cpu_ns(tid: int) -> int:
    with open(f"/proc/self/task/{tid}/schedstat", encoding="ascii") as f:
        return int(f.read().split()[0])


def test_a_leaving_waiter_keeps_the_other_sleeper_wakeable(pair):
    p, c = pair
    result: dict = {}

    def long_wait() -> None:
        t0 = time.monotonic()
        result["ready"] = c.wait_readable(20.0, spin=0.0)
        result["took"] = time.monotonic() - t0

    t = threading.Thread(target=long_wait)
    t.start()
    try:
        _until(lambda: _sleep_flag(p))  # the long waiter is asleep
        # a second waiter on the same end comes and goes (times out)
        assert c.wait_readable(0.01, spin=0.0) is False
        assert _sleep_flag(p) == 1, "the leaving waiter cleared the flag of the one still asleep"
        assert p.try_send(1, b"x")
        t.join(10)
        assert not t.is_alive(), "the sleeper missed its wake-up"
    finally:
        if t.is_alive():
            p.try_send(1, b"unblock")
            t.join(25)
    assert result["ready"] is True
    assert result["took"] < 10.0
    assert c.try_recv()


def _fill(p: RingProducer) -> None:
    """Write until a record does not fit (the failed write a wait for room follows)."""
    while p.try_send(1, b"x" * 400):
        pass


def test_a_release_before_the_wait_for_room_is_seen_after_pending(pair):
    # The producer's wait compared tail with its cached copy, which pending() (called for
    # a WouldBlock's message) refreshed too: a release between the failed write and that
    # message made the wait sleep with the ring empty, until its timeout.
    p, c = pair
    _fill(p)
    assert len(c.try_recv()) > 1  # the consumer releases everything
    assert p._c.pending() == 0
    t0 = time.monotonic()
    assert p._c.wait_space(0.0, 5.0) in (_ring.READY, _ring.SLEPT)
    assert p.wait_writable(5.0, spin=0.0) is True
    assert time.monotonic() - t0 < 2.0, "the wait for room missed a release it came after"
    assert p.try_send(1, b"x" * 400)


def test_one_release_ends_every_threads_wait_for_room(pair):
    # Two producer threads wait for room; one release wakes both. The first to re-check
    # used to store the new tail as the reference, so the second found no change and
    # slept on until its timeout.
    p, c = pair
    _fill(p)
    waits = p.statistics().waits_on_full
    out: dict = {}

    def wait_room(name: str) -> None:
        t0 = time.monotonic()
        out[name] = (p.wait_writable(10.0, spin=0.0), time.monotonic() - t0)

    threads = [threading.Thread(target=wait_room, args=(n,)) for n in "ab"]
    for t in threads:
        t.start()
    try:
        # a wait holds the GIL from its start until it sleeps in the kernel: once both
        # have counted themselves, both are asleep (or already back)
        _until(lambda: p.statistics().waits_on_full == waits + 2)
        assert c.try_recv()
        for t in threads:
            t.join(15)
        assert not any(t.is_alive() for t in threads)
    finally:
        c.close()  # wakes a waiter still asleep
        for t in threads:
            t.join(15)
    assert out["a"][0] is True and out["b"][0] is True, out
    assert max(out["a"][1], out["b"][1]) < 5.0, f"a waiter slept past the release: {out}"


def test_an_infinite_timeout_sleeps_without_polling(pair):
    p, c = pair
    done = threading.Event()
    out: dict = {}

    def forever() -> None:
        out["tid"] = threading.get_native_id()
        out["ready"] = c.wait_readable(math.inf, spin=0.0)
        done.set()

    t = threading.Thread(target=forever)
    t.start()
    try:
        _until(lambda: "tid" in out and _sleep_flag(p))
        cpu0 = _thread_cpu_ns(out["tid"])
        w0 = time.monotonic()
        done.wait(0.3)  # the window over which its CPU time is measured
        cpu = _thread_cpu_ns(out["tid"]) - cpu0
        wall = time.monotonic() - w0
        assert not done.is_set()
        assert cpu < 0.05 * wall * 1e9, f"an infinite wait used {cpu / 1e6:.1f} ms of CPU in {wall:.2f} s"
        assert p.try_send(1, b"x")
        t.join(10)
        assert not t.is_alive()
    finally:
        if t.is_alive():
            p.try_send(1, b"unblock")
            t.join(10)
    assert out["ready"] is True


@pytest.mark.parametrize("bad", [math.nan, -1.0])
def test_nan_or_negative_timeouts_are_refused(pair, bad):
    p, c = pair
    with pytest.raises(ValueError, match="timeout"):
        c._c.wait(0.0, bad)
    with pytest.raises(ValueError, match="timeout"):
        p._c.wait_space(0.0, bad)
    with pytest.raises(ValueError, match="timeout"):
        c.wait_readable(bad)
    with pytest.raises(ValueError, match="spin"):
        c._c.wait(bad, 1.0)


@pytest.mark.parametrize("bad", [math.nan, -0.5])
def test_waiting_refuses_nan_or_negative_timeouts(pair, bad):
    p, c = pair  # each end is a wait handle of its own
    with pytest.raises(ValueError, match="timeout"):
        waiting.recv(c, timeout=bad)
    with pytest.raises(ValueError, match="timeout"):
        waiting.recv_into(c, print, timeout=bad)
    with pytest.raises(ValueError, match="timeout"):
        waiting.send(p, 1, b"x", timeout=bad)
    assert p.try_send(1, b"x")  # nothing went: the refusal comes before any try
    assert c.try_recv() == [(1, b"x")]


@pytest.fixture
def gate_never():
    """The process's spin gate vetoes every spin (as on a host without a free CPU)."""
    old = _ring.gate.mode
    _ring.gate.mode = "never"
    try:
        yield
    finally:
        _ring.gate.mode = old


def test_a_vetoed_spin_is_not_turned_into_a_sleep(pair, gate_never):
    # An event loop's read (waiting.recv_spin: timeout 0, a spin) must never sleep. The
    # wait used to take max(timeout, spin) as its deadline, so a spin the gate vetoed
    # became a futex sleep of the spin's length, holding the loop.
    p, c = pair
    denied = _ring.gate.state()["spins_denied"]
    t0 = time.monotonic()
    assert c.wait_readable(0.0, spin=2.0) is False
    assert time.monotonic() - t0 < 1.0
    assert _ring.gate.state()["spins_denied"] == denied + 1  # it asked, and was refused
    # a spin the gate allows still runs with a timeout of 0 (that is what a spin is)
    _ring.gate.mode = "always"
    allowed = _ring.gate.state()["spins_allowed"]
    assert c.wait_readable(0.0, spin=0.01) is False
    assert _ring.gate.state()["spins_allowed"] == allowed + 1


def test_vetoed_spins_leave_the_adaptive_budget_as_it_was(gate_never):
    # A wait whose spin the gate vetoed says nothing about whether spinning pays. It used
    # to count as a spin in vain, with elapsed - budget as its sleep (negative when woken
    # sooner, which then doubled the budget): eight such waits turned spinning off, so
    # once the host had a free CPU again the waiter still slept until its next probe.
    p = RingProducer.create(4096, spin_us=50)
    c = RingConsumer.attach(p.spec, spin_us=50)
    waits = 12
    got: list = []

    def consume() -> None:
        for _ in range(waits):
            if not c.wait_readable(10.0):  # the adaptive budget: vetoed, then a sleep
                return
            got.extend(c.try_recv())

    t = threading.Thread(target=consume)
    t.start()
    try:
        for i in range(waits):
            _until(lambda: _sleep_flag(p))  # the consumer sleeps: its spin was vetoed
            assert p.try_send(1, bytes([i]))
            _until(lambda: len(got) > i)
        t.join(10)
        assert not t.is_alive()
        assert [m for _, m in got] == [bytes([i]) for i in range(waits)]
        assert c.statistics().rx_blocks == waits
        assert c._spin.budget == pytest.approx(50e-6) and c._spin.misses == 0
    finally:
        if t.is_alive():
            for _ in range(waits):
                p.try_send(1, b"unblock")
            t.join(10)
        c.close()
        p.close()
        c.unlink()
        p.unlink()


@pytest.mark.parametrize("timeout", [math.inf, 1e300])
def test_a_channels_wait_for_room_behind_another_threads_half_sent_message_takes_no_limit(timeout):
    """The wait handle's "no limit" (inf, or any huge number) while another thread's
    long message is half-way through the ring: the wait for that message raised
    OverflowError (threading's waits take no such timeout)."""
    from shmclient.channel import REQ_UTILITY, ShmChannel

    front, spec = ShmChannel.create(ring_capacity=4096, arena_bytes=1 << 16, spin_us=0.0, wake_fd=False)
    engine = ShmChannel.attach(spec)
    front.peer_attached()
    big = b"x" * 20_000  # five times the ring: sent in parts as the engine reads
    outcome: list = []
    threads: list[threading.Thread] = []
    try:
        sender = threading.Thread(target=lambda: waiting.send(front, REQ_UTILITY, big, timeout=30.0))
        threads.append(sender)
        sender.start()
        _until(lambda: front._partial is not None)

        def wait() -> None:
            try:
                outcome.append(front.wait_send(timeout))
            except BaseException as e:  # noqa: BLE001 - looked at below
                outcome.append(e)

        waiter = threading.Thread(target=wait)
        threads.append(waiter)
        waiter.start()
        # The engine reads once the waiter waits behind the half-sent message (or failed).
        _until(lambda: outcome or front._partial_done._waiters)
        got: list = []
        _until(lambda: got.extend(engine.try_recv()) or not sender.is_alive())
        for t in threads:
            t.join(10)
        got.extend(engine.try_recv())
        assert outcome == [True]
        assert [rtype for rtype, _ in got] == [REQ_UTILITY]  # (bytes, not a call: it came whole)
    finally:
        for t in threads:
            t.join(10)
        engine.close()
        front.close()


def test_a_spin_never_outlasts_a_positive_timeout(monkeypatch):
    """The first slice of a wait spun its whole budget whatever the caller's timeout:
    recv(timeout=0.05) with a 2 s spin raised after 2 s, all of it on the CPU."""
    monkeypatch.setattr(_ring.gate, "mode", "always")  # the host's load vetoes nothing
    p = RingProducer.create(4096, spin_us=2_000_000)
    c = RingConsumer.attach(p.spec, spin_us=2_000_000)
    try:
        for spin in (None, 2.0):  # the adaptive budget, a spin asked for
            t0 = time.monotonic()
            with pytest.raises(PeerNotProducingError):
                waiting.recv(c, timeout=0.05, spin=spin) if spin else waiting.recv(c, timeout=0.05)
            assert time.monotonic() - t0 < 1.0
    finally:
        c.close()
        p.close()


def test_a_timeout_past_any_float_is_no_limit_and_an_infinite_spin_is_refused():
    assert waiting.check_timeout(10**400) is None
    # Seconds of another number type are a float's (a wait adds them to monotonic()):
    # a Decimal was handed back as it came, and the wait raised TypeError.
    from decimal import Decimal
    from fractions import Fraction

    for seconds in (Decimal("0.05"), Fraction(1, 20), 1):
        got = waiting.check_timeout(seconds)
        assert type(got) is float and got == float(seconds)
    for bad in (Decimal("NaN"), Decimal("-1"), float("nan")):
        with pytest.raises(ValueError, match="timeout must be"):
            waiting.check_timeout(bad)
    p = RingProducer.create(4096, spin_us=0)
    c = RingConsumer.attach(p.spec, spin_us=0)
    try:
        with pytest.raises(PeerNotProducingError):
            waiting.recv(c, timeout=Decimal("0.05"))
    finally:
        c.close()
        p.close()
    with pytest.raises(ValueError, match="finite"):
        RingProducer.create(4096, spin_us=float("inf"))


def test_a_receive_waiting_behind_another_threads_long_handler_does_not_spin():
    """Thread A's receive handler runs long with records still unread: thread B's
    ``waiting.recv_into`` found the end ready at once and its try refused (A's call),
    again and again: B spun on the CPU for as long as A's handler ran."""
    p = RingProducer.create(4096, spin_us=0)
    c = RingConsumer.attach(p.spec, spin_us=0)
    try:
        for i in range(4):
            p.send_nowait(1, b"rec%d" % i)
        in_handler, never = threading.Event(), threading.Event()

        def long_handler(rtype, view):
            in_handler.set()
            never.wait(0.4)  # the handler's own work, 0.4 s of it

        a = threading.Thread(target=lambda: c.recv_into(long_handler, 1))
        a.start()
        assert in_handler.wait(10)
        got = {}

        def b():
            cpu = time.thread_time()
            got["n"] = waiting.recv_into(c, lambda rtype, view: None, timeout=10)
            got["cpu"] = time.thread_time() - cpu

        tb = threading.Thread(target=b)
        tb.start()
        a.join(10)
        tb.join(10)
        assert got["n"] == 3
        assert got["cpu"] < 0.15, got  # (it spun the whole 0.4 s: about 0.25 s of CPU here)
    finally:
        c.close()
        p.close()


def test_a_wait_that_takes_fragments_or_releases_never_backs_off(monkeypatch):
    """The back-off for an end another thread holds took every 'ready, yet nothing whole'
    for it: a message in fragments through a small ring (each round takes some) paused
    up to 1 ms a round, ten times slower (8 MiB through 64 KiB: 144 ms against 14)."""
    pauses = []
    real_sleep = time.sleep
    monkeypatch.setattr(time, "sleep", lambda s: pauses.append(s) or real_sleep(s))
    p = RingProducer.create(64 << 10, spin_us=50)
    c = RingConsumer.attach(p.spec, spin_us=50)
    try:
        got = {}
        t = threading.Thread(target=lambda: got.update(m=waiting.recv(c, timeout=60)))
        t.start()
        waiting.send(p, 1, bytes(4 << 20), timeout=60)
        t.join(60)
        assert [(rtype, len(bytes(m))) for rtype, m in got["m"]] == [(1, 4 << 20)]
        assert pauses == []
    finally:
        c.close()
        p.close()
