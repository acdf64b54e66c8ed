"""The two readers of ``shmclient.waiting``, against a fake channel: the thread reader's
leader/follower hand-over (no lost wake-up, a follower promoted when the leader leaves),
the loop reader's callback and parking, every waiter's deadline, and what a dead peer
left delivered within the grace, then the error."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections import deque

import pytest

from shmclient import waiting
from shmclient.errors import EngineDeadError, PeerNotProducingError, WouldBlock

from .drivers import LoopTurns


class FakeChannel:
    """A channel's receiving half in memory: ``put`` publishes; ``recv_fd`` is readable
    while something is unread (after ``arm_recv``), as the ring's wake pipe."""

    flush_releases = None

    def __init__(self, late_after_peer_death: bool = False) -> None:
        self.late_after_peer_death = late_after_peer_death
        self.peer_closed = False
        self._items: deque = deque()
        self._cond = threading.Condition()
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)

    def put(self, *items) -> None:
        with self._cond:
            self._items.extend((1, x) for x in items)
            self._cond.notify_all()
        os.write(self._w, b"x")

    def recv_nowait(self, limit: int = 0) -> list:
        with self._cond:
            if not self._items:
                raise WouldBlock("nothing to receive")
            n = len(self._items) if limit <= 0 else min(limit, len(self._items))
            return [self._items.popleft() for _ in range(n)]

    def try_recv(self, limit: int = 0) -> list:
        try:
            return self.recv_nowait(limit)
        except WouldBlock:
            return []

    def wait_recv(self, timeout: float, *, spin: float | None = None, first: bool = True) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: bool(self._items), timeout)

    def recv_fd(self) -> int:
        return self._r

    def arm_recv(self) -> None:
        try:
            while os.read(self._r, 4096):
                pass
        except BlockingIOError:
            pass
        with self._cond:
            if self._items:
                os.write(self._w, b"x")

    def close(self) -> None:
        os.close(self._r)
        os.close(self._w)


@pytest.fixture
def channel():
    ch = FakeChannel()
    yield ch
    ch.close()


@pytest.fixture
def late_channel():
    ch = FakeChannel(late_after_peer_death=True)
    yield ch
    ch.close()


def _until(cond, timeout: float = 5.0) -> None:
    """Wait (bounded) for a state another thread reaches; fails the test otherwise."""
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "state not reached"
        time.sleep(0.001)


class Owner:
    """What a client passes a reader: dispatch into ``got``, death, closing."""

    def __init__(self) -> None:
        self.got: list = []
        self.dead = threading.Event()
        self.closed = False
        self.broken: list = []

    def dispatch(self, batch: list) -> None:
        self.got.extend(x for _, x in batch)

    def dead_error(self) -> EngineDeadError:
        return EngineDeadError("the peer died")

    def thread_reader(self, channel) -> waiting.ThreadReader:
        return waiting.ThreadReader(
            channel, self.dispatch, lead=threading.Lock(), dead=self.dead,
            alive=lambda: not self.dead.is_set(), closed=lambda: self.closed,
            dead_error=self.dead_error, broken=lambda e: self.broken.append(e) or self.dead_error())

    def loop_reader(self, channel, spin_s: float = 0.0) -> waiting.LoopReader:
        return waiting.LoopReader(
            channel, self.dispatch, lead=threading.Lock(), closed=lambda: self.closed,
            dead=self.dead.is_set, dead_error=self.dead_error, broken=self.broken.append,
            spin_s=spin_s)


@pytest.fixture
def no_safety_net(monkeypatch):
    # A follower would otherwise look again every 50 ms and hide a lost notification.
    monkeypatch.setattr(waiting.ThreadReader, "FOLLOW_SLICE_S", 60.0)


def _waiter(reader, done, errors):
    def run():
        try:
            reader.wait(done, time.monotonic() + 10.0)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
    t = threading.Thread(target=run)
    t.start()
    return t


# -- the thread reader ------------------------------------------------------------------


