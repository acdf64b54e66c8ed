"""The vLLM engine core's sends to a frontend whose output ring is full (no vLLM needed):
they never wait; what the ring cannot take is kept, in order, and written by the link's
flusher thread as the frontend makes room, so an API server that stops reading holds back
neither the busy loop nor the other API servers' outputs. A gone frontend ends the flusher
and drops what was kept; shutdown and ENGINE_CORE_DEAD give live frontends a bounded time
to take it first. A frontend that breaks its channel's protocol is taken as gone (the
test of its request side needs vLLM: marked ``vllm``)."""

from __future__ import annotations

import os
import select
import struct
import threading
import time
from types import SimpleNamespace

import pytest

from shmclient.channel import ShmChannel
from shmclient.errors import WouldBlock
from shmclient.vllm import wire
from shmclient.vllm.engine_link import _EngineLink, drain
from shmclient.vllm.engine_outputs import _InlineOutputs

FILLER = b"f" * 512


@pytest.fixture
def channels():
    made: list = []

    def make():
        front, spec = ShmChannel.create(ring_capacity=4096, arena_bytes=0, spin_us=0.0, wake_fd=True)
        engine = ShmChannel.attach(spec)
        front.peer_attached()
        made.append((front, engine))
        return front, engine

    try:
        yield make
    finally:
        for front, engine in made:
            engine.close()
            front.close()


def make_link(channel: ShmChannel, client_index: int = 0, alive=None) -> _EngineLink:
    """An engine link over ``channel`` without a spec (what sends need: the channel, the
    frontend's liveness, the backlog)."""
    link = object.__new__(_EngineLink)
    link.channel, link.client_index, link.frontend_gone = channel, client_index, False
    link._parked = link._parked_flag = link._pidfd = None
    state = {"alive": True} if alive is None else alive
    link.frontend_alive = lambda: state["alive"] and not link.frontend_gone
    link._start_sending()
    return link


def fill(channel: ShmChannel, *, wake: bool = True) -> int:
    """Fill the ring from the engine's end; how many fillers went in. ``wake=False``: with
    their wake-ups held back (the frontend, asleep, is not woken)."""
    sent = 0
    try:
        while True:
            channel.send_nowait(1, FILLER, wake=wake)
            sent += 1
    except WouldBlock:
        return sent


def read(front: ShmChannel, count: int, timeout: float = 10.0) -> list:
    """``count`` records from the frontend's end, waiting on its wake pipe."""
    got: list = []
    deadline = time.monotonic() + timeout
    fd = front.recv_fd()
    while len(got) < count:
        left = deadline - time.monotonic()
        assert left > 0, f"got {len(got)} of {count} records"
        front.arm_recv()
        got += front.rx.try_recv()
        if len(got) < count:
            select.select([fd], [], [], min(left, 0.5))
    return got


def in_thread(fn, timeout: float = 10.0) -> None:
    """Run ``fn`` in a thread; fail (not hang) when it does not finish in ``timeout``."""
    errors: list = []

    def body():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "the sends waited for a frontend that does not read"
    if errors:
        raise errors[0]


def test_sends_to_a_frontend_that_stops_reading_never_wait_and_arrive_in_order(channels):
    front, engine = channels()
    link = make_link(engine)
    fillers = fill(engine)
    kept: list = []
    in_thread(lambda: kept.extend(link.send(wire.OUTPUTS, [b"m%03d" % i]) for i in range(300)))
    assert kept == [True] * 300  # each one after the kept ones, none written past them
    got = read(front, fillers + 300)
    assert [p for _, p in got[:fillers]] == [FILLER] * fillers
    assert got[fillers:] == [(wire.OUTPUTS, b"m%03d" % i) for i in range(300)]
    assert link.drain(time.monotonic() + 10)
    assert link._flusher is None
    assert link.send(wire.OUTPUTS, [b"again"]) is False  # room: written at once
    assert read(front, 1) == [(wire.OUTPUTS, b"again")]
    link.close()


