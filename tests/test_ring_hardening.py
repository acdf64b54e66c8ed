"""A hostile or broken peer, and misuse from threads and forked children.

The peer shares the ring's mapping, so every value it writes there (positions, record
headers, fragment totals, the capacity) is checked before use: a bad one closes this end
and raises ``RingCorruptError`` (a ``ProtocolError``) naming the field, its value and the
bound, never a hang, a crash or a read or write outside the mapping. A forked child can
use none of its parent's rings or clients (``ForkedError``); a second thread of this side
waits for a call in progress instead of being refused; a C end whose ``__init__`` did not
complete refuses every call with ValueError. Each test here failed before its fix. The hostile-peer fuzz test is ``slow``.
"""

from __future__ import annotations

import mmap
import os
import signal
import struct
import subprocess
import sys
import textwrap
import threading

import pytest

from shmclient import _ring, waiting
from shmclient.errors import ClientClosedError, ForkedError, PeerDeadError, ProtocolError, WouldBlock
from shmclient.ring import Ring, RingCorruptError
from shmclient.ring_consumer import RingConsumer
from shmclient.ring_producer import RingProducer

OFF_CAPACITY, OFF_HEAD, OFF_TAIL, DATA = 16, 64, 256, 4096
F_PAD, F_MORE, F_CONT = 0x02, 0x04, 0x08


def _put(ring: Ring, off: int, value: int, fmt: str = "<Q") -> None:
    struct.pack_into(fmt, ring._res.seg.buf, off, value)


def _get(ring: Ring, off: int) -> int:
    return struct.unpack_from("<Q", ring._res.seg.buf, off)[0]


def _record(ring: Ring, pos: int, length: int, rtype: int, flags: int, body: bytes = b"") -> None:
    """A record header (and body) written at data offset ``pos`` as a peer could."""
    struct.pack_into("<IBBH", ring._res.seg.buf, DATA + pos, length, rtype, flags, 0)
    ring._res.seg.buf[DATA + pos + 8:DATA + pos + 8 + len(body)] = body


@pytest.fixture
def rings():
    """A consumer that owns a 4096-byte ring and a producer attached to it."""
    c = RingConsumer.create(4096)
    p = RingProducer.attach(c.spec)
    c.unlink()
    yield p, c
    p.close()
    c.close()