def test_a_follower_is_promoted_when_the_leader_leaves(channel, no_safety_net):
    owner = Owner()
    reader = owner.thread_reader(channel)
    errors: list = []
    a = _waiter(reader, lambda: "a" in owner.got, errors)
    _until(reader.lead.locked)  # a leads, blocked in the channel's wait
    b = _waiter(reader, lambda: "b" in owner.got, errors)
    _until(lambda: reader._followers == 1)
    channel.put("a")
    a.join(5.0)
    assert not a.is_alive()
    channel.put("b")  # only a follower that took the lead reads it
    b.join(5.0)
    assert not b.is_alive(), "the follower was never promoted"
    assert errors == [] and owner.got == ["a", "b"]


def test_followers_waiting_for_what_the_leader_read_all_wake(channel, no_safety_net):
    owner = Owner()
    reader = owner.thread_reader(channel)
    errors: list = []
    lead = _waiter(reader, lambda: "x" in owner.got, errors)
    _until(reader.lead.locked)
    others = [_waiter(reader, lambda: "x" in owner.got, errors) for _ in range(3)]
    _until(lambda: reader._followers == 3)
    channel.put("x")
    for t in [lead, *others]:
        t.join(5.0)
        assert not t.is_alive(), "a follower missed its wake-up"
    assert errors == [] and owner.got == ["x"]


def test_thread_reader_deadline_fires(channel):
    reader = Owner().thread_reader(channel)
    t0 = time.monotonic()
    with pytest.raises(PeerNotProducingError):
        reader.wait(lambda: False, time.monotonic() + 0.05)
    assert time.monotonic() - t0 < 2.0


def test_thread_reader_hands_over_what_the_dead_peer_left_then_raises(channel):
    owner = Owner()
    reader = owner.thread_reader(channel)
    channel.put(1, 2)
    owner.dead.set()
    reader.wait(lambda: len(owner.got) == 2, None)  # the remains come first
    assert owner.got == [1, 2]
    channel.put(3)  # read once: nothing more is taken from a dead peer's channel
    with pytest.raises(EngineDeadError):
        reader.wait(lambda: False, None)
    assert owner.got == [1, 2]