def test_a_kept_message_longer_than_a_record_resumes_where_it_stopped(channels):
    front, engine = channels()
    link = make_link(engine)
    big = bytes(range(256)) * 40  # ~10 KiB: fragments through a 4 KiB ring
    small = b"after"
    in_thread(lambda: (link.send(wire.OUTPUTS, [big]), link.send(wire.OUTPUTS, [small])))
    got = read(front, 2)
    assert got == [(wire.OUTPUTS, big), (wire.OUTPUTS, small)]
    link.close()


def test_a_stalled_frontend_holds_back_neither_the_busy_loop_nor_the_others(channels):
    """Two API servers: the first stops reading; the busy loop's batches to the second
    are written at once, in order, while the first's wait for it."""
    (front0, engine0), (front1, engine1) = channels(), channels()
    links = [make_link(engine0, 0), make_link(engine1, 1)]
    for link in links:
        link.framing = SimpleNamespace(encoder=SimpleNamespace(encode_into=encode_into), take_placed=list)
    out = _InlineOutputs(links, engine_index=0, inline_max=8)
    fillers = fill(engine0)

    def steps():
        for i in range(200):
            out.put_nowait(batch(b"a%03d" % i, 0))
            out.put_nowait(batch(b"b%03d" % i, 1))

    in_thread(steps)  # the first frontend has read nothing yet
    assert [p for _, p in read(front1, 200)] == [b"b%03d" % i for i in range(200)]
    got = read(front0, fillers + 200)
    assert [p for _, p in got[fillers:]] == [b"a%03d" % i for i in range(200)]
    drain(links, 10)
    assert all(link._flusher is None for link in links)
    for link in links:
        link.close()


def encode_into(outputs, buffer: bytearray) -> list:
    """As vLLM's encoder: the message written into ``buffer``, which is its first frame."""
    buffer[:] = outputs.tag
    return [buffer]


def batch(tag: bytes, client: int) -> tuple[int, SimpleNamespace]:
    return client, SimpleNamespace(tag=tag, outputs=[None], engine_index=None)


def test_a_kept_batch_keeps_its_bytes_while_the_next_is_encoded(channels):
    """The encoder writes each batch into a reusable buffer; one kept for the flusher is
    that buffer, so the next batch must be encoded into another."""
    front, engine = channels()
    link = make_link(engine)
    link.framing = SimpleNamespace(encoder=SimpleNamespace(encode_into=encode_into), take_placed=list)
    out = _InlineOutputs([link], engine_index=0, inline_max=8)
    fillers = fill(engine)
    in_thread(lambda: [out.put_nowait(batch(tag, 0)) for tag in (b"first", b"second", b"third")])
    got = read(front, fillers + 3)
    assert [p for _, p in got[fillers:]] == [b"first", b"second", b"third"]
    link.close()


def test_a_gone_frontend_ends_the_flusher_and_drops_what_was_kept(channels):
    front, engine = channels()
    state = {"alive": True}
    link = make_link(engine, alive=state)
    fill(engine)
    assert link.send(wire.OUTPUTS, [b"kept"]) is True
    flusher = link._flusher
    state["alive"] = False  # the frontend died without reading
    assert link.drain(time.monotonic() + 10)  # nobody to wait for
    flusher.join(10)
    assert not flusher.is_alive() and not link._backlog
    assert link.frontend_gone and link.send(wire.OUTPUTS, [b"late"]) is False
    link.close()


def test_drain_gives_up_at_its_deadline_while_a_live_frontend_does_not_read(channels):
    front, engine = channels()
    link = make_link(engine)
    fillers = fill(engine)
    assert link.send(wire.OUTPUTS, [b"kept"]) is True
    assert link.drain(time.monotonic() + 0.05) is False
    got = read(front, fillers + 1)
    assert got[-1] == (wire.OUTPUTS, b"kept")
    assert link.drain(time.monotonic() + 10) is True
    link.close()


