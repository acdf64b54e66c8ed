"""Faults of the ring's earlier semaphore design, each pinned by a test that failed on it:
interrupts between taking and counting, signals during waits, names left behind during
engine start-up, fork children, re-entrant handlers, views kept past a handler, and a
litmus stress test of the memory ordering (``slow``)."""

from __future__ import annotations

import atexit
import gc
import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import numpy as np
import psutil
import pytest

from shmclient import waiting
from shmclient.errors import PeerNotConsumingError, PeerNotProducingError
from shmclient.ring import Ring
from shmclient.ring_consumer import RingConsumer
from shmclient.ring_producer import RingProducer

from .forked import in_child
from .forked import mapped as _mapped

CTX = mp.get_context("spawn")


@pytest.fixture(scope="module", autouse=True)
def _resource_tracker():
    """Spawning starts multiprocessing's resource tracker, which outlives each test."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()


def _producer_main(spec_bytes: bytes, count: int, pace_s: float, go) -> None:
    import msgspec

    from shmclient.ring import RingSpec

    p = RingProducer.attach(msgspec.msgpack.decode(spec_bytes, type=RingSpec))
    go.send("attached")
    for i in range(count):
        waiting.send(p, 1, i.to_bytes(8, "little") * 4, timeout=30)
        if pace_s:
            t = time.perf_counter() + pace_s
            while time.perf_counter() < t:
                pass
    go.recv()  # the consumer asks for one more record after the storm
    waiting.send(p, 2, b"last", timeout=30)
    go.recv()
    p.close()


def _spec_bytes(r: Ring) -> bytes:
    import msgspec

    return msgspec.msgpack.encode(r.spec)


class _Interrupted(Exception):
    pass


def test_sigint_storm_never_leaves_the_consumer_behind():
    """SIGINTs at random moments while a consumer streams records: the handler's
    exception propagates out of the wait (EINTR reaches Python), no record is taken twice
    or out of order, and afterwards the consumer is never one record behind."""
    count = 20_000
    c = RingConsumer.create(4096, spin_us=5)
    parent, kid = CTX.Pipe()
    proc = CTX.Process(target=_producer_main, args=(_spec_bytes(c), count, 20e-6, kid))
    receiving = [False]

    def on_sigint(*_) -> None:
        # Raise only inside the receive call (the test's own loop lines must not be hit).
        if receiving[0]:
            raise _Interrupted()

    old = signal.signal(signal.SIGINT, on_sigint)
    stop = threading.Event()
    sent = [0]

    def storm() -> None:
        rng = random.Random(7)
        while not stop.wait(rng.uniform(0.0005, 0.003)):
            os.kill(os.getpid(), signal.SIGINT)
            sent[0] += 1

    t = threading.Thread(target=storm)
    try:
        proc.start()
        assert parent.poll(30) and parent.recv() == "attached"
        c.unlink()
        t.start()
        seen: list[int] = []
        interrupts = 0
        deadline = time.monotonic() + 60
        while (not seen or seen[-1] < count - 1) and time.monotonic() < deadline:
            got = []
            try:
                try:
                    receiving[0] = True
                    got = waiting.recv(c, timeout=5)
                finally:
                    receiving[0] = False
            except _Interrupted:
                interrupts += 1
            seen += [int.from_bytes(body[:8], "little") for _, body in got]
        signal.signal(signal.SIGINT, lambda *_: None)  # one may still be pending
        stop.set()
        t.join()
        assert interrupts >= 30, f"only {interrupts} interrupts landed"
        assert seen == sorted(set(seen)), "a record came twice or out of order"
        # A signal landing after the ring handed the records over, before waiting.recv()
        # returned them, can drop that one call's result at the call site (any Python API
        # can); it must never shift what comes later.
        assert seen[-1] == count - 1 and len(seen) > count // 2
        parent.send("more")
        got = waiting.recv(c, timeout=10)
        assert got == [(2, b"last")], "the consumer fell behind"
        parent.send("done")
        proc.join(30)
        assert proc.exitcode == 0
    finally:
        stop.set()
        if t.is_alive():
            t.join()
        signal.signal(signal.SIGINT, old)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        c.close()
        parent.close()
        kid.close()


def test_signal_handler_exception_propagates_from_a_blocked_wait_at_once():
    c = RingConsumer.create(4096, spin_us=0)
    p = RingProducer.attach(c.spec)
    old = signal.signal(signal.SIGUSR1, lambda *_: (_ for _ in ()).throw(_Interrupted()))
    timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGUSR1))
    try:
        timer.start()
        t0 = time.monotonic()
        with pytest.raises(_Interrupted):
            waiting.recv(c, timeout=10)
        assert time.monotonic() - t0 < 2.0
        waiting.send(p, 1, b"after")  # the ring is intact
        assert waiting.recv(c, timeout=1) == [(1, b"after")]
        # the same for a producer waiting for space
        while p.try_send(1, b"x" * 1000):
            pass
        timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGUSR1))
        timer.start()
        with pytest.raises(_Interrupted):
            waiting.send(p, 1, b"y" * 1000, timeout=10)
    finally:
        timer.cancel()
        timer.join()
        signal.signal(signal.SIGUSR1, old)
        p.close()
        c.close()


def test_a_handler_that_receives_on_its_own_ring_is_refused():
    c = RingConsumer.create(4096)
    p = RingProducer.attach(c.spec)
    try:
        assert p.send_batch_nowait([(1, b"a"), (2, b"b"), (3, b"c")]) == 3
        got = []

        def handler(t, view):
            got.append(t)
            if t == 1:
                c.try_recv()  # would corrupt the read position

        with pytest.raises(RuntimeError, match="re-entrant"):
            c.recv_into(handler)
        assert c.recv_into(lambda t, v: got.append(t)) == 2
        assert got == [1, 2, 3]
        s = c.statistics()
        assert s.head == s.tail
    finally:
        p.close()
        c.close()


def _a_kept_view():
    """A 256-byte ring whose first record (100 bytes of "A") a handler kept an array
    of: ``(consumer, producer, kept)``."""
    c = RingConsumer.create(256)
    p = RingProducer.attach(c.spec)
    waiting.send(p, 1, b"A" * 100)
    kept: list = []
    c.recv_into(lambda t, v: kept.append(np.frombuffer(v, np.uint8)))
    return c, p, kept


def test_a_view_kept_past_the_handler_pins_its_bytes():
    c, p, kept = _a_kept_view()
    try:
        assert c.pinned == 1
        # the producer cannot reuse those bytes while the array lives
        assert p.try_send(2, b"B" * 100)
        with pytest.raises(PeerNotConsumingError):
            for _ in range(3):
                waiting.send(p, 3, b"C" * 100, timeout=0.05)
                c.recv_into(lambda t, v: None)
        assert bytes(kept[0]) == b"A" * 100
        kept.clear()
        gc.collect()
        c.recv_into(lambda t, v: None)
        assert c.pinned == 0
        waiting.send(p, 4, b"D" * 100, timeout=1)
        assert waiting.recv(c, timeout=1)[-1] == (4, b"D" * 100)
    finally:
        p.close()
        c.close()


def test_dropping_a_kept_view_wakes_the_producer_waiting_for_its_space():
    """A handler kept an array made from its view; the consumer then makes no call (it
    would park on the empty ring) while the producer waits for the space that view
    pins. Dropping the array used to release nothing until the consumer's next call,
    so both waited out their timeouts; it now releases the space and wakes the
    producer."""
    c, p, kept = _a_kept_view()
    sent: list = []
    producer = threading.Thread(
        target=lambda: sent.append(waiting.send(p, 3, b"C" * 100, timeout=10)))
    try:
        assert p.try_send(2, b"B" * 100)
        c.recv_into(lambda t, v: None)  # B is read; A's array still pins the space
        assert c.pinned == 1 and not p.try_send(3, b"C" * 100)
        producer.start()
        kept.clear()  # the consumer's last call was the one above
        producer.join(5)
        assert not producer.is_alive() and len(sent) == 1, "the producer was not woken"
        assert c.pinned == 0
        assert waiting.recv(c, timeout=1) == [(3, b"C" * 100)]
    finally:
        producer.join(15)
        p.close()
        c.close()


def test_a_forked_child_dropping_a_kept_view_moves_nothing_of_the_parents():
    c, p, kept = _a_kept_view()
    try:
        tail = c.statistics().tail
        pid = os.fork()
        if pid == 0:  # the child: drop its copy of the array, then leave at once
            kept.clear()
            gc.collect()
            os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        assert c.statistics().tail == tail and c.pinned == 1
        kept.clear()
        assert c.statistics().tail > tail and c.pinned == 0
    finally:
        p.close()
        c.close()


def test_a_forked_child_unmaps_its_parents_ring_once_its_kept_view_is_gone():
    """A forked child kept its copies of the parent's ring mappings until it exited. It
    lets go of them at the fork without writing to the ring, except the consumer's while
    the child still holds a view a handler kept, which it can read until it drops it."""
    c, p, kept = _a_kept_view()
    handle = c.spec.segment
    try:
        assert _mapped(handle) == 2
        tail = c.statistics().tail

        def child() -> str:
            seen = [_mapped(handle), int(bytes(kept[0]) == b"A" * 100)]
            kept.clear()
            gc.collect()
            return " ".join(map(str, [*seen, _mapped(handle)]))

        report = in_child(child)
        assert report == "1 1 0", "child: mappings with the view, view intact, mappings without it"
        assert _mapped(handle) == 2 and c.statistics().tail == tail and c.pinned == 1
        assert not p.peer_closed and not c.peer_closed
    finally:
        kept.clear()
        p.close()
        c.close()


def _child_report(r: int, pid: int) -> str:
    try:
        report = os.read(r, 200).decode()
    finally:
        os.close(r)
    _, status = os.waitpid(pid, 0)
    return report if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0 else f"status {status}"


def test_a_receive_handler_that_forks_releases_nothing_from_the_child():
    """A handler forks and the child returns from it: the child's copy of the call went
    on to release the records read, moving the parent's ring position while the
    parent's handler still read them."""
    c = RingConsumer.create(4096)
    p = RingProducer.attach(c.spec)
    seen: list = []

    def handler(rtype, view):
        if seen:
            return
        tail = c.statistics().tail
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            seen.append(w)  # the child returns from the handler: the call goes on here
            return
        os.close(w)
        seen.append((_child_report(r, pid), c.statistics().tail == tail, bytes(view)))

    try:
        waiting.send(p, 1, b"one")
        waiting.send(p, 2, b"two")
        try:
            c.recv_into(handler)
        except BaseException as e:
            if isinstance(seen[0], int):  # the child
                os.write(seen[0], type(e).__name__.encode())
                os._exit(0)
            raise
        if isinstance(seen[0], int):
            os._exit(1)  # the child: its call ended without an error
        assert seen[0] == ("ForkedError", True, b"one")
        assert c.statistics().tail > 0 and c.try_recv() == []
    finally:
        p.close()
        c.close()