def _run(script: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run ``script`` in a fresh interpreter of this tree; a hang fails, never freezes."""
    try:
        return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the script hung for {timeout} s: {(e.stderr or b'')[-2000:]!r}")


def _assert_broken(p: Ring, c: Ring, match: str) -> None:
    """The consumer raised once for ``match``; it stays broken and the producer is told."""
    with pytest.raises(RingCorruptError, match=match):
        c.try_recv()
    with pytest.raises(ProtocolError, match=match):  # every later call says it again
        c.recv_into(lambda t, v: None)
    with pytest.raises(PeerDeadError):  # the close reached the producer
        waiting.send(p, 1, b"x", timeout=1)


# ---------------------------------------------------------------- R1: a PAD past head


def test_r1_a_pad_beyond_the_published_head_is_an_error_not_a_hang():
    r = _run(
        f"""
        import struct
        from shmclient.ring import RingCorruptError
        from shmclient.ring_consumer import RingConsumer
        for call in ("take", "views"):
            c = RingConsumer.create(4096)
            buf = c._res.seg.buf
            struct.pack_into("<IBBH", buf, {DATA}, 0, 0, {F_PAD}, 0)  # PAD at offset 0
            struct.pack_into("<Q", buf, {OFF_HEAD}, 8)  # head: not a multiple of the capacity
            try:
                c.try_recv() if call == "take" else c.recv_into(lambda t, v: None)
            except RingCorruptError as e:
                print(call, "refused:", e)
            else:
                print(call, "accepted")
            c.close()
        """,
        timeout=30,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert [ln.split(":")[0] for ln in lines] == ["take refused", "views refused"], r.stdout
    assert all("PAD" in ln and "head" in ln for ln in lines), r.stdout


# ---------------------------------------------------------------- R2: head laps the ring


def test_r2_a_head_more_than_a_ring_ahead_is_refused(rings):
    p, c = rings
    waiting.send(p, 1, b"a" * 10)
    assert c.try_recv() == [(1, b"a" * 10)]
    _put(c, OFF_HEAD, _get(c, OFF_HEAD) + 4096 + 8)  # laps the unread ring: stale bytes
    _assert_broken(p, c, r"head .* bound")


def test_r2_a_head_that_moves_back_is_refused(rings):
    p, c = rings
    assert p.send_batch_nowait([(1, b"a" * 10), (2, b"b" * 10)]) == 2
    assert len(c.try_recv()) == 2
    waiting.send(p, 3, b"c")
    _put(c, OFF_HEAD, 8)  # behind what was read
    _assert_broken(p, c, r"head")


def test_r2_a_misaligned_head_is_refused(rings):
    p, c = rings
    waiting.send(p, 1, b"a" * 10)
    _put(c, OFF_HEAD, _get(c, OFF_HEAD) + 3)
    _assert_broken(p, c, r"head")


def test_r2_a_tail_beyond_what_was_written_is_refused(rings):
    p, c = rings
    waiting.send(p, 1, b"a" * 10)
    _put(p, OFF_TAIL, 4096 * 3)  # the consumer "released" bytes never written
    for _ in range(600):  # the producer loads tail once it runs short of space
        try:
            p.try_send(2, b"b" * 100)
        except RingCorruptError as e:
            assert "tail" in str(e)
            break
    else:
        pytest.fail("the producer accepted a tail beyond its write position")
    with pytest.raises(ProtocolError, match="tail"):
        p.try_send(2, b"b")
    with pytest.raises(PeerDeadError):  # the producer closed: what it published is read first
        for _ in range(100):
            c.try_recv()


# ---------------------------------------------------------------- R3: misaligned positions


@pytest.mark.parametrize("field", ["head", "tail"])
@pytest.mark.parametrize("attaching", [RingProducer, RingConsumer], ids=["producer", "consumer"])
def test_r3_misaligned_positions_are_refused_at_attach(field, attaching):
    owner = (RingConsumer if attaching is RingProducer else RingProducer).create(4096)
    try:
        _put(owner, OFF_HEAD, 4093 if field == "head" else 4096)
        _put(owner, OFF_TAIL, 4093 if field == "tail" else 0)
        with pytest.raises(RingCorruptError, match=field):
            attaching.attach(owner.spec)
    finally:
        owner.close()


@pytest.mark.parametrize("head,tail", [(8192, 0), (0, 64)])
def test_r3_positions_more_than_a_ring_apart_are_refused_at_attach(head, tail):
    owner = RingProducer.create(4096)
    try:
        _put(owner, OFF_HEAD, head)
        _put(owner, OFF_TAIL, tail)
        with pytest.raises(RingCorruptError, match="head"):
            RingConsumer.attach(owner.spec)
    finally:
        owner.close()


# ---------------------------------------------------------------- R5: fragment totals


def test_r5_a_fragment_total_over_the_message_limit_is_refused(rings):
    p, c = rings
    _record(c, 0, 16, 1, F_MORE, struct.pack("<Q", 1 << 62) + b"12345678")
    _put(c, OFF_HEAD, 24)
    _assert_broken(p, c, rf"total .*{1 << 62}.* {0xFFFF_FFFF}")


def test_r5_the_consumer_takes_exactly_what_the_producer_may_send(rings):
    p, c = rings
    assert _ring.MAX_MESSAGE == 0xFFFF_FFFF
    _record(c, 0, 16, 1, F_MORE, struct.pack("<Q", 0xFFFF_FFFF + 1) + b"12345678")
    _put(c, OFF_HEAD, 24)
    _assert_broken(p, c, "total")


def test_r5_send_part_refuses_what_the_consumer_would_refuse(rings):
    p, c = rings
    try:
        big = mmap.mmap(-1, 0xFFFF_FFFF + 1)  # untouched: no memory is used
    except OSError:  # pragma: no cover - a host without overcommit
        pytest.skip("cannot map 4 GiB of address space")
    try:
        with pytest.raises(OverflowError, match="4294967295"):
            p._c.send_part(1, big, 0, 512)
        assert c.try_recv() == []  # nothing was written
    finally:
        big.close()


# ---------------------------------------------------------------- R6: the capacity


@pytest.mark.parametrize("cap", [(1 << 64) - 8, (1 << 64) - 4096 + 8, 1 << 63])
def test_r6_a_capacity_that_overflows_the_size_check_is_refused(cap):
    owner = RingProducer.create(4096)
    try:
        _put(owner, OFF_CAPACITY, cap)
        for kind in (_ring.Consumer, _ring.Producer):
            with pytest.raises(ValueError, match="capacity"):
                kind(owner._res.seg.buf)
    finally:
        _put(owner, OFF_CAPACITY, 4096)
        owner.close()


def test_r6_attach_checks_the_capacity_the_c_end_uses(monkeypatch):
    """The capacity is read once, by the C end; the spec is checked against that value
    (a peer could change the header between a read in Python and one in C)."""
    owner = RingProducer.create(8192)
    try:
        spec = owner.spec
        _put(owner, OFF_CAPACITY, 4096)  # the header now says something else
        real = _ring.stats

        def stale(buf):  # as if the header changed right after Python looked
            counters, flags = real(buf)
            return {**counters, "capacity": spec.capacity}, flags

        monkeypatch.setattr(_ring, "stats", stale)
        with pytest.raises(ValueError, match="capacity"):
            RingConsumer.attach(spec)
    finally:
        _put(owner, OFF_CAPACITY, 8192)
        owner.close()


# ---------------------------------------------------------------- F1: forked children


def _in_child(fn) -> str:
    """Run ``fn()`` in a forked child; its returned text (or the error) comes back."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            os.close(r)
            try:
                out = fn()
            except BaseException as e:
                out = f"raised {type(e).__name__}: {e}"
            os.write(w, out.encode())
        finally:
            os._exit(0)
    os.close(w)
    try:
        chunks = []
        while True:
            b = os.read(r, 65536)
            if not b:
                break
            chunks.append(b)
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    return b"".join(chunks).decode()


def test_f1_a_forked_child_cannot_use_its_parents_ring(rings):
    p, c = rings
    waiting.send(p, 1, b"before")

    def child() -> str:
        calls = {
            "C try_send": lambda: p._c.try_send(2, b"child"),
            "C append": lambda: p._c.append(2, b"child"),
            "C take": lambda: c._c.take(),
            "C recv_views": lambda: c._c.recv_views(lambda t, v: None),
            "C poll": lambda: c._c.poll(),
            "C close": lambda: c._c.close(),
            "try_send": lambda: p.try_send(2, b"child"),
            "waiting.send": lambda: waiting.send(p, 2, b"child", timeout=0),
            "send_nowait": lambda: p.send_nowait(2, b"child"),
            "send_batch_nowait": lambda: p.send_batch_nowait([(2, b"child")]),
            "try_recv": lambda: c.try_recv(),
            "recv_nowait": lambda: c.recv_nowait(),
            "waiting.recv": lambda: waiting.recv(c, timeout=0),
            "recv_into": lambda: c.recv_into(lambda t, v: None),
            "statistics": lambda: c.statistics(),  # the parent's counters, not the child's
        }
        out = []
        for name, call in calls.items():
            try:
                call()
                out.append(f"{name}: went ahead")
            except ForkedError as e:
                out.append(f"{name}: ForkedError {e}")
            except Exception as e:
                out.append(f"{name}: {type(e).__name__} {e}")
        return "\n".join(out)

    lines = _in_child(child).splitlines()
    assert len(lines) == 15 and all(": ForkedError" in ln for ln in lines), lines
    assert "fork" in lines[0]
    # the parent's ring, its positions and its peer are untouched
    assert not p.peer_closed and not c.peer_closed
    assert c.try_recv() == [(1, b"before")]
    waiting.send(p, 3, b"after")
    assert waiting.recv(c, timeout=1) == [(3, b"after")]


def test_f1_a_forked_child_pokes_and_drains_without_waiting_for_a_lock_its_parent_held():
    """poke and drain_wake_fd take the end's lock: in a child forked while another thread
    of the parent held it (its holder does not exist there), they must not wait for it
    (poke is a no-op on a closed end, drain_wake_fd raises ForkedError, as before they
    took the lock)."""
    rx = RingConsumer.create(1024, consumer_wake_fd=True)
    tx = RingProducer.attach(rx.spec)
    held, done = threading.Event(), threading.Event()

    def hold() -> None:
        with rx._lock, tx._lock:
            held.set()
            done.wait(10.0)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(5.0)

        def child() -> str:
            signal.alarm(5)  # a hang is interrupted (SIGALRM) and reported instead of hanging the test
            out = []
            tx.poke()
            out.append("poke: returned")
            try:
                rx.drain_wake_fd()
                out.append("drain_wake_fd: returned")
            except ForkedError:
                out.append("drain_wake_fd: ForkedError")
            return "\n".join(out)

        assert _in_child(child).splitlines() == ["poke: returned", "drain_wake_fd: ForkedError"]
    finally:
        done.set()
        holder.join(5.0)
        tx.close()
        rx.close()

@pytest.mark.parametrize("kind", ["sync", "async"])
def test_f1_a_forked_child_cannot_use_its_parents_client(kind):
    """A child's add_request used to reach the parent's engine through the C fast path;
    the parent then read the child's output and its own next request, written from a
    stale position, never reached the engine."""
    r = _run(
        f"""
        import asyncio, os
        from shmclient.config import EngineConfig
        from shmclient.errors import ForkedError
        from shmclient import EngineCoreRequest, SamplingParams, make_client

        ASYNC = {kind == "async"!r}

        def req(rid):
            return EngineCoreRequest(request_id=rid, prompt_token_ids=[1, 2, 3],
                                     sampling_params=SamplingParams(max_tokens=2, temperature=0.0))

        client = make_client(True, ASYNC, EngineConfig(model="mock"))
        if ASYNC:
            calls = [("add_request", lambda: client.add_request_async(req("child"))),
                     ("get_output", lambda: client.get_output_async(timeout=0.5)),
                     ("abort_requests", lambda: client.abort_requests_async(["x"])),
                     ("call_utility", lambda: client.call_utility_async("is_sleeping"))]
        else:
            calls = [("add_request", lambda: client.add_request(req("child"))),
                     ("get_output", lambda: client.get_output(timeout=0.5)),
                     ("abort_requests", lambda: client.abort_requests(["x"])),
                     ("call_utility", lambda: client.call_utility("is_sleeping"))]

        async def call_all():
            out = []
            for name, call in calls:
                try:
                    r = call()
                    if ASYNC:
                        await r
                    out.append(name + " went ahead")
                except ForkedError:
                    out.append(name + " ForkedError")
                except BaseException as e:
                    out.append(name + " " + type(e).__name__)
            return out

        rd, wr = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                out = asyncio.run(call_all())
                client.shutdown()  # does nothing here: the engine is the parent's
                os.write(wr, ",".join(out).encode())
            finally:
                os._exit(0)
        os.close(wr)
        print(os.read(rd, 4096).decode(), flush=True)
        os.waitpid(pid, 0)

        async def serve():
            seen = set()
            if ASYNC:
                await client.add_request_async(req("parent"))
            else:
                client.add_request(req("parent"))
            done = False
            while not done:
                outs = await client.get_output_async(timeout=10) if ASYNC else client.get_output(timeout=10)
                for o in outs.outputs:
                    seen.add(o.request_id)
                    done = o.request_id == "parent" and o.finished
            return seen

        seen = asyncio.run(serve())
        print("served", sorted(seen), flush=True)
        client.shutdown()
        """,
        timeout=90,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert lines[0].split(",") == [f"{n} ForkedError" for n in
                                   ("add_request", "get_output", "abort_requests", "call_utility")], r.stdout
    assert lines[1] == "served ['parent']", r.stdout


# ---------------------------------------------------------------- F2: threads


def test_f2_another_thread_waits_for_a_handler_instead_of_being_refused(rings):
    p, c = rings
    waiting.send(p, 1, b"first")
    inside, go = threading.Event(), threading.Event()
    handled, other, errors = [], [], []

    def handler(t, view):
        handled.append((t, bytes(view)))
        inside.set()
        go.wait(10)

    def reader() -> None:
        try:
            c.recv_into(handler)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    a = threading.Thread(target=reader)
    a.start()
    try:
        assert inside.wait(10)
        waiting.send(p, 2, b"second")
        # another thread's lock-free call declines to the slow path (None), no error
        assert c._c.take() is None
        assert c._c.recv_views(lambda t, v: None) is None
        # a zero-copy read never waits for another thread's handler: it would block
        with pytest.raises(WouldBlock, match="another thread"):
            c.recv_into(lambda t, v: None)
        b = threading.Thread(target=lambda: other.extend(waiting.recv(c, timeout=10)))
        b.start()
    finally:
        go.set()
        a.join(10)
    b.join(10)
    assert not errors and not a.is_alive() and not b.is_alive()
    assert handled == [(1, b"first")] and other == [(2, b"second")]


def test_f2_the_same_threads_handler_is_still_refused(rings):
    p, c = rings
    assert p.send_batch_nowait([(1, b"a"), (2, b"b")]) == 2

    def handler(t, view):
        if t == 1:
            c.try_recv()

    with pytest.raises(RuntimeError, match="re-entrant"):
        c.recv_into(handler)
    assert c.try_recv() == [(2, b"b")]


def test_f2_a_handler_is_refused_even_while_another_threads_slow_path_holds_the_end(rings):
    """Declining would send the handler to the slow path, whose lock that other thread
    holds while it waits for the handler's call: a deadlock. Re-entry is refused first."""
    p, c = rings
    waiting.send(p, 1, b"a")
    seen = []

    def handler(t, view):
        c._c.held = True  # as while another thread's try_recv() holds the lock and waits
        try:
            c._c.take()
        except RuntimeError as e:
            seen.append(str(e))
        finally:
            c._c.held = False

    assert c.recv_into(handler) == 1
    assert len(seen) == 1 and "re-entrant" in seen[0]


# ---------------------------------------------------------------- U: ends before __init__

_UNMADE = r"""
import mmap
from shmclient import _ring

not_a_ring = mmap.mmap(-1, 8192)  # zeros: __init__ raises after taking the buffer
calls = {
    _ring.Producer: [("try_send", (1, b"x")), ("append", (1, b"x")), ("publish", ()),
                     ("send_part", (1, b"x" * 64, 0, 16)), ("wait_space", (0.0, 0.0)),
                     ("arm_space", ()), ("pending", ()), ("wake_owed", ()), ("close", ()),
                     ("detach", ()), ("peer_closed", None), ("max_record", None),
                     ("capacity", None), ("held", None), ("quiet", None), ("held", True),
                     ("quiet", True)],
    _ring.Consumer: [("take", ()), ("take", (True,)), ("recv_views", (print,)),
                     ("wait", (0.0, 0.0)), ("poll", ()), ("rearm", ()), ("unpin", ()),
                     ("close", ()), ("detach", ()), ("peer_closed", None),
                     ("capacity", None), ("held", None), ("pinned", None),
                     ("reassembling", None), ("held", True)],
}
for kind, todo in calls.items():
    failed_init = kind.__new__(kind)
    try:
        failed_init.__init__(not_a_ring)
    except ValueError:
        pass
    for how, end in (("new", kind.__new__(kind)), ("failed init", failed_init)):
        for name, args in todo:
            what = f"{how} {kind.__name__}.{name}"
            try:
                if args is None:
                    getattr(end, name)
                elif type(args) is bool:
                    setattr(end, name, args)
                    what += " ="
                else:
                    getattr(end, name)(*args)
                print(what, "went ahead", flush=True)
            except Exception as e:
                print(what, type(e).__name__, e, flush=True)
    del failed_init
not_a_ring.close()  # the failed __init__ kept no export of it
print("mapping closed")
"""


def test_u1_an_end_whose_init_did_not_complete_refuses_every_call():
    """``_ring.Producer`` / ``Consumer`` made with ``__new__`` (or whose ``__init__``
    raised half-way) have no mapping: every method and getter used to read through a
    NULL or half-set end and crash the process."""
    r = _run(_UNMADE, timeout=60)
    assert r.returncode == 0, f"the interpreter died ({r.returncode}) after: {r.stdout[-1000:]}"
    lines = r.stdout.splitlines()
    assert lines[-1] == "mapping closed", r.stdout
    assert len(lines) == 2 * (17 + 15) + 1, r.stdout
    assert all(" ValueError " in ln and "not initialised" in ln for ln in lines[:-1]), r.stdout


def test_u1_init_runs_once_and_a_failed_one_can_be_retried():
    mm = mmap.mmap(-1, 8192)
    _ring.init_header(mm, 4096)
    try:
        c = _ring.Consumer.__new__(_ring.Consumer)
        with pytest.raises(ValueError, match="capacity"):
            c.__init__(memoryview(mm)[:4096 + 64])  # too small for the capacity
        c.__init__(mm)
        assert c.poll() == 0 and c.capacity == 4096
        p = _ring.Producer(mm)
        with pytest.raises(RuntimeError, match="initialised already"):
            p.__init__(mm)  # it would swap the mapping under its calls
        assert p.try_send(1, b"x") is True
        assert c.take() == [(1, b"x")]
        for end in (p, c):
            end.close()
            end.detach()
        del p, c
    finally:
        mm.close()  # no export of it is left


def test_u1_a_spin_gate_made_without_init_is_the_adaptive_one():
    # its methods used to read through a NULL gate
    r = _run(
        """
        from shmclient import _ring
        g = _ring.SpinGate.__new__(_ring.SpinGate)
        g.preempted(1.0)
        g.clean()
        print(g.mode, g.state()["mode"], g.state()["preemptions"])
        """,
        timeout=30,
    )
    assert r.returncode == 0, f"the interpreter died ({r.returncode}): {r.stderr[-1000:]}"
    assert r.stdout.split() == ["adaptive", "adaptive", "1"], r.stdout


# ---------------------------------------------------------------- hostile-peer fuzz (slow)

_FUZZ = r"""
import random, struct, sys
from shmclient import _ring
from shmclient.errors import WouldBlock
from shmclient.ring_consumer import RingConsumer
from shmclient.ring_producer import RingProducer

DATA, HEAD, TAIL, CAP = 4096, 64, 256, 16
FLAGS = [0, 0x02, 0x04, 0x08, 0x0C, 0x06, 0x0A, 0xFF]


def pos_value(rng, head, tail, cap):
    return rng.choice([head, head + 8, head + 3, head - 8, head + cap, head + cap + 8,
                       tail, tail + cap, tail + cap + 8, tail - 8, tail + 5, 0, 8,
                       (1 << 64) - 8, rng.getrandbits(64), rng.getrandbits(12) * 8]) % (1 << 64)


def corrupt(rng, buf, cap):
    head, tail = struct.unpack_from("<Q", buf, HEAD)[0], struct.unpack_from("<Q", buf, TAIL)[0]
    what = rng.randrange(7)
    if what == 0:  # a record header, aligned or not
        off = rng.randrange(cap // 8) * 8 if rng.random() < 0.8 else rng.randrange(cap - 8)
        n = rng.choice([0, 1, 7, 8, 9, 16, cap - 8, cap, cap + 8, 0xFFFFFFFF, rng.getrandbits(32)])
        struct.pack_into("<IBBH", buf, DATA + off, n, rng.getrandbits(8), rng.choice(FLAGS), 0)
    elif what == 1:  # a first fragment with a total
        off = rng.randrange(cap // 8 - 1) * 8
        n = rng.choice([8, 9, 16, 24, cap - 16])
        total = rng.choice([0, n - 9, n - 8, n, 0xFFFFFFFF, 1 << 32, 1 << 62, rng.getrandbits(64),
                            rng.getrandbits(20)]) % (1 << 64)
        struct.pack_into("<IBBHQ", buf, DATA + off, n, 1, rng.choice([0x04, 0x0C, 0x08]), 0, total)
    elif what == 2:  # a PAD anywhere
        off = rng.randrange(cap // 8) * 8
        struct.pack_into("<IBBH", buf, DATA + off, 0, 0, 0x02, 0)
    elif what == 3:
        struct.pack_into("<Q", buf, HEAD, pos_value(rng, head, tail, cap))
    elif what == 4:
        struct.pack_into("<Q", buf, TAIL, pos_value(rng, head, tail, cap))
    elif what == 5:  # random bytes
        off = rng.randrange(cap)
        k = rng.randrange(1, 64)
        buf[DATA + off:DATA + min(off + k, cap)] = rng.randbytes(min(k, cap - off))
    else:  # the capacity (only a new attach reads it)
        struct.pack_into("<Q", buf, CAP, rng.choice([0, 8, cap + 8, cap * 2, (1 << 64) - 8,
                                                     rng.getrandbits(64)]))


def ops(rng, p, c, cap):
    big = rng.randbytes(rng.randrange(cap * 3))
    for _ in range(rng.randrange(1, 8)):
        op = rng.randrange(8)
        try:
            if op == 0:
                c.try_recv()
            elif op == 1:
                c.recv_into(lambda t, v: bytes(v))
            elif op == 2:
                p.try_send(rng.getrandbits(8), rng.randbytes(rng.randrange(cap)))
            elif op == 3:
                p.send_nowait(1, big)
            elif op == 4:
                p._c.send_part(1, big, 0, max(8, (cap // 4 - 16) & -8))
            elif op == 5:
                c.has_data()
                c.wait_readable(0.0005)
            elif op == 6:
                p.wait_writable(0.0005)
            else:
                c._c.take(True)
        except Exception:
            pass


def case(seed):
    rng = random.Random(seed)
    cap = rng.choice([64, 128, 1024, 4096, 8192])
    c = RingConsumer.create(cap)
    p = RingProducer.attach(c.spec)
    c.unlink()
    buf = c._res.seg.buf
    try:
        for _ in range(rng.randrange(6)):  # some honest traffic first
            try:
                p.send_nowait(rng.getrandbits(8), rng.randbytes(rng.randrange(cap * 2)))
            except WouldBlock:
                pass
            if rng.random() < 0.6:
                c.try_recv()
        for _ in range(rng.randrange(1, 5)):
            corrupt(rng, buf, cap)
            ops(rng, p, c, cap)
        for kind in (_ring.Consumer, _ring.Producer):  # attach to what is there now
            try:
                end = kind(buf)
            except Exception:
                continue
            try:
                if kind is _ring.Consumer:
                    end.take(True)
                    end.recv_views(lambda t, v: None, True)
                else:
                    end.try_send(1, b"x" * rng.randrange(cap), True)
                    end.send_part(1, big_payload(rng, cap), 0, 8)
            except Exception:
                pass
            end.close()
            end.detach()
    finally:
        p.close()
        c.close()


def big_payload(rng, cap):
    return rng.randbytes(rng.randrange(16, cap * 3 + 16))


first, count = int(sys.argv[1]), int(sys.argv[2])
for seed in range(first, first + count):
    print(seed, flush=True)
    case(seed)
print("done", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("first", [0, 1000, 2000, 3000])
def test_fuzz_a_hostile_peer_never_hangs_or_crashes_either_end(first):
    """Random header bytes, positions, PADs, totals and capacities written into a live
    ring's mapping between take/recv_views/try_send/send_part/send_nowait calls of both
    ends (and of ends attached to the result): each case ends in a Python exception or
    normal operation. Cases run in a subprocess: a hang is its timeout, a crash its
    signal, and either names the seed."""
    count = 1500
    try:
        r = subprocess.run([sys.executable, "-c", _FUZZ, str(first), str(count)],
                           capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"case {out.split()[-1] if out.split() else first} hung")
    seeds = r.stdout.split()
    assert r.returncode == 0 and seeds[-1:] == ["done"], (
        f"case {seeds[-1] if seeds else first} ended with {r.returncode}: {r.stderr[-2000:]}")
    assert len(seeds) == count + 1


def _memfd_mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if "/memfd:" in line)


@pytest.mark.parametrize("closer", ["the handler", "another thread"])
def test_a_view_kept_past_a_close_in_its_handler_does_not_keep_the_ring_mapped(closer):
    """A receive handler keeps a zero-copy export of its view (numpy.frombuffer) while
    the end is closed during the handler: the record's pin was added after close had
    let go of the pins, a cycle through the C end that the cyclic GC cannot see, and the
    ring stayed mapped for the process's life after the array was dropped."""
    import gc

    import numpy as np

    before = _memfd_mappings()
    c = RingConsumer.create(1 << 20)
    p = RingProducer.attach(c.spec)
    c.unlink()
    p.send_nowait(1, b"x" * 4096)
    kept = []

    def handler(rtype, view):
        kept.append(np.frombuffer(view, np.uint8))
        if closer == "the handler":
            c.close()
        else:
            t = threading.Thread(target=c.close)
            t.start()
            t.join(30)

    with pytest.raises(ClientClosedError):
        c.recv_into(handler)
    assert kept[0][:4].tobytes() == b"xxxx"  # still mapped while the array lives
    kept.clear()
    p.close()
    c.close()
    del p, c, handler
    gc.collect()
    assert _memfd_mappings() == before