def test_close_ends_a_flusher_waiting_for_room(channels):
    front, engine = channels()
    link = make_link(engine)
    fill(engine)
    assert link.send(wire.OUTPUTS, [b"kept"]) is True
    flusher = link._flusher
    link.close()
    assert not flusher.is_alive() and link._flusher is None


def test_engine_core_dead_goes_after_what_full_rings_held_back(channels):
    front, engine = channels()
    link = make_link(engine)
    link.framing = SimpleNamespace(encoder=SimpleNamespace(encode_into=encode_into), take_placed=list)
    out = _InlineOutputs([link], engine_index=0, inline_max=8)
    fillers = fill(engine)
    out.put_nowait(batch(b"last", 0))  # kept: the ring is full
    out.put_nowait(b"DEAD")
    when: list = []

    class Socket:
        def send(self, frame: bytes) -> None:
            when.append((frame, list(link._backlog)))

    thread = threading.Thread(target=out.serve_queued, args=([Socket()],))
    thread.start()
    try:
        got = read(front, fillers + 1)
    finally:
        thread.join(10)
    assert not thread.is_alive()
    assert got[-1] == (wire.OUTPUTS, b"last")
    assert when == [(b"DEAD", [])]  # sent once the kept batch was written
    link.close()


@pytest.mark.parametrize("wake", [False, True])
def test_a_kept_message_gives_a_wake_up_held_back_by_earlier_quiet_sends(channels, wake):
    """Batches written without their wake-up filled the ring: the frontend sleeps on a full
    ring; the next batch, kept, wakes it whatever its own ``wake`` (the frontend must read
    to make room: a held-back wake-up would leave the kept batch waiting for a frontend
    that sleeps, until the frontend's own timeout)."""
    front, engine = channels()
    link = make_link(engine)
    fillers = fill(engine, wake=False)
    fd = front.recv_fd()
    assert fillers and not select.select([fd], [], [], 0)[0]
    assert link.send(wire.OUTPUTS, [b"kept"], wake=wake) is True
    assert select.select([fd], [], [], 0)[0], "the frontend sleeps on a full ring"
    got = read(front, fillers + 1)
    assert [r for r in got if r[1] != FILLER] == [(wire.OUTPUTS, b"kept")] and got[-1] == (wire.OUTPUTS, b"kept")
    link.close()


def _blocked_signals(native_id: int) -> int:
    with open(f"/proc/self/task/{native_id}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("SigBlk:"):
                return int(line.split()[1], 16)
    raise AssertionError("no SigBlk line")


def test_the_flusher_leaves_sigterm_and_sigint_to_the_main_thread(channels):
    """Started from the busy loop (the main thread, signals unblocked), the flusher must
    not take the SIGTERM that should wake vLLM's main thread."""
    import signal

    front, engine = channels()
    link = make_link(engine)
    fillers = fill(engine)
    assert link.send(wire.OUTPUTS, [b"kept"]) is True  # from this (the main) thread
    flusher = link._flusher
    want = (1 << (signal.SIGTERM - 1)) | (1 << (signal.SIGINT - 1))
    deadline = time.monotonic() + 10
    while _blocked_signals(flusher.native_id) & want != want:
        assert time.monotonic() < deadline, "the flusher takes SIGTERM and SIGINT"
    read(front, fillers + 1)
    link.close()


def test_an_api_servers_pidfd_numbered_above_1023_reads_as_alive_while_it_lives():
    """With several API servers the engine watches each with a pidfd. select() raises
    ValueError for a descriptor above 1023 (an engine with many files open reaches
    that), which was taken for the API server's death: its requests went unread and
    its outputs were dropped while it waited for good. poll() takes any number."""
    import os
    import resource
    import subprocess
    import sys

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft <= 1500:
        if hard != resource.RLIM_INFINITY and hard <= 1500:
            pytest.skip(f"the open-file limit ({hard}) is below 1501")
        resource.setrlimit(resource.RLIMIT_NOFILE, (1501, hard))
    server = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                              stdin=subprocess.PIPE)
    fd = -1
    try:
        pidfd = os.pidfd_open(server.pid)
        fd = os.dup2(pidfd, 1500)
        os.close(pidfd)
        link = object.__new__(_EngineLink)
        link.frontend_gone, link.launcher_pid, link._pidfd = False, os.getppid(), fd
        link.frontend_pid = server.pid
        assert link.frontend_alive() is True
        server.stdin.close()  # the API server ends
        server.wait(10)
        assert link.frontend_alive() is False
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        if server.stdin and not server.stdin.closed:
            server.stdin.close()
        if fd >= 0:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