def test_a_signal_handler_that_forks_inside_a_wait_leaves_the_childs_wait_safely():
    """A signal handler run inside a consumer's wait forks: the child's wait resumes on
    a mapping the fork let go of; it must raise ForkedError, not read it."""
    c = RingConsumer.create(4096)
    p = RingProducer.attach(c.spec)
    child: list = []
    parent: list = []

    def on_alarm(signum, frame):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            child.append(w)
            return
        os.close(w)
        p.try_send(1, b"after")  # the parent's wait then ends with it
        parent.append(_child_report(r, pid))

    old = signal.signal(signal.SIGALRM, on_alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        try:
            got = waiting.recv(c, timeout=10, spin=0.0)
        except BaseException as e:
            if child:
                os.write(child[0], type(e).__name__.encode())
                os._exit(0)
            raise
        if child:
            os._exit(1)
        assert parent == ["ForkedError"] and got == [(1, b"after")]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        p.close()
        c.close()


def test_a_ring_end_closed_under_a_waiting_thread_unmaps_when_the_waiter_leaves(monkeypatch):
    """A producer closed while another thread waits in it for room kept its mapping
    until the ring object was dropped; it goes when that waiter leaves now."""
    monkeypatch.setattr(waiting, "LIVENESS_S", 30.0)  # one wait, woken by the close
    c = RingConsumer.create(256)
    p = RingProducer.attach(c.spec)
    handle = c.spec.segment
    errors: list = []

    def wait_for_room():
        try:
            waiting.send(p, 2, b"B" * 200, timeout=30)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=wait_for_room)
    try:
        assert p.try_send(1, b"A" * 200)
        t.start()
        deadline = time.monotonic() + 10
        while p.statistics().waits_on_full == 0:  # counted inside the C wait
            assert time.monotonic() < deadline, "the sender never waited"
            time.sleep(0.001)
        assert _mapped(handle) == 2
        p.close()
        t.join(10)
        assert not t.is_alive() and type(errors[0]).__name__ == "ClientClosedError"
        assert _mapped(handle) == 1  # the consumer's; p (still referenced) let go of its own
    finally:
        p.close()
        t.join(10)
        c.close()
    assert _mapped(handle) == 0


