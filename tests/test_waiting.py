"""The one waiting module and the sans-IO channel under it: bounded waits, no busy
polling, an event loop that keeps running while a client waits for room or output."""

from __future__ import annotations

import asyncio
import os
import select
import signal
import statistics
import threading
import time

import pytest

from shmclient import (
    AsyncMPClient,
    EngineConfig,
    EngineCoreRequest,
    EngineDeadError,
    FinishReason,
    InvalidRequestError,
    PeerNotConsumingError,
    PeerNotProducingError,
    SamplingParams,
    WouldBlock,
    make_client,
    waiting,
)
from shmclient.channel import REQ_UTILITY, ShmChannel
from shmclient.ring_consumer import RingConsumer
from shmclient.ring_producer import RingProducer

from .conftest import sigstop
from .drivers import add_until_one_parks, ctrl_c_when, req


def small_ring_config(**kw) -> EngineConfig:
    # The smallest ring: a few dozen requests fill it while the engine is stopped.
    return EngineConfig(ring_capacity_bytes=4096, **kw)


class Stopped:
    """SIGSTOP the engine process for the block (a live but stalled engine)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def __enter__(self) -> "Stopped":
        sigstop(self.pid)
        return self

    def __exit__(self, *exc) -> None:
        os.kill(self.pid, signal.SIGCONT)


class Ticker:
    """A task that sleeps 5 ms in a loop and records how late each wake-up was."""

    def __init__(self) -> None:
        self.late: list[float] = []
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(0.005)
            self.late.append(loop.time() - t - 0.005)

    def __enter__(self) -> "Ticker":
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc) -> None:
        self._task.cancel()


# ------------------------------------------------------------------ the ring's space pipe


def test_space_pipe_turns_readable_on_release_after_arming_and_on_close():
    p = RingProducer.create(4096, producer_wake_fd=True)
    c = RingConsumer.attach(p.spec)
    try:
        with pytest.raises(WouldBlock):
            while True:
                p.send_nowait(1, b"x" * 100)
        fd = p.space_fileno()
        c.try_recv()  # a release nobody asked for writes nothing
        assert select.select([fd], [], [], 0)[0] == []
        with pytest.raises(WouldBlock):
            while True:
                p.send_nowait(1, b"x" * 100)
        p.arm_space()
        assert select.select([fd], [], [], 0)[0] == []
        c.try_recv()
        assert select.select([fd], [], [], 1.0)[0] == [fd]
        p.arm_space()  # drains the byte
        assert select.select([fd], [], [], 0)[0] == []
        c.close()
        assert select.select([fd], [], [], 1.0)[0] == [fd]
    finally:
        c.close()
        p.close()


def test_a_fragmented_message_is_never_cut_by_another_thread_s_send():
    """Thread A sends a message five times the ring; thread B sends small ones at the
    same time: A's arrives whole, B's all arrive. Neither holds a lock while it waits
    for room, so the channel itself must keep B's records out from between A's
    fragments (one between them makes the reader drop A's message)."""
    front, spec = ShmChannel.create(ring_capacity=4096, arena_bytes=1 << 16, spin_us=0, wake_fd=False)
    engine = ShmChannel.attach(spec)
    front.peer_attached()
    big = bytes(range(256)) * 80
    got: list = []
    try:
        a = threading.Thread(target=waiting.send, args=(front, REQ_UTILITY, big), kwargs={"timeout": 20})
        b = threading.Thread(target=lambda: [
            waiting.send(front, REQ_UTILITY, b"small-%d" % i, timeout=20) for i in range(50)])
        a.start()
        b.start()
        deadline = time.monotonic() + 20
        while (a.is_alive() or b.is_alive() or len(got) < 51) and time.monotonic() < deadline:
            got += engine_raw(engine)
        a.join(5)
        b.join(5)
        fragments = front.tx.statistics().fragments
        chunk = front.tx._frag_chunk
    finally:
        engine.close()
        front.close()
    assert fragments <= len(big) // chunk + 2, f"{fragments} fragments: restarted from the first"
    assert big in got
    assert sorted(x for x in got if x != big) == sorted(b"small-%d" % i for i in range(50))


def test_a_send_behind_another_thread_s_half_way_message_waits_without_spinning():
    """Thread B's send is refused while thread A's long message is half-way through the
    ring. B waited for room, which each of the consumer's releases gave it, and was
    refused again: it spun, half a CPU, for as long as A's message took. B now waits
    for A's message to be through."""
    front, spec = ShmChannel.create(ring_capacity=4096, arena_bytes=1 << 16, spin_us=0, wake_fd=False)
    engine = ShmChannel.attach(spec)
    front.peer_attached()
    big = bytes(range(256)) * 500  # ~128 KB: some 30 ring-fulls
    b_took: list[float] = []

    def b() -> None:
        wall, cpu = time.monotonic(), time.thread_time()
        waiting.send(front, REQ_UTILITY, b"small", timeout=30)
        b_took.extend((time.monotonic() - wall, time.thread_time() - cpu))

    try:
        a = threading.Thread(target=waiting.send, args=(front, REQ_UTILITY, big), kwargs={"timeout": 30})
        a.start()
        deadline = time.monotonic() + 10
        while not front.tx.partial_pending:
            assert time.monotonic() < deadline
        second = threading.Thread(target=b)
        second.start()
        got: list[bytes] = []
        while a.is_alive() or second.is_alive():
            time.sleep(0.002)  # (a slow consumer: A's message takes a while)
            got += engine_raw(engine)
            assert time.monotonic() < deadline
        a.join(5)
        second.join(5)
    finally:
        engine.close()
        front.close()
    wall, cpu = b_took
    assert wall > 0.02 and cpu < 0.1 * wall, f"B used {cpu:.3f} s of CPU in {wall:.3f} s"


def engine_raw(engine: ShmChannel) -> list[bytes]:
    """Raw payloads of the records there now (the REQ_UTILITY decoder is bypassed)."""
    return [bytes(p) for _, p in engine.rx.try_recv()]


# ------------------------------------------------------------------ sync client


def test_sync_add_request_times_out_on_a_stalled_engine_and_the_client_goes_on():
    """Defect: add_request had no timeout; it blocked as long as a stopped engine did."""
    with make_client(True, False, small_ring_config()) as client:
        with Stopped(client.engine_pid):
            t0 = time.monotonic()
            with pytest.raises(PeerNotConsumingError, match=f"pid {client.engine_pid}.*stalled"):
                for i in range(1000):
                    client.add_request(req(f"r{i}", max_tokens=1), timeout=0.3)
            assert time.monotonic() - t0 < 5.0
            n = i
        # The engine catches up; the timed-out id is free again and everything finishes.
        client.add_request(req(f"r{n}", max_tokens=1), timeout=10)
        done: set[str] = set()
        deadline = time.monotonic() + 30
        while len(done) < n + 1 and time.monotonic() < deadline:
            done |= {o.request_id for o in client.get_output(timeout=10).outputs if o.finished}
        assert done == {f"r{i}" for i in range(n + 1)}


def embeds_req(rid: str) -> EngineCoreRequest:
    """A request whose prompt (75 KiB of embeddings) travels in the tensor arena."""
    import torch

    return EngineCoreRequest(request_id=rid, prompt_embeds=torch.ones((300, 64)),
                             sampling_params=SamplingParams(max_tokens=1))


def _blocks_in_flight(client) -> int:
    return client.channel.statistics().tensors.blocks_in_flight


def _finish_all(client, ids: set[str]) -> None:
    done: set[str] = set()
    deadline = time.monotonic() + 30
    while done != ids and time.monotonic() < deadline:
        done |= {o.request_id for o in client.get_output(timeout=10).outputs if o.finished}
    assert done == ids


def test_a_request_that_timed_out_gives_its_tensor_blocks_back():
    """Defect: the arena blocks a request's tensors were placed in at encoding were freed
    only by the engine's release, and a request whose add timed out never reached the
    engine: its blocks stayed taken until the client closed (a retry encodes anew)."""
    with make_client(True, False, small_ring_config()) as client:
        with Stopped(client.engine_pid):
            with pytest.raises(PeerNotConsumingError):
                for i in range(1000):
                    client.add_request(embeds_req(f"r{i}"), timeout=0.3)
            assert i > 0
            assert _blocks_in_flight(client) == i  # r0 .. r{i-1} went; r{i} gave its block back
        client.add_request(embeds_req(f"r{i}"), timeout=10)  # the same id, encoded anew
        _finish_all(client, {f"r{k}" for k in range(i + 1)})
        deadline = time.monotonic() + 10
        while _blocks_in_flight(client) and time.monotonic() < deadline:
            client.call_utility("echo", 1)  # the engine's releases ride back with its replies
        assert _blocks_in_flight(client) == 0


async def test_a_cancelled_async_add_gives_its_tensor_blocks_back():
    """The async twin: a task cancelled while it waits for room (a client that went
    away, an ``asyncio.timeout``) leaves no arena block taken."""
    client = await AsyncMPClient.create(small_ring_config())
    async with client:
        with Stopped(client.engine_pid):
            task, sent = await add_until_one_parks(client.add_request_async, lambda k: embeds_req(f"r{k}"))
            assert _blocks_in_flight(client) == sent + 1  # the parked one's too
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert _blocks_in_flight(client) == sent
        done: set[str] = set()
        while len(done) < sent:
            done |= {o.request_id for o in (await client.get_output_async(timeout=10)).outputs
                     if o.finished}
        assert done == {f"r{k}" for k in range(sent)}


def _big(rid: str) -> EngineCoreRequest:
    """A request of about 1.2 KB: a fourth finds no room in the smallest ring."""
    return req(rid, prompt=[1000] * 400, max_tokens=50, ignore_eos=True)


#: A request of about 300 B: once the engine has read it, the ring's free room is split
#: between its end and its start; a ``_big`` that fits neither waits, an abort fits.
PRE = req("pre", prompt=[1000] * 80, max_tokens=1)


def _finish_reason(client, rid: str) -> FinishReason:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for o in client.get_output(timeout=10).outputs:
            if o.request_id == rid and o.finished:
                return o.finish_reason
    raise AssertionError(f"{rid} did not finish")


def test_a_sync_abort_never_overtakes_its_add_waiting_for_room():
    """Defect: an abort sent while the add of the same request waited for room in the
    full request ring went first where it fit in the room left; the engine ignored it
    (an id it did not know yet) and the request ran to its end, though abort_requests
    had returned. A send now waits behind the one waiting for room (vLLM's socket keeps
    the order of sends)."""
    with make_client(True, False, small_ring_config()) as client:
        waits = lambda: client.channel.statistics().tx.waits_on_full  # noqa: E731
        client.add_request(PRE)
        assert _finish_reason(client, "pre") is FinishReason.LENGTH
        with Stopped(client.engine_pid):
            n = 0
            with pytest.raises(PeerNotConsumingError):
                while True:
                    client.add_request(_big(f"fill{n}"), timeout=0)
                    n += 1
            before = waits()
            add = threading.Thread(target=client.add_request, args=(_big("victim"),), kwargs={"timeout": 30})
            add.start()
            deadline = time.monotonic() + 10
            while waits() == before:  # the add is waiting for room
                assert time.monotonic() < deadline
            abort = threading.Thread(target=client.abort_requests, args=(["victim"],))
            abort.start()
            while abort.is_alive() and client._sends.queued() < 2:  # the abort waits behind the add
                assert time.monotonic() < deadline
            assert abort.is_alive(), "the abort went before the add it aborts"
        add.join(30)
        abort.join(30)
        assert not add.is_alive() and not abort.is_alive()
        assert _finish_reason(client, "victim") is FinishReason.ABORT


async def test_an_async_abort_never_overtakes_its_add_waiting_for_room():
    """The async twin: the abort queues behind the parked add, in call order."""
    client = await AsyncMPClient.create(small_ring_config())
    async with client:
        await client.add_request_async(PRE)
        while not any(o.finished for o in (await client.get_output_async(timeout=10)).outputs):
            pass
        with Stopped(client.engine_pid):
            add, n = await add_until_one_parks(client.add_request_async, lambda k: _big(f"r{k}"))
            victim = f"r{n}"
            abort = asyncio.ensure_future(client.abort_requests_async([victim]))
            await asyncio.sleep(0)
            assert not abort.done(), "the abort went before the add it aborts"
        await asyncio.wait_for(asyncio.gather(add, abort), 30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            out = await client.get_output_async(timeout=10)
            reasons = {o.request_id: o.finish_reason for o in out.outputs if o.finished}
            if victim in reasons:
                assert reasons[victim] is FinishReason.ABORT
                break
        else:
            raise AssertionError(f"{victim} did not finish")


def test_a_signal_between_the_first_fragments_and_the_wait_does_not_wedge_the_channel(monkeypatch):
    """A long message whose first fragments went by the ordered send's first try, then a
    KeyboardInterrupt before waiting.send took it over: the half-sent message is given
    up, so later messages still go (they were refused as behind a half-way message for
    good)."""
    with make_client(True, False, small_ring_config()) as client:
        long_add = req("long", prompt=[1000] * 2000, max_tokens=1)  # ~6 KB: fragments
        with Stopped(client.engine_pid):
            def interrupted(*args, **kwargs):
                raise KeyboardInterrupt("a signal before waiting.send's try")

            monkeypatch.setattr(waiting.ordered, "send", interrupted)
            with pytest.raises(KeyboardInterrupt):
                client.add_request(long_add)
            monkeypatch.undo()
            assert client.channel.tx.partial_pending  # its first fragments are in the ring
        client.add_request(req("after", max_tokens=1), timeout=10)
        assert _finish_reason(client, "after") is FinishReason.LENGTH


class _RoomWhenOpened:
    """A sender whose ring is full until ``open()``: its space descriptor (a pipe) turns
    readable then. Records what went and what was given up."""

    def __init__(self) -> None:
        self.r, self.w = os.pipe()
        self.full = True
        self.sent: list[str] = []
        self.abandoned: list[str] = []

    def send_nowait(self, rtype: int, payload: str) -> None:
        if self.full:
            raise WouldBlock("full")
        self.sent.append(payload)

    def wait_send(self, timeout: float, *, spin=None, first: bool = True) -> bool:
        return bool(select.select([self.r], [], [], timeout)[0])

    def send_fd(self) -> int:
        return self.r

    def arm_send(self) -> None:
        pass

    def abandon(self, payload: str) -> None:
        self.abandoned.append(payload)

    def open(self) -> None:
        self.full = False
        os.write(self.w, b"x")

    def close(self) -> None:
        os.close(self.r)
        os.close(self.w)


@pytest.mark.parametrize("where", ["room", "turn"])
def test_ctrl_c_while_an_ordered_send_waits_marks_its_message_not_sent(where):
    """Ctrl-C while a send waits for room (or for its turn behind another): nothing of
    the message went, and the exception says so (``not_sent``), so the clients free the
    blocks its tensors took (only a timeout or the peer's death said so before)."""
    from shmclient.errors import not_sent

    channel = _RoomWhenOpened()
    sends = waiting.OrderedSends(channel, None, lambda: False)
    waits = threading.Event()
    first = threading.Thread(target=sends.send, args=(1, "a", 10))
    if where == "room":
        real_wait = channel.wait_send

        def wait_send(*args, **kwargs):
            waits.set()
            return real_wait(*args, **kwargs)

        channel.wait_send = wait_send
    else:
        first_waits, real_wait = threading.Event(), channel.wait_send

        def first_wait_send(*args, **kwargs):
            if threading.current_thread() is first:
                first_waits.set()
            return real_wait(*args, **kwargs)

        channel.wait_send = first_wait_send
        first.start()
        assert first_waits.wait(10)  # it waits for room, first in line
        real_turn = sends._wait_turn

        def wait_turn(*args):
            waits.set()
            return real_turn(*args)

        sends._wait_turn = wait_turn

    try:
        with ctrl_c_when(waits), pytest.raises(KeyboardInterrupt) as raised:
            sends.send(1, "b", 10)
        assert not_sent(raised.value)
        channel.open()
        if where == "turn":
            first.join(10)
        assert channel.sent == (["a"] if where == "turn" else [])
    finally:
        channel.open()
        if first.ident is not None:
            first.join(10)
        channel.close()


def test_an_exception_from_inside_the_write_is_not_taken_for_not_sent():
    """A signal handler's exception raised as the write returns (the record published)
    must not let the clients free blocks the peer is about to read."""
    from shmclient.errors import not_sent

    class PublishesThenInterrupted(_RoomWhenOpened):
        def send_nowait(self, rtype, payload):
            if self.full:
                raise WouldBlock("full")
            self.sent.append(payload)
            raise KeyboardInterrupt  # (landed right after the publish)

        def wait_send(self, timeout, *, spin=None, first=True):
            ready = super().wait_send(timeout, spin=spin, first=first)
            self.full = not ready
            return ready

    channel = PublishesThenInterrupted()
    try:
        channel.full = False
        with pytest.raises(KeyboardInterrupt) as raised:  # the first try
            waiting.OrderedSends(channel, None, lambda: False).send(1, "a", 1)
        assert not not_sent(raised.value)
        channel.full = True
        channel.open()  # (room comes as the wait begins: the retry after it goes)
        channel.full = True
        with pytest.raises(KeyboardInterrupt) as raised:
            waiting.OrderedSends(channel, None, lambda: False).send(1, "b", 1)
        assert not not_sent(raised.value) and channel.sent == ["a", "b"]
    finally:
        channel.close()


def _engine_dead_on_failure():
    """A ``failed`` for ``OrderedSendsAsync.start`` that records what ended a send and
    makes it EngineDeadError (as the vLLM plug-in's does), and its record."""
    failures: list[BaseException] = []

    def failed(e: BaseException) -> BaseException:
        failures.append(e)
        return EngineDeadError()

    return failures, failed


async def test_an_ordered_send_whose_caller_stops_waiting_still_goes_in_its_turn():
    """``OrderedSendsAsync.start`` takes the turn at the call and returns a future a
    task completes. A caller cancelled while it waits (a client gone, an
    ``asyncio.timeout``) gets CancelledError and the message still goes, as on vLLM's
    socket: the vLLM plug-in's queued sends then reported EngineDeadError (vLLM's
    ``generate`` takes that for the engine's death) and dropped the message."""
    channel = _RoomWhenOpened()
    failures, failed = _engine_dead_on_failure()
    try:
        sends = waiting.OrderedSendsAsync(channel, None, lambda: False)
        first = sends.start(1, "a", 10, failed)
        given_up = sends.start(1, "b", 10, failed)
        waiter = asyncio.ensure_future(given_up)
        await asyncio.sleep(0)  # (one turn of the loop: the caller waits)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        after = asyncio.ensure_future(sends.send(1, "c", 10))
        channel.open()
        await asyncio.wait_for(asyncio.gather(first, after), 10)
        assert channel.sent == ["a", "b", "c"] and not failures and sends.queued() == 0
    finally:
        channel.close()


async def test_an_ordered_send_task_cancelled_before_it_ran_hands_its_turn_on():
    """A shutdown cancels the sending tasks; one cancelled before its first step never
    ran its body: its turn is handed on all the same (the sends behind it went only at
    their timeout otherwise) and ``failed`` sees the cancellation (the vLLM plug-in frees
    the message's tensor blocks there)."""
    channel = _RoomWhenOpened()
    failures, failed = _engine_dead_on_failure()
    try:
        sends = waiting.OrderedSendsAsync(channel, None, lambda: False)
        dropped = [sends.start(1, "a", 10, failed), sends.start(1, "b", 10, failed)]
        after = asyncio.ensure_future(sends.send(1, "c", 2))
        for task in sends.tasks():  # (as a shutdown does, before they ran)
            task.cancel()
        await asyncio.sleep(0)  # (one turn of the loop)
        channel.open()
        await asyncio.wait_for(after, 10)
        for future in dropped:
            with pytest.raises(EngineDeadError):
                await future
        assert channel.sent == ["c"] and sends.queued() == 0 and sends.tasks() == []
        assert len(failures) == 2 and all(isinstance(e, asyncio.CancelledError) for e in failures)
    finally:
        channel.close()


async def test_a_signal_just_after_an_async_send_took_its_turn_hands_it_on(monkeypatch):
    """A signal handler's exception right after a queued send took its turn, before the
    code that hands turns on was in place: the turn stayed first in line and every
    later send of the sender waited behind it, the ring empty, until its timeout."""
    from shmclient.waiting import ordered

    channel = _RoomWhenOpened()
    try:
        for how in ("send", "start"):
            sends = waiting.OrderedSendsAsync(channel, None, lambda: False)
            real = ordered.OrderedSendsAsync._enqueue

            def interrupted(self, turn, loop, timeout):
                real(self, turn, loop, timeout)
                raise KeyboardInterrupt

            monkeypatch.setattr(ordered.OrderedSendsAsync, "_enqueue", interrupted)
            channel.full = True
            with pytest.raises(KeyboardInterrupt):
                if how == "send":
                    await sends.send(1, "lost", 10)
                else:
                    sends.start(1, "lost", 10)
            monkeypatch.undo()
            assert sends.queued() == 0, how
            channel.full = False
            await asyncio.wait_for(sends.send(1, how, 1), 10)
        assert channel.sent == ["send", "start"]
    finally:
        channel.close()


async def test_an_ordered_send_task_raises_what_failed_makes_of_its_error():
    """``start``'s ``failed`` turns what ended the send into what the task raises (the
    vLLM plug-in: EngineDeadError for a gone engine, after freeing the message's
    blocks); a send queued behind fails at once once the peer is known gone."""
    channel = _RoomWhenOpened()
    gone = threading.Event()
    seen: list[BaseException] = []

    def failed(e: BaseException) -> BaseException:
        seen.append(e)
        return EngineDeadError()

    try:
        sends = waiting.OrderedSendsAsync(channel, lambda: not gone.is_set(), gone.is_set)
        timed_out = sends.start(1, "a", 0.05, failed)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(timed_out, 10)
        assert isinstance(seen[-1], PeerNotConsumingError)
        waits = sends.start(1, "b", None, failed)
        behind = sends.start(1, "c", None, failed)
        await asyncio.sleep(0)
        gone.set()
        results = await asyncio.wait_for(asyncio.gather(waits, behind, return_exceptions=True), 10)
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert [type(e).__name__ for e in seen[1:]] == ["PeerDeadError", "PeerDeadError"]
        assert channel.sent == [] and sends.queued() == 0
    finally:
        channel.close()


def test_sync_timeouts_are_checked():
    with make_client(True, False, EngineConfig()) as client:
        for bad in (-1, "1", True, float("nan")):
            with pytest.raises(InvalidRequestError, match="timeout"):
                client.add_request(req("x"), timeout=bad)
        with pytest.raises(PeerNotProducingError):
            client.get_output(timeout=0.05)


# ------------------------------------------------------------------ async client


async def test_async_add_waits_for_room_without_spinning_or_holding_the_loop():
    """Defect: add_request_async busy-polled (100 % of a core) while the request ring was
    full. Now the task parks on the ring's space pipe: the process stays idle, the loop
    keeps serving other tasks, and the timeout is kept."""
    client = await AsyncMPClient.create(small_ring_config())
    async with client:
        with Stopped(client.engine_pid), Ticker() as ticker:
            cpu0, t0 = time.process_time(), time.monotonic()
            with pytest.raises(PeerNotConsumingError, match=f"pid {client.engine_pid}"):
                for i in range(1000):
                    await client.add_request_async(req(f"r{i}", max_tokens=1), timeout=1.0)
            wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
        assert 0.9 < wall < 5.0
        assert cpu < 0.3 * wall, f"{cpu:.2f} s of CPU in a {wall:.2f} s wait: busy polling"
        assert ticker.late and max(ticker.late) < 0.25  # the old wait held the loop for all of it
        # The engine resumes: what was queued is served, the refused id may come again.
        await client.add_request_async(req(f"r{i}", max_tokens=1), timeout=10)
        done: set[str] = set()
        while len(done) < i + 1:
            done |= {o.request_id for o in (await client.get_output_async(timeout=10)).outputs
                     if o.finished}


async def test_async_add_of_a_request_bigger_than_the_ring_does_not_block_the_loop():
    """Defect: a request larger than the ring was sent with a blocking wait in the loop
    (unbounded with a stalled engine)."""
    prompt = [1000 + (i % 20) for i in range(2000)]  # ~6 KB: more than the 4 KiB ring
    client = await AsyncMPClient.create(small_ring_config(max_model_len=2100))
    async with client:
        with Stopped(client.engine_pid), Ticker() as ticker:
            t0 = time.monotonic()
            with pytest.raises(PeerNotConsumingError):
                await client.add_request_async(req("big", prompt, max_tokens=1), timeout=0.5)
            assert time.monotonic() - t0 < 3.0
        assert ticker.late and max(ticker.late) < 0.25  # the old wait held the loop for all of it
        # Resumed: the half-sent request is dropped by the engine; a new one is served.
        await client.add_request_async(req("big", prompt, max_tokens=2), timeout=10)
        out = []
        while not any(o.finished for o in out):
            out += (await client.get_output_async(timeout=10)).outputs
        assert sum(len(o.new_token_ids) for o in out if o.request_id == "big") == 2


async def test_async_get_output_timeout_and_concurrent_waiters_for_room():
    client = await AsyncMPClient.create(small_ring_config())
    async with client:
        with pytest.raises(PeerNotProducingError):
            await client.get_output_async(timeout=0.05)
        with pytest.raises(InvalidRequestError, match="timeout"):
            await client.get_output_async(timeout=-1)
        # Several tasks wait for room on the same descriptor at once: all get through.
        with Stopped(client.engine_pid):
            for i in range(1000):
                try:
                    await client.add_request_async(req(f"f{i}", max_tokens=1), timeout=0.05)
                except PeerNotConsumingError:
                    break
            tasks = [asyncio.ensure_future(
                client.add_request_async(req(f"w{k}", max_tokens=1), timeout=20)) for k in range(4)]
            await asyncio.sleep(0.05)
            assert not any(t.done() for t in tasks)
        await asyncio.wait_for(asyncio.gather(*tasks), 20)


async def test_async_with_and_shutdown_async_keep_the_loop_running():
    with_ticks = Ticker()
    client = await AsyncMPClient.create(EngineConfig())
    with with_ticks:
        async with client:
            assert await client.echo_async("x") == "x"
            pending = asyncio.ensure_future(client.get_output_async())
            await asyncio.sleep(0)
        # shutdown ran in a thread: the ticker kept ticking, the waiter got the error
        with pytest.raises(EngineDeadError):
            await pending
        # The tick whose sleep spans the shutdown (5-20 ms) is in: how late it came says
        # whether the loop was held meanwhile.
        ticks = len(with_ticks.late)
        while len(with_ticks.late) == ticks:
            await asyncio.sleep(0.001)
    assert max(with_ticks.late) < 0.25
    assert client.is_dead
    await client.shutdown_async()  # idempotent
    with pytest.raises(EngineDeadError):
        await client.add_request_async(req("late"))


def test_waiting_recv_bounds_and_reports_a_dead_peer():
    front, spec = ShmChannel.create(ring_capacity=4096, arena_bytes=1 << 16, spin_us=0, wake_fd=False)
    engine = ShmChannel.attach(spec)
    front.peer_attached()
    try:
        t0 = time.monotonic()
        with pytest.raises(PeerNotProducingError):
            waiting.recv(front, timeout=0.2)
        assert 0.15 < time.monotonic() - t0 < 2.0
        with pytest.raises(WouldBlock):
            front.recv_nowait()
        from shmclient import PeerDeadError

        t0 = time.monotonic()
        with pytest.raises(PeerDeadError, match="liveness"):
            waiting.recv(front, timeout=None, alive=lambda: False)
        assert time.monotonic() - t0 < 2.0
    finally:
        engine.close()
        front.close()


def test_waiting_recv_with_no_spin_sleeps_at_once():
    """A thread that must leave the GIL to others (the vLLM engine's request reader)
    asks for spin=0: it then sleeps in the kernel instead of spinning its budget away,
    however long the channel's configured spin."""
    from shmclient.messages import UtilityRequest

    front, spec = ShmChannel.create(ring_capacity=4096, arena_bytes=1 << 16, spin_us=1e6, wake_fd=False)
    engine = ShmChannel.attach(spec)
    front.peer_attached()
    try:
        t0 = time.monotonic()
        cpu0 = time.thread_time()
        with pytest.raises(PeerNotProducingError):
            waiting.recv(engine, timeout=0.3, spin=0.0)
        cpu = time.thread_time() - cpu0
        assert time.monotonic() - t0 >= 0.25
        # The configured 1 s spin would burn the whole 0.3 s wait on the CPU.
        assert cpu < 0.1, f"waiting.recv(spin=0) used {cpu:.3f} s of CPU in a 0.3 s wait"
        # A message sent meanwhile still wakes it.
        sender = threading.Thread(
            target=lambda: front.send_nowait(REQ_UTILITY, front.encode(UtilityRequest(0, 1, "echo", ["x"]))))
        sender.start()
        got = waiting.recv(engine, timeout=10.0, spin=0.0)
        sender.join()
        assert [rtype for rtype, _ in got] == [REQ_UTILITY]
    finally:
        engine.close()
        front.close()


async def test_a_consumer_behind_the_engine_still_lets_other_tasks_run():
    """Defect: with outputs always queued (an engine faster than its reader),
    get_output_async returned without ever suspending the task, so a concurrent 1 ms
    sleep woke up to seconds late."""
    sp = dict(max_tokens=100_000, ignore_eos=True)
    client = await AsyncMPClient.create(EngineConfig(max_model_len=100_010))
    async with client:
        for k in range(4):
            await client.add_request_async(req(f"s{k}", **sp))
        with Ticker() as ticker:
            loop = asyncio.get_running_loop()
            end = loop.time() + 1.0
            batches = 0
            while loop.time() < end:
                await client.get_output_async(timeout=10)
                batches += 1
        await client.abort_requests_async([f"s{k}" for k in range(4)])
    assert batches > 100
    # ~180 ticks of 5 ms fit in the second; without the yield 17-26 did
    assert len(ticker.late) > 60 and statistics.median(ticker.late) < 0.02, (
        len(ticker.late), statistics.median(ticker.late) if ticker.late else None)