OFF_TAIL = 256  # the consumer's position in a ring's header (tests/test_ring_hardening.py)


@pytest.mark.parametrize("kept", [False, True], ids=["written-at-once", "kept-for-the-flusher"])
def test_a_frontend_that_breaks_its_ring_is_taken_as_gone_and_the_others_are_served(channels, kept, caplog):
    """One API server's output ring read back a position no reader could have stored (a
    hostile or corrupted frontend): the busy loop's send must not raise (that killed the
    engine for every API server), and neither may the flusher's; that frontend is taken
    as gone (one ERROR line) and the other API servers' outputs go on."""
    caplog.set_level("ERROR", logger="vllm.shmclient")
    front0, engine0 = channels()
    front1, engine1 = channels()
    link0, link1 = make_link(engine0), make_link(engine1, client_index=1)
    fill(engine0)
    if kept:
        assert link0.send(wire.OUTPUTS, [b"kept"]) is True  # the flusher waits for room
    struct.pack_into("<Q", front0.rx._res.seg.buf, OFF_TAIL, 1 << 40)  # the frontend's bad store
    if kept:
        assert link0.drain(time.monotonic() + 30)  # the flusher's next try finds it and ends
        assert link0.frontend_gone
    for i in range(3):
        assert link0.send(wire.OUTPUTS, [b"m%d" % i]) is False  # never raises
        assert link1.send(wire.OUTPUTS, [b"n%d" % i]) is False
    assert link0.frontend_gone and not link1.frontend_gone
    assert read(front1, 3) == [(wire.OUTPUTS, b"n%d" % i) for i in range(3)]
    broke = [r for r in caplog.records if "broke the channel's protocol" in r.getMessage()]
    assert len(broke) == 1, [r.getMessage() for r in caplog.records]
    link0.close()
    link1.close()


OFF_HEAD = 64  # the producer's position in a ring's header


@pytest.mark.vllm
def test_a_frontend_that_breaks_its_request_ring_is_taken_as_gone(channels):
    """An API server (of several: its end does not end the engine) whose request ring
    reads back a head no writer could have stored: the engine's reader of that ring
    ends with the frontend taken as gone, instead of raising into vLLM's fatal path
    (EXECUTOR_FAILED: the engine died for every API server)."""
    import queue

    from .conftest import importorskip_vllm
    importorskip_vllm()  # an error, not a skip, under SHMCLIENT_REQUIRE_VLLM=1
    from vllm.v1.engine import EngineCoreRequestType

    from shmclient.vllm.engine import _fatal_if_raises, _read_requests

    front, engine = channels()
    link = make_link(engine, client_index=1)
    link.launcher_pid, link.launcher_gone = os.getppid(), False  # an API server of a launcher: its parent
    assert not link.ends_engine
    core = SimpleNamespace(input_queue=queue.Queue(), vllm_config=SimpleNamespace())
    types = {t.value[0]: t for t in EngineCoreRequestType}
    struct.pack_into("<Q", front.tx._res.seg.buf, OFF_HEAD, 12345)  # the frontend's bad store
    in_thread(lambda: _fatal_if_raises(core, "request", _read_requests, core, link, types), timeout=30)
    assert link.frontend_gone
    assert core.input_queue.empty()  # nothing fatal queued for the engine
    link.close()