class _WatchedLock:
    """A lock that tells when someone other than ``owner`` asks for it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.owner: int | None = None
        self.asked = threading.Event()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if threading.get_ident() != self.owner:
            self.asked.set()
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()


def test_a_waiter_arriving_while_another_reads_the_remains_gets_what_they_bring(channel):
    """One thread reads what the dead peer left; a second one that comes meanwhile must
    not raise before that reading has dispatched (it raised at once: the remains were
    marked read when the reading began)."""
    owner = Owner()
    lock = _WatchedLock()
    reader = waiting.ThreadReader(
        channel, None, lead=lock, dead=owner.dead, alive=lambda: not owner.dead.is_set(),
        closed=lambda: False, dead_error=owner.dead_error, broken=lambda e: owner.dead_error())
    second_done = threading.Event()

    def slow_dispatch(batch: list) -> None:
        lock.owner = threading.get_ident()
        second.start()
        # (the second waiter asked for the lead, or already gave up)
        assert lock.asked.wait(10) or second_done.is_set()
        owner.dispatch(batch)

    reader._dispatch = slow_dispatch
    errors: list = []

    def run_second() -> None:
        try:
            reader.wait(lambda: "b" in owner.got, time.monotonic() + 10.0)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
        finally:
            second_done.set()

    second = threading.Thread(target=run_second)
    channel.put("a", "b")
    owner.dead.set()
    reader.wait(lambda: "a" in owner.got, time.monotonic() + 10.0)
    second.join(10)
    assert not second.is_alive()
    assert errors == [] and owner.got == ["a", "b"]


def test_thread_reader_waits_the_grace_for_late_remains(late_channel):
    owner = Owner()
    reader = owner.thread_reader(late_channel)
    owner.dead.set()
    late = threading.Timer(0.01, late_channel.put, ("late",))
    late.start()
    try:
        reader.wait(lambda: "late" in owner.got, time.monotonic() + 5.0)
    finally:
        late.join()
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError):  # the grace ends: nothing more is waited for
        reader.wait(lambda: False, None)
    assert time.monotonic() - t0 < 1.0


def test_thread_reader_raises_at_once_after_close(channel):
    owner = Owner()
    reader = owner.thread_reader(channel)
    channel.put("unread")
    owner.closed = True
    with pytest.raises(EngineDeadError):
        reader.wait(lambda: False, None)
    assert owner.got == []


# -- the loop reader --------------------------------------------------------------------


@pytest.mark.parametrize("arm_after_read", [False, True])
async def test_loop_callback_dispatches_with_no_task_waiting(channel, arm_after_read):
    channel.arm_after_read = arm_after_read
    owner = Owner()
    reader = owner.loop_reader(channel)
    loop = asyncio.get_running_loop()
    reader.bind(loop)
    try:
        arrived = loop.create_future()
        reader.parking.waiters.add(arrived)  # woken by the callback's read
        channel.put(*range(reader.READ_LIMIT + 3))  # more than one read: it reads on
        await asyncio.wait_for(arrived, 5.0)
        await asyncio.wait_for(_loop_until(lambda: len(owner.got) == reader.READ_LIMIT + 3), 5.0)
        assert owner.got == list(range(reader.READ_LIMIT + 3))
    finally:
        reader.unwatch_hook()()


async def _loop_until(cond) -> None:
    while not cond():
        await asyncio.sleep(0)


async def test_loop_wait_is_woken_by_a_publish_after_it_parked(channel):
    owner = Owner()
    reader = owner.loop_reader(channel)
    loop = asyncio.get_running_loop()
    reader.bind(loop)
    try:
        task = asyncio.ensure_future(reader.wait(lambda: "x" in owner.got, None))
        await _loop_until(lambda: len(reader.parking.waiters) == 1)
        await asyncio.to_thread(channel.put, "x")  # from another thread, as an engine
        await asyncio.wait_for(task, 5.0)
        assert owner.got == ["x"]
    finally:
        reader.unwatch_hook()()


async def test_loop_wait_deadline_fires_and_leaves_no_waiter(channel):
    reader = Owner().loop_reader(channel)
    loop = asyncio.get_running_loop()
    reader.bind(loop)
    try:
        t0 = loop.time()
        with pytest.raises(PeerNotProducingError):
            await asyncio.wait_for(reader.wait(lambda: False, loop.time() + 0.05), 5.0)
        assert loop.time() - t0 < 2.0
        assert reader.parking.waiters == set()
    finally:
        reader.unwatch_hook()()


async def test_loop_reader_hands_over_late_remains_within_the_grace(late_channel):
    owner = Owner()
    reader = owner.loop_reader(late_channel)
    loop = asyncio.get_running_loop()
    reader.bind(loop)
    try:
        owner.dead.set()
        loop.call_later(0.01, late_channel.put, "late")  # trails the death
        await asyncio.wait_for(reader.wait(lambda: "late" in owner.got, None), 5.0)
        t0 = loop.time()
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(reader.wait(lambda: False, None), 5.0)
        assert loop.time() - t0 < 1.0
        assert reader.remains_read
    finally:
        reader.unwatch_hook()()


async def test_loop_reader_remains_of_a_ring_are_read_at_once(channel):
    owner = Owner()
    reader = owner.loop_reader(channel)
    loop = asyncio.get_running_loop()
    reader.bind(loop)
    reader.unwatch_hook()()  # no callback: the wait itself must read them
    channel.put(1, 2)
    owner.dead.set()
    await asyncio.wait_for(reader.wait(lambda: len(owner.got) == 2, None), 5.0)
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(reader.wait(lambda: False, None), 5.0)
    assert owner.got == [1, 2]


async def test_loop_reader_reads_a_dead_peers_backlog_a_batch_per_turn(channel):
    """What a dead peer left is dispatched ``READ_LIMIT`` at a time, the loop turning
    between batches (one read of the whole backlog held the loop for as long as that
    took to decode: thousands of batches in a full output ring)."""
    owner = Owner()
    batches: list = []
    owner.dispatch = lambda batch: (batches.append(len(batch)), owner.got.extend(x for _, x in batch))
    reader = owner.loop_reader(channel)
    loop = asyncio.get_running_loop()
    reader.bind(loop)
    reader.unwatch_hook()()  # no callback: the remains' reading alone
    n = 3 * reader.READ_LIMIT + 5
    channel.put(*range(n))
    owner.dead.set()
    counter = LoopTurns().start()
    try:
        await asyncio.wait_for(reader.read_remains(), 5.0)
    finally:
        turns = counter.stop()
    assert owner.got == list(range(n))
    assert max(batches) == reader.READ_LIMIT and len(batches) == 4, batches
    assert turns >= 3


@pytest.mark.parametrize("arm_after_read", [False, True])
async def test_loop_callback_reads_on_after_the_peer_closed_until_nothing_is_left(channel, arm_after_read):
    """A peer that closed its end (exiting) left more than one read's worth: the
    callback reads it all before it stops watching (it stopped after the first 16,
    leaving the rest to whoever waited next: a utility's reply then went unread)."""
    channel.arm_after_read = arm_after_read
    owner = Owner()
    reader = owner.loop_reader(channel)
    loop = asyncio.get_running_loop()
    reader.bind(loop)
    try:
        n = 3 * reader.READ_LIMIT + 5
        channel.put(*range(n))
        channel.peer_closed = True
        await asyncio.wait_for(_loop_until(lambda: len(owner.got) == n), 5.0)
        assert owner.got == list(range(n))
        await asyncio.wait_for(_loop_until(lambda: reader._watch.fd is None), 5.0)  # then stops
    finally:
        reader.unwatch_hook()()


async def test_loop_callback_of_a_broken_channel_stops_watching_without_raising_into_the_loop(channel):
    """Once the channel broke (its ring end closed), arming its descriptor raises: the
    callback stops watching instead of raising into the loop's exception handler."""
    from shmclient.errors import RingCorruptError

    owner = Owner()
    reader = owner.loop_reader(channel)
    loop = asyncio.get_running_loop()
    raised: list = []
    loop.set_exception_handler(lambda lp, ctx: raised.append(ctx))
    reader.bind(loop)
    try:
        def broken() -> None:
            raise RingCorruptError("ring protocol violation: this consumer end is closed")

        channel.arm_recv = broken
        channel.put("x")
        await asyncio.wait_for(_loop_until(lambda: reader._watch.fd is None), 5.0)
        await _turns()
        assert raised == []
    finally:
        loop.set_exception_handler(None)
        reader.unwatch_hook()()


async def _turns(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def test_loop_callback_of_a_channel_that_arms_after_reading_wakes_once_per_publish(channel):
    """A ring's wake pipe turns readable again when re-armed while a record is unread:
    the callback reads first, then re-arms, so each publish costs one wake-up (arming
    first cost two, the second finding nothing)."""
    channel.arm_after_read = True
    owner = Owner()
    reader = owner.loop_reader(channel)
    reader.bind(asyncio.get_running_loop())
    try:
        for i in range(10):
            channel.put(i)
            await asyncio.wait_for(_loop_until(lambda: len(owner.got) == i + 1), 5.0)
            await _turns()  # a second wake-up, if one is due, runs in these turns
        assert owner.got == list(range(10))
        assert (reader.wakes, reader.empty_wakes) == (10, 0)
    finally:
        reader.unwatch_hook()()


class FakeEarlyWake:
    """The peer's early wake-up: ``announce()`` is the peer saying it will publish;
    ``publish`` is what it publishes during the reader's spin (None: nothing comes)."""

    def __init__(self, channel, publish=None) -> None:
        self.channel = channel
        self.publish = publish
        self.armed = self.announced = False
        self.calls: list = []

    def arm(self) -> None:
        self.armed = True
        self.calls.append("arm")

    def disarm(self) -> None:
        self.armed = False
        self.calls.append("disarm")

    def announce(self) -> None:
        self.announced = True
        os.write(self.channel._w, b"x")  # the wake byte, ahead of any record

    def fired(self) -> float:
        if not (self.armed and self.announced):
            return 0.0
        self.announced = False
        if self.publish is not None:
            self.channel.put(self.publish)  # arrives during the spin
        return 1.0

    def after(self, paid: bool) -> None:
        self.calls.append(("after", paid))


@pytest.mark.parametrize("publish", ["x", None])
async def test_loop_reader_spins_for_an_announced_publish_while_a_task_is_parked(channel, publish):
    channel.arm_after_read = True
    owner = Owner()
    reader = owner.loop_reader(channel)
    reader.early = early = FakeEarlyWake(channel, publish)
    reader.bind(asyncio.get_running_loop())
    try:
        task = asyncio.ensure_future(reader.wait(lambda: "x" in owner.got, None))
        await _loop_until(lambda: len(reader.parking.waiters) == 1)
        assert early.calls == ["arm"]
        early.announce()
        await asyncio.wait_for(_loop_until(lambda: reader.wakes == 1), 5.0)
        if publish is None:  # nothing came within the spin: the task stays parked
            await _turns()
            assert early.calls == ["arm", ("after", False)] and not task.done()
            assert reader.empty_wakes == 1
            channel.put("x")
        await asyncio.wait_for(task, 5.0)
        assert owner.got == ["x"]
        assert early.calls[-1] == "disarm"
        if publish is not None:  # the spin read it: one wake-up, none empty
            assert early.calls == ["arm", ("after", True), "disarm"]
            assert (reader.wakes, reader.empty_wakes) == (1, 0)
    finally:
        reader.unwatch_hook()()


async def test_loop_reader_asks_no_early_wake_without_a_parked_task(channel):
    channel.arm_after_read = True
    owner = Owner()
    reader = owner.loop_reader(channel)
    reader.early = early = FakeEarlyWake(channel, "x")
    early.armed = True
    reader.bind(asyncio.get_running_loop())
    try:
        early.announce()
        await asyncio.wait_for(_loop_until(lambda: reader.wakes == 1), 5.0)
        await _turns()
        assert early.announced and owner.got == [] and reader.empty_wakes == 1
    finally:
        reader.unwatch_hook()()


async def test_parking_deadline_releases_one_wake_releases_all():
    loop = asyncio.get_running_loop()
    parking = waiting.Parking()
    short = asyncio.ensure_future(parking.park(loop, loop.time() + 0.01))
    long_ = [asyncio.ensure_future(parking.park(loop, None)) for _ in range(2)]
    await asyncio.wait_for(short, 5.0)
    assert not any(t.done() for t in long_) and len(parking.waiters) == 2
    parking.wake()
    await asyncio.wait_for(asyncio.gather(*long_), 5.0)
    assert parking.waiters == set()


async def test_a_waiter_left_parked_by_a_closed_loop_does_not_stop_the_wake_of_the_others():
    """A client moves to a new loop once its first is closed: a task that was parked
    when that loop closed must not make wake() raise and leave the new loop's waiter
    asleep with its output queued."""
    parking = waiting.Parking()
    old = asyncio.new_event_loop()
    stranded = parking.park(old, None)
    waiter = stranded.send(None)  # parked: it awaits its waiter
    waiter.add_done_callback(lambda f: None)  # as the task that awaits it
    old.close()
    try:
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(parking.park(loop, None))
        await _loop_until(lambda: len(parking.waiters) == 2)
        parking.wake()
        await asyncio.wait_for(task, 5.0)
        assert parking.waiters == set()  # the closed loop's waiter was dropped
    finally:
        stranded.close()

