"""A KeyboardInterrupt (Ctrl-C) that lands as a lock's non-blocking acquire returns must not
leave the lock held: the read lead of the sync and async readers, the channel's send
lock in ``flush_releases``, and a ring end's lock in ``close`` and a locked receive.

CPython runs a Python signal handler at the eval-breaker check right after a call
returns, so with ``if lock.acquire(False): try: ... finally: lock.release()`` the
exception can come after acquire() took the lock and before the try. These tests land it
deterministically at the first moment the lock is held: a profile hook raises
KeyboardInterrupt at the first call or return event (C ones included) of the function
under test, or of what it calls, at which the lock is held. With the gap that is the
return of ``acquire`` itself; without it, an event inside the block that releases.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import threading
import time
from types import CodeType
from typing import Iterator

import numpy as np
import pytest

from shmclient import AsyncMPClient, EngineConfig, EngineCoreRequest, SamplingParams, make_client, waiting
from shmclient._ring import try_hold
from shmclient.channel import REC_OUTPUTS, REQ_UTILITY, ShmChannel
from shmclient.errors import EngineDeadError, PeerDeadError
from shmclient.messages import EngineCoreOutputs, UtilityOutput, UtilityRequest
from shmclient.ring import Ring
from shmclient.ring_consumer import RingConsumer
from shmclient.ring_producer import RingProducer


@contextlib.contextmanager
def ctrl_c_once_held(lock, code: CodeType) -> Iterator[list]:
    """Within the block, in this thread: KeyboardInterrupt at the first profile event in a
    frame running ``code`` (or one it called) at which ``lock`` is held; the list yielded
    gets what the event was. The hook goes once it raised (CPython drops a profile
    function that raises). On the way out a lock left held is released, so that a failing
    test still cleans up (and reports the leak instead of hanging)."""
    fired: list = []
    # (an RLock, the ring ends' lock, has no locked() on Python 3.11: whether this thread
    # holds it, which is what a leak here is)
    locked = getattr(lock, "locked", None) or lock._is_owned

    def hook(frame, event, arg):
        if fired or not locked():
            return
        if frame.f_code is not code and (frame.f_back is None or frame.f_back.f_code is not code):
            return
        fired.append((event, frame.f_code.co_name, getattr(arg, "__name__", None)))
        raise KeyboardInterrupt("Ctrl-C as the lock was taken")

    assert not locked()
    sys.setprofile(hook)
    try:
        yield fired
    finally:
        sys.setprofile(None)
        left_held = locked()
        if left_held:
            lock.release()
        fired.append(("left held", left_held))


def test_try_hold_releases_only_what_it_took():
    lock = threading.Lock()
    with try_hold(lock) as held:
        assert held is True and lock.locked()
        with try_hold(lock, 0.01) as again:
            assert again is False
        assert lock.locked()  # the inner guard took nothing, so it released nothing
    assert not lock.locked()
    with pytest.raises(ValueError), try_hold(lock) as held:
        assert held
        raise ValueError("the body's exception goes through, the lock is released")
    assert not lock.locked()
    with pytest.raises(TypeError, match="timeout must be a number"):
        try_hold(lock, "1")


def _req(rid: str) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=rid, prompt_token_ids=[5, 6, 7], sampling_params=SamplingParams(max_tokens=2))


def _ids(outputs) -> set[str]:
    return {o.request_id for o in outputs.outputs}


def test_ctrl_c_as_a_sync_waiter_takes_the_read_lead_leaves_it_free():
    """ThreadReader.wait: the next get_output reads (it waited for the lost leader for
    ever, outputs unread in the ring) and shutdown does not wait for the lead."""
    with make_client(True, False, EngineConfig()) as client:
        lead = client._lead
        with ctrl_c_once_held(lead, waiting.ThreadReader.wait.__code__) as fired:
            with pytest.raises(KeyboardInterrupt):
                client.get_output(timeout=5.0)
            assert not lead.locked(), f"the read lead stays held after a Ctrl-C at {fired}"
        assert fired[-1] == ("left held", False)
        client.add_request(_req("r1"))
        assert "r1" in _ids(client.get_output(timeout=10.0))


def _channel_pair(**kw) -> tuple[ShmChannel, ShmChannel]:
    front, spec = ShmChannel.create(ring_capacity=1 << 16, arena_bytes=1 << 22, spin_us=0, wake_fd=False, **kw)
    engine = ShmChannel.attach(spec)
    front.peer_attached()
    return front, engine


def test_ctrl_c_as_reading_what_a_dead_peer_left_takes_the_lead_leaves_it_free(monkeypatch):
    """ThreadReader.read_remains (a timed acquire): what the peer left is still read by
    the next call (it waited LEAD_WAIT_S for a lead nobody would give back, then gave up)."""
    monkeypatch.setattr(waiting.ThreadReader, "LEAD_WAIT_S", 0.5)
    front, engine = _channel_pair()
    try:
        got: list = []
        dead = threading.Event()
        reader = waiting.ThreadReader(
            front, got.extend, lead=threading.Lock(), dead=dead, alive=lambda: not dead.is_set(),
            closed=lambda: False, dead_error=lambda: EngineDeadError("the peer died"), broken=lambda e: e)
        engine.send_nowait(REQ_UTILITY, engine.encode(UtilityRequest(0, 1, "echo", ["last words"])))
        dead.set()
        with ctrl_c_once_held(reader.lead, waiting.ThreadReader.read_remains.__code__) as fired:
            with pytest.raises(KeyboardInterrupt):
                reader.read_remains()
            assert not reader.lead.locked(), f"the read lead stays held after a Ctrl-C at {fired}"
        t0 = time.monotonic()
        assert reader.read_remains() is True
        assert time.monotonic() - t0 < waiting.ThreadReader.LEAD_WAIT_S
        assert len(got) == 1
    finally:
        engine.close()
        front.close()


@pytest.mark.parametrize("where", ["on_readable", "read_now", "read_remains"])
async def test_ctrl_c_as_the_async_reader_takes_the_read_lead_leaves_it_free(where):
    """LoopReader: the loop's callback reads again (it returned at once on every turn,
    the wake pipe readable: a busy loop reading nothing) and the next get_output_async
    gets its output."""
    client = await AsyncMPClient.create(EngineConfig())
    try:
        client._bind_loop()  # (get_output_async's first call does it)
        reader = client._reader
        method = getattr(reader, where)
        with ctrl_c_once_held(client._lead, method.__code__) as fired:
            with pytest.raises(KeyboardInterrupt):
                if where == "read_remains":
                    await method()
                else:
                    method(*(() if where == "on_readable" else (0.0,)))
            assert not client._lead.locked(), f"the read lead stays held after a Ctrl-C at {fired}"
        await client.add_request_async(_req("r1"))
        assert "r1" in _ids(await client.get_output_async(timeout=10.0))
        wakes = reader.wakes
        reader.on_readable()
        assert reader.wakes == wakes + 1  # the callback gets past the lead again
    finally:
        await client.shutdown_async()


def test_ctrl_c_as_flush_releases_takes_the_send_lock_leaves_it_free():
    """ShmChannel.flush_releases: the next send goes (every later send blocked for good,
    its timeout ignored) and the pending release goes with it."""
    front, engine = _channel_pair()
    try:
        # engine -> front: a big array (out of band, in the engine's arena); the frontend
        # drops it, so a release is pending
        out = EngineCoreOutputs(utility_output=UtilityOutput(call_id=1, result=np.arange(200_000)))
        engine.send_nowait(REC_OUTPUTS, engine.encode(out))
        got = waiting.recv(front, timeout=2.0)
        del got, out
        gc.collect()
        assert front._released or front._held_release is not None
        lock = front._send_lock
        with ctrl_c_once_held(lock, ShmChannel.flush_releases.__code__) as fired:
            with pytest.raises(KeyboardInterrupt):
                front.flush_releases()
            assert not lock.locked(), f"the send lock stays held after a Ctrl-C at {fired}"
        waiting.send(front, REQ_UTILITY, front.encode(UtilityRequest(0, 2, "echo", ["x"])), timeout=1.0)
        front.flush_releases()
        assert not front._released and front._held_release is None
    finally:
        engine.close()
        front.close()


def test_ctrl_c_as_a_ring_end_takes_its_lock_in_close_leaves_it_free():
    """Ring.close (a timed acquire, then the finalizer): this side's later calls that take
    the lock (poke, drain_wake_fd) do not wait for a lock nobody gives back."""
    rx = RingConsumer.create(1024, consumer_wake_fd=True)
    tx = RingProducer.attach(rx.spec)
    try:
        lock = tx._lock
        with ctrl_c_once_held(lock, Ring.close.__code__) as fired:
            with pytest.raises(KeyboardInterrupt):
                tx.close()
            assert not lock._is_owned(), f"the ring's lock stays held after a Ctrl-C at {fired}"
        assert fired[-1] == ("left held", False)
        tx._finalizer()  # what the interrupted close did not get to
        held_elsewhere = threading.Thread(target=tx.poke)  # another thread: an owned RLock blocks it
        held_elsewhere.start()
        held_elsewhere.join(5.0)
        assert not held_elsewhere.is_alive()
    finally:
        tx.close()
        rx.close()


def test_ctrl_c_as_a_receive_takes_the_ring_ends_lock_leaves_it_free():
    """RingConsumer.recv_into's locked path (taken once the producer closed): another
    thread's receive then says the producer is gone, not EndBusy for ever."""
    rx = RingConsumer.create(1024)
    tx = RingProducer.attach(rx.spec)
    try:
        tx.close()
        lock = rx._lock
        with ctrl_c_once_held(lock, RingConsumer.recv_into.__code__) as fired:
            with pytest.raises(KeyboardInterrupt):
                rx.recv_into(lambda t, v: None)
            assert not lock._is_owned(), f"the ring's lock stays held after a Ctrl-C at {fired}"
        errors: list = []

        def receive() -> None:
            try:
                rx.recv_into(lambda t, v: None)
            except Exception as e:  # noqa: BLE001 - what it raised is the check
                errors.append(e)

        other = threading.Thread(target=receive)
        other.start()
        other.join(5.0)
        assert not other.is_alive()
        assert [type(e) for e in errors] == [PeerDeadError]
    finally:
        rx.close()