def test_a_closed_producer_is_read_to_the_end_first():
    c = RingConsumer.create(4096)
    p = RingProducer.attach(c.spec)
    try:
        waiting.send(p, 1, b"one")
        waiting.send(p, 2, b"two")
        p.close()
        assert waiting.recv(c, timeout=1) == [(1, b"one"), (2, b"two")]
        from shmclient.errors import PeerDeadError

        with pytest.raises(PeerDeadError):
            waiting.recv(c, timeout=1)
    finally:
        c.close()


def _fork_and_exit_normally() -> None:
    pid = os.fork()
    if pid == 0:  # the child exits the normal way: atexit hooks and finalizers run
        try:
            gc.collect()
            atexit._run_exitfuncs()
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def test_a_fork_child_that_exits_leaves_the_parents_ring_alone():
    c = RingConsumer.create(4096)
    p = RingProducer.attach(c.spec)
    try:
        _fork_and_exit_normally()
        assert not p.peer_closed and not c.peer_closed
        waiting.send(p, 1, b"still open")
        assert waiting.recv(c, timeout=1) == [(1, b"still open")]
    finally:
        p.close()
        c.close()


def test_a_fork_child_that_exits_leaves_the_parents_engine_alone():
    """A script forks a worker that exits the normal way (interpreter shutdown, atexit,
    finalizers): the parent's client must go on being served."""
    script = textwrap.dedent(
        """
        import os, sys
        from shmclient.config import EngineConfig
        from shmclient import EngineCoreRequest, SamplingParams, make_client
        client = make_client(True, False, EngineConfig(model="mock"))
        pid = os.fork()
        if pid == 0:
            sys.exit(0)
        os.waitpid(pid, 0)
        client.add_request(EngineCoreRequest(request_id="r", prompt_token_ids=[1, 2, 3],
                           sampling_params=SamplingParams(max_tokens=2, temperature=0.0)))
        done = False
        while not done:
            for out in client.get_output(timeout=10).outputs:
                done = out.finished
        print("served", flush=True)
        client.shutdown()
        """
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "served", r.stderr[-2000:]


def test_frontend_killed_during_engine_start_up_leaves_nothing(tmp_path, monkeypatch):
    """The engine hangs before READY (as a slow model load would); the frontend is
    SIGKILLed then. Nothing may stay in /dev/shm or the temporary folder (where the control
    socket's ``shmc-ipc-*`` folder is made: the session's private one under pytest), and the
    engine exits."""
    tmp = tempfile.gettempdir()
    shm_before, tmp_before = set(os.listdir("/dev/shm")), set(os.listdir(tmp))
    script = textwrap.dedent(
        """
        from shmclient.config import EngineConfig
        from shmclient import make_client
        print("starting", flush=True)
        make_client(True, False, EngineConfig(model="mock", engine_module="tests.fault_engine",
                                              engine_ready_timeout_s=60))
        """
    )
    from .fault_engine import FAULT_ENV

    monkeypatch.setenv(FAULT_ENV, "hang_before_ready")  # the frontend passes it on
    front = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    engine = None
    try:
        assert front.stdout.readline().strip() == "starting"
        deadline = time.monotonic() + 30
        me = psutil.Process(front.pid)
        while engine is None and time.monotonic() < deadline:
            kids = me.children()
            if kids:
                engine = kids[0]
            else:
                try:
                    front.wait(0.02)
                except subprocess.TimeoutExpired:
                    pass
        assert engine is not None, "the engine was never started"
        # the ring segments exist (in the frontend) before the kill
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            links = []
            for fd in os.listdir(f"/proc/{front.pid}/fd"):
                try:
                    links.append(os.readlink(f"/proc/{front.pid}/fd/{fd}"))
                except OSError:
                    pass
            if sum(x.startswith("/memfd:") for x in links) >= 4:
                break
            try:
                front.wait(0.02)
            except subprocess.TimeoutExpired:
                pass
        os.kill(front.pid, signal.SIGKILL)
        front.wait(10)
        engine.wait(10)
        pids = (str(front.pid), str(engine.pid))
        new = set(os.listdir("/dev/shm")) - shm_before  # other processes may add their own
        assert {n for n in new if "shmc" in n or any(p in n for p in pids)} == set()
        assert {n for n in set(os.listdir(tmp)) - tmp_before if n.startswith("shmc")} == set()
    finally:
        if front.poll() is None:
            front.kill()
            front.wait(5)
        if engine is not None and engine.is_running():
            engine.kill()
        front.stdout.close()


# ---------------------------------------------------------------- litmus (slow)


def _litmus_producer(spec_bytes: bytes, count: int) -> None:
    import msgspec

    from shmclient.ring import RingSpec

    p = RingProducer.attach(msgspec.msgpack.decode(spec_bytes, type=RingSpec), spin_us=2)
    rng = random.Random(count)
    for seq in range(count):
        words = rng.randrange(1, 24)  # sizes that make the tiny ring wrap and pad constantly
        waiting.send(p, seq & 0xFF, np.full(words, seq, dtype=np.uint64).tobytes(), timeout=60)
    p.close()


@pytest.mark.slow
def test_litmus_every_word_of_every_record_equals_its_sequence_number():
    """Two processes, a 256-byte ring, 10^6 records whose every 8-byte word is the
    record's sequence number: a reordering of the data stores against the head store
    (or of the consumer's reads against its tail store) shows up as a torn record."""
    count = 1_000_000
    c = RingConsumer.create(256, spin_us=2)
    proc = CTX.Process(target=_litmus_producer, args=(_spec_bytes(c), count))
    proc.start()
    try:
        seq = 0

        def check(rtype, view):
            nonlocal seq
            a = np.frombuffer(view, np.uint64)
            assert rtype == seq & 0xFF and a.size and (a == seq).all(), f"torn record {seq}: {a}"
            seq += 1

        while seq < count:
            waiting.recv_into(c, check, timeout=60)
        proc.join(60)
        assert proc.exitcode == 0
        assert c.statistics().wraps > 10_000
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        c.close()


def test_sigterm_to_an_idle_engine_is_a_clean_stop_not_a_crash():
    """docker stop / systemd send SIGTERM to an engine sleeping in a ring wait: its
    handler's SystemExit must come out of the wait (no 'interrupted by a signal' error
    reported as ENGINE_CORE_DEAD): the engine exits with 143 and says nothing is wrong."""
    from shmclient.config import EngineConfig
    from shmclient import make_client
    from shmclient.errors import EngineDeadError

    client = make_client(True, False, EngineConfig(model="mock"))
    try:
        engine = psutil.Process(client.engine_pid)
        deadline = time.monotonic() + 10  # idle: asleep on the request ring's futex
        while engine.status() != psutil.STATUS_SLEEPING and time.monotonic() < deadline:
            try:
                engine.wait(0.01)
            except psutil.TimeoutExpired:
                pass
        os.kill(client.engine_pid, signal.SIGTERM)
        assert client.resources.proc.wait(10) == 143
        with pytest.raises(EngineDeadError) as ei:
            client.get_output(timeout=10)
        assert "143" in str(ei.value)
        assert "Signal" not in str(ei.value) and "interrupted" not in str(ei.value)
    finally:
        client.shutdown()


def test_a_reader_never_waits_behind_a_sender_stuck_on_a_full_ring():
    """One thread's send waits on a full request ring (a stalled engine); the reading
    thread, with tensor releases to hand back, must still time out on its own schedule
    instead of queueing behind the sender's lock."""
    from shmclient.channel import REQ_UTILITY, ShmChannel

    front, spec = ShmChannel.create(ring_capacity=4096, arena_bytes=1 << 20, spin_us=0, wake_fd=False)
    engine = ShmChannel.attach(spec)
    front.peer_attached()
    outcome: list[BaseException | None] = []

    def send_on_full_ring():
        try:
            waiting.send(front, REQ_UTILITY, b"x" * 3000, timeout=3)
            outcome.append(None)
        except BaseException as e:  # asserted on in the test's own thread
            outcome.append(e)

    stuck = threading.Thread(target=send_on_full_ring)
    try:
        waiting.send(front, REQ_UTILITY, b"x" * 3000, timeout=1)  # the engine never reads
        stuck.start()
        deadline = time.monotonic() + 5
        while front.tx.statistics().waits_on_full == 0 and time.monotonic() < deadline:
            stuck.join(0.005)
        assert front.tx.statistics().waits_on_full >= 1
        front._released.append(7)  # a tensor block this side is done with
        t0 = time.monotonic()
        with pytest.raises(PeerNotProducingError):
            waiting.recv(front, timeout=0.2)
        assert time.monotonic() - t0 < 1.5, "the reader waited behind the stuck sender"
        stuck.join(10)
        assert not stuck.is_alive(), "the stuck send never timed out"
        assert len(outcome) == 1 and isinstance(outcome[0], PeerNotConsumingError), outcome
    finally:
        stuck.join(10)
        engine.close()
        front.close()


def test_a_channel_that_cannot_be_reserved_names_what_the_whole_channel_needs(monkeypatch):
    from shmclient import shm
    from shmclient.channel import ShmChannel
    from shmclient.errors import ShmCapacityError

    real = shm.Segment.create.__func__
    made = []

    def fail_on_arena(cls, size, prefix="shmc", name=None, **kw):
        if prefix == "shmc-t" and made:  # the second arena: the host ran out
            raise ShmCapacityError(f"cannot reserve {size} bytes")
        seg = real(cls, size, prefix, name, **kw)
        if prefix == "shmc-t":
            made.append(seg)
        return seg

    def memfds() -> int:
        n = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                n += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
            except OSError:
                pass
        return n

    monkeypatch.setattr(shm.Segment, "create", classmethod(fail_on_arena))
    need = 2 * (4096 + 4096)  # the rings: the arenas are reserved on their first tensor
    before = memfds()
    with pytest.raises(ShmCapacityError, match=f"needs {need} bytes"):
        ShmChannel.create(ring_capacity=4096, arena_bytes=1 << 20, spin_us=0, wake_fd=True)
    made.clear()
    gc.collect()
    assert memfds() == before  # the rings and the first arena were released again


def test_a_reader_that_fails_after_draining_the_wake_pipe_is_woken_again():
    """An event-loop reader drains the wake pipe, then fails before it reads: the
    records still in the ring must keep the descriptor readable."""
    import select

    c = RingConsumer.create(4096, consumer_wake_fd=True)
    p = RingProducer.attach(c.spec)
    try:
        waiting.send(p, 1, b"one")
        assert select.select([c.fileno()], [], [], 1.0)[0]
        c.drain_wake_fd()  # ... and the reader raises here, reading nothing
        assert select.select([c.fileno()], [], [], 0.5)[0], "the wake-up was lost"
        waiting.send(p, 2, b"two")  # later records wake it as well
        assert c.try_recv() == [(1, b"one"), (2, b"two")]
        c.drain_wake_fd()
        assert not select.select([c.fileno()], [], [], 0)[0]  # nothing unread: quiet
        waiting.send(p, 3, b"three")
        assert select.select([c.fileno()], [], [], 1.0)[0]
    finally:
        p.close()
        c.close()


_SHIFTED_CLOCK = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <sys/time.h>
#include <time.h>
/* CLOCK_REALTIME reads one hour ahead, as if the wall clock had been stepped. */
int clock_gettime(clockid_t id, struct timespec *ts) {
    static int (*real)(clockid_t, struct timespec *);
    if (!real) real = dlsym(RTLD_NEXT, "clock_gettime");
    int r = real(id, ts);
    if (r == 0 && (id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE)) ts->tv_sec += 3600;
    return r;
}
int gettimeofday(struct timeval *tv, void *tz) {
    static int (*real)(struct timeval *, void *);
    if (!real) real = dlsym(RTLD_NEXT, "gettimeofday");
    int r = real(tv, tz);
    if (r == 0 && tv) tv->tv_sec += 3600;
    return r;
}
"""


def test_a_wall_clock_step_does_not_stretch_a_wait(tmp_path):
    """Waits are measured on CLOCK_MONOTONIC: with the process's CLOCK_REALTIME reading
    an hour off (what an absolute-deadline wait would see after a step of the clock), a
    0.3 s receive still times out after about 0.3 s."""
    import shutil

    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler to build the clock shim")
    src = tmp_path / "shift.c"
    src.write_text(_SHIFTED_CLOCK)
    lib = tmp_path / "shift.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(lib), str(src), "-ldl"], check=True)
    script = textwrap.dedent(
        """
        import time
        from shmclient import waiting
        from shmclient.errors import PeerNotProducingError
        from shmclient.ring_consumer import RingConsumer
        from shmclient.ring_producer import RingProducer
        import os
        assert time.time() - os.stat("/proc/self").st_mtime > 3000  # the shim is in effect
        c = RingConsumer.create(4096, spin_us=0)
        p = RingProducer.attach(c.spec)
        t0 = time.monotonic()
        try:
            waiting.recv(c, timeout=0.3)
        except PeerNotProducingError:
            pass
        print(f"{time.monotonic() - t0:.3f}")
        p.close(); c.close()
        """
    )
    env = dict(os.environ, LD_PRELOAD=str(lib))
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr[-2000:]
    assert float(r.stdout) < 2.0


def test_a_popen_with_preexec_fn_still_passes_a_rings_handles():
    """With a preexec_fn, Popen runs the at-fork hooks in its child before exec: the
    hook that lets go of the rings closed the descriptors pass_fds names (the ring's
    handles, ``handle_fds()``), and Popen raised EBADF."""
    c = RingConsumer.create(4096, consumer_wake_fd=True)
    try:
        fds = c.handle_fds()
        probe = "import os, sys; print(all(os.path.exists(f'/proc/self/fd/{fd}') for fd in sys.argv[1:]))"
        r = subprocess.run([sys.executable, "-c", probe, *map(str, fds)], pass_fds=fds,
                           preexec_fn=lambda: None, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and r.stdout.strip() == "True", r.stderr[-2000:]
    finally:
        c.close()


def test_a_segment_closed_under_a_view_unmaps_once_the_view_is_gone():
    """close() while a view of the segment lives keeps the mapping for the view: it
    was kept (strongly) for as long as the Segment object lived, after the view died."""
    from shmclient.shm import Segment

    seg = Segment.create(8192)
    handle = seg.name
    try:
        view = seg.buf[:16]
        seg.close()
        assert _mapped(handle) == 1  # for the view
        del view
        gc.collect()
        assert _mapped(handle) == 0
    finally:
        seg.release_handle()


def test_a_close_racing_a_failed_close_still_unmaps():
    """A close fails on a view; before it notes the mapping for later, the view goes and
    a second close runs (a ring end letting go of its view in another thread calls it).
    That second close found nothing to unmap, then the first kept the mapping for the
    Segment's life. The profile hook runs the second close at that point."""
    from shmclient.shm import Segment

    seg = Segment.create(8192)
    handle = seg.name
    views = [seg.buf[:16]]
    fired: list = []

    def at_the_failure(frame, event, arg):
        if event == "c_exception" and not fired and frame.f_code is Segment.close.__code__:
            fired.append(arg)
            views.clear()
            seg.close()

    try:
        sys.setprofile(at_the_failure)
        try:
            seg.close()
        finally:
            sys.setprofile(None)
        assert fired
        gc.collect()
        assert _mapped(handle) == 0
    finally:
        seg.release_handle()


def test_a_ring_released_before_a_fork_is_still_forgotten_in_the_child():
    """A ring end released while another thread still waited in it (its C end keeps the
    mapping until that waiter leaves) and then a fork: release() had let go of its C
    ends, so the child never told them to forget, and its copy, counting the waiter
    that is not in the child, kept the mapping for the child's life."""
    from shmclient.ring_resources import Resources

    calls: list = []

    class End:
        def close(self):
            calls.append("close")

        def detach(self, on_drop=None):
            calls.append("detach")

        def forget(self, on_drop=None):
            calls.append("forget")

    res = Resources(owner=False)
    res.ends.append(End())
    res.release()
    res.forget_after_fork()
    assert calls == ["close", "detach", "forget"]


def test_a_keyboardinterrupt_in_a_fork_hook_leaves_no_object_unforgotten():
    """A Ctrl-C (or a SIGTERM handler's SystemExit) landing in the child's fork hook
    ended it there: the objects not yet visited were never told, and their finalizers
    then closed the parent's rings and stopped its engine at the child's exit."""
    from shmclient import forksafe

    r, w = os.pipe()

    class Owner:
        def _forget_after_fork(self):
            os.write(w, b"x")
            raise KeyboardInterrupt

    owners = [Owner(), Owner()]
    for o in owners:
        forksafe.register(o)
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.close(w)
    got = b""
    try:
        while chunk := os.read(r, 16):
            got += chunk
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    assert got == b"xx"
