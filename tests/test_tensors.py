"""CPU tensors out of band through the shared-memory arena: correctness, reuse safety,
bounded memory, fallbacks, and a cross-process run over the ring."""

from __future__ import annotations

import collections
import gc
import hashlib
import multiprocessing as mp
import os
import random
import struct
import threading

import numpy as np
import psutil
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shmclient import tensors as tensors_mod
from shmclient.codec import Decoder, Encoder
from shmclient.errors import SerializationError, ShmCapacityError
from shmclient.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, UtilityOutput
from shmclient.shm import Segment
from shmclient.tensors import ALIGN, ShmTensorReceiver, ShmTensorSender, TensorStatistics

from .forked import in_child
from .forked import mapped as _mapped

MiB = 1 << 20


def raw(x) -> bytes:
    """Values' bytes in C order, for bit-exact comparison."""
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(x).tobytes()
    if x.numel() == 0:
        return b""
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(
        x.dtype.itemsize, x.dtype
    )
    return x.view(as_int).contiguous().numpy().tobytes()


def digest(x) -> str:
    return f"{x.dtype}|{tuple(x.shape)}|" + hashlib.blake2b(raw(x), digest_size=16).hexdigest()


def mine() -> set[str]:
    """This process's open memfd segments (fd targets), and its entries in /dev/shm."""
    fds = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("/memfd:"):
            fds.add(f"{fd}:{link}")
    return fds | {n for n in os.listdir("/dev/shm") if f"-{os.getpid()}-" in n}


class Pair:
    """Both ends of one arena in this process, plus codecs over them."""

    def __init__(self, size: int = 4 * MiB, view_from: int = tensors_mod.VIEW_FROM, threshold=256):
        seg = Segment.create(size)
        try:
            peer = Segment.attach(seg.name)
        finally:
            seg.unlink()
        self.sender = ShmTensorSender(seg)
        self.receiver = ShmTensorReceiver(peer, view_from=view_from)
        self.enc = Encoder(self.sender, inline_threshold=threshold)
        self.dec = Decoder(tensors=self.receiver)

    def send(self, obj, type_=None):
        msg = self.enc.encode(obj)
        out = (Decoder(type_, tensors=self.receiver) if type_ else self.dec).decode(msg)
        self.flush()
        return out

    def flush(self) -> None:
        rel = self.receiver.take_releases()
        if rel is not None:
            self.sender.on_release(rel)

    def statistics(self) -> TensorStatistics:
        return self.sender.statistics()

    def close(self) -> None:
        self.receiver.close()
        self.sender.close()


@pytest.fixture
def pair():
    p = Pair()
    yield p
    p.close()


def test_roundtrips_through_the_arena(pair):
    base = torch.randn(64, 48)
    cases = [
        base,
        base.to(torch.bfloat16),
        base[:, ::3],  # non-contiguous
        base.t(),
        torch.randint(0, 2, (300,)).bool(),
        torch.randn(40, 30, dtype=torch.complex64),
        torch.randint(-128, 127, (1000,), dtype=torch.int8),
        torch.randn(1000).to(torch.float16),
        torch.zeros(0, 1000),
        torch.tensor(1.25),
        torch.randint(0, 255, (5000,), dtype=torch.uint8).view(torch.float8_e4m3fn),
        torch.randint(0, 255, (600,), dtype=torch.uint8).view(torch.uint1)[::2],
    ]
    for t in cases:
        out = pair.send(t)
        assert out.dtype == t.dtype and out.shape == t.shape and raw(out) == raw(t), t.dtype
    a = np.asfortranarray(np.random.default_rng(1).random((70, 50)))
    out = pair.send(a)
    assert out.flags.f_contiguous and raw(out) == raw(a)
    out = pair.send(a.astype(">i4")[::2])
    assert out.dtype.str == ">i4" and raw(out) == raw(a.astype(">i4")[::2])
    del out
    gc.collect()
    pair.flush()
    assert pair.statistics().used_bytes == 0


def test_message_structs_with_out_of_band_tensors(pair):
    emb = torch.randn(128, 256, dtype=torch.bfloat16)
    got = pair.send(EngineCoreRequest(request_id="r", prompt_embeds=emb), EngineCoreRequest)
    assert raw(got.prompt_embeds) == raw(emb)
    outs = EngineCoreOutputs(
        outputs=[EngineCoreOutput(request_id=str(i), pooling_output=torch.randn(1024)) for i in range(3)],
        utility_output=UtilityOutput(call_id=1, result=[(torch.randn(2000), np.arange(4000))]),
    )
    got = pair.send(outs, EngineCoreOutputs)
    for a, b in zip(got.outputs, outs.outputs):
        assert raw(a.pooling_output) == raw(b.pooling_output)
    assert raw(got.utility_output.result[0][1]) == raw(outs.utility_output.result[0][1])


def test_inline_or_out_of_band_by_size(pair):
    pair.send(torch.zeros(63))  # 252 bytes: inline
    assert pair.statistics().sent_arena == 0
    pair.send(torch.zeros(64))  # 256 bytes: out of band
    assert pair.statistics().sent_arena == 1
    msg = pair.enc.encode(torch.zeros(1 << 16))
    assert len(msg) < 100  # only the handle travels
    pair.dec.decode(msg)


def test_small_blocks_are_copied_out_and_released_at_once():
    p = Pair(view_from=64 * 1024)
    try:
        sent = torch.randn(1000)
        small = p.dec.decode(p.enc.encode(sent))  # 4 KB: copy
        assert p.receiver.in_use() == 0
        p.flush()
        assert p.statistics().used_bytes == 0
        big = p.dec.decode(p.enc.encode(torch.randn(1 << 15)))  # 128 KiB: view, in the freed block
        assert p.receiver.in_use() == 1
        p.flush()
        assert p.statistics().used_bytes == 128 * 1024
        del big
        p.flush()
        assert p.statistics().used_bytes == 0
        # its block released and written over since: a copy keeps what was sent (the
        # check compared the received tensor with itself, and passed without the copy)
        assert torch.equal(small, sent)
    finally:
        p.close()


def test_block_not_reused_while_a_view_is_alive():
    p = Pair(size=1 * MiB, view_from=0)
    try:
        first = torch.arange(1 << 16, dtype=torch.int32)  # 256 KiB
        held = p.send(first)
        part = held[1000:1010]
        as_np = held.numpy()[::7]
        del held  # slices of it still read the block
        expect_part, expect_np = part.clone(), as_np.copy()
        for i in range(200):
            junk = torch.full((1 << 15,), i, dtype=torch.int32)  # 128 KiB each
            out = p.send(junk)
            assert torch.equal(out, junk)
            del out
            p.flush()
            assert torch.equal(part, expect_part) and np.array_equal(as_np, expect_np)
        assert p.statistics().used_bytes == 256 * 1024  # only the held block
        del part
        p.flush()
        assert p.statistics().used_bytes == 256 * 1024  # ``as_np`` still holds it
        del as_np
        p.flush()
        assert p.statistics().used_bytes == 0
    finally:
        p.close()


def test_releases_in_any_order_coalesce_the_arena():
    p = Pair(size=4 * MiB, view_from=0)
    try:
        held = [p.send(torch.randn(random.Random(i).randint(100, 5000))) for i in range(200)]
        used = p.statistics().used_bytes
        assert used > 0 and p.statistics().blocks_in_flight == 200
        random.Random(7).shuffle(held)
        while held:
            del held[-1]
            if len(held) % 17 == 0:
                p.flush()
        p.flush()
        s = p.statistics()
        assert s.used_bytes == 0 and s.blocks_in_flight == 0 and s.free_extents == 1
    finally:
        p.close()


def test_many_transfers_do_not_grow_memory():
    p = Pair(size=8 * MiB, view_from=16 * 1024)
    proc = psutil.Process()
    shm_before = mine()
    try:
        sizes = [64, 1000, 5000, 40_000, 200_000]
        rss0 = None
        keep = []
        for i in range(10_000):
            t = torch.from_numpy(np.full(sizes[i % len(sizes)], i, np.float32))
            out = p.dec.decode(p.enc.encode(t))
            assert out[-1].item() == i
            keep.append(out)
            if len(keep) > 5:  # hold a few, drop the oldest: releases out of send order
                keep.pop(random.Random(i).randrange(len(keep)))
            if i % 3 == 0:
                p.flush()
            if i == 1000:
                rss0 = proc.memory_info().rss
        keep.clear()
        del out, t
        p.flush()
        s = p.statistics()
        assert s.used_bytes == 0 and s.blocks_in_flight == 0 and s.free_extents == 1
        assert s.peak_used_bytes < 8 * MiB and s.sent_one_off == 0
        assert proc.memory_info().rss - rss0 < 16 * MiB
        assert mine() == shm_before
    finally:
        p.close()


def test_full_arena_and_oversize_fall_back_to_one_off_segments():
    p = Pair(size=1 * MiB, view_from=0)
    try:
        held = [p.send(torch.randn(1 << 16)) for _ in range(4)]  # 4 x 256 KiB: full
        s = p.statistics()
        assert s.used_bytes == 1 * MiB and s.sent_one_off == 0
        extra = torch.randn(1 << 16)
        out = p.send(extra)
        assert torch.equal(out, extra) and p.statistics().sent_one_off == 1
        big = torch.randn(3 * MiB // 4)  # bigger than the whole arena
        out2 = p.send(big)
        assert torch.equal(out2, big) and p.statistics().sent_one_off == 2
        assert p.statistics().one_offs_in_flight == 0  # the receiver released them on attach
        for _ in range(50):  # one-offs do not pile up
            p.send(big)
        assert p.statistics().one_offs_in_flight == 0
        del held
        p.flush()
        assert p.send(extra).sum() == extra.sum() and p.statistics().sent_one_off == 52
    finally:
        p.close()


def test_undelivered_one_off_is_released_by_sender_close():
    p = Pair(size=64 * 1024)
    before = mine()
    p.enc.encode(torch.randn(1 << 16))  # never decoded
    created = mine() - before
    assert len(created) == 1 and p.statistics().one_offs_in_flight == 1
    p.close()
    assert not mine() & created


def test_no_room_in_dev_shm_sends_inline(monkeypatch):
    p = Pair(size=64 * 1024)

    def full(*a, **k):
        raise ShmCapacityError("no space")

    monkeypatch.setattr(Segment, "create", full)
    try:
        t = torch.randn(1 << 16)
        msg = p.enc.encode(t)
        assert len(msg) > t.nbytes and p.statistics().sent_inline_fallback == 1
        assert torch.equal(p.dec.decode(msg), t)
    finally:
        p.close()


def test_failed_encode_frees_its_blocks(pair):
    with pytest.raises(SerializationError, match="builtins.object"):
        pair.enc.encode([torch.randn(10_000), object()])
    assert pair.statistics().used_bytes == 0


def test_views_released_from_other_threads_and_cycles():
    p = Pair(view_from=0)
    try:
        views = [p.send(torch.randn(1000)) for _ in range(64)]
        cyc = []
        for v in views[:16]:  # a view kept only by a reference cycle
            box = [v]
            box.append(box)
            cyc.append(box)
        del box, v
        rest = views[16:]
        del views
        cyc.clear()  # the cycles now only die in gc
        workers = [threading.Thread(target=lambda chunk: chunk.clear(), args=(rest[i::4],)) for i in range(4)]
        del rest
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        taker = threading.Thread(target=lambda: gc.collect())
        taker.start()
        taker.join()
        gc.collect()
        p.flush()
        assert p.statistics().used_bytes == 0 and p.receiver.in_use() == 0
    finally:
        p.close()


def test_received_views_outlive_receiver_close():
    p = Pair(view_from=0)
    t = torch.randn(10_000)
    out = p.send(t)
    p.close()
    assert torch.equal(out, t)  # still mapped
    del out


def test_malformed_handles_rejected(pair):
    with pytest.raises(SerializationError, match="outside the arena"):
        pair.receiver.get([0, 1, 4 * MiB - 100], 1000)
    with pytest.raises(SerializationError, match="kind"):
        pair.receiver.get([9, 1, 0], 10)
    with pytest.raises(SerializationError, match="gone"):
        pair.receiver.get([1, 5, "/shmc-t-0-doesnotexist"], 10)


def test_release_of_unknown_ids_is_ignored(pair):
    pair.sender.on_release(struct.pack("<3Q", 123, 456, 789))
    pair.send(torch.randn(1000))
    assert pair.statistics().used_bytes == 0


def test_a_release_interrupted_by_a_signal_frees_every_block_it_names(pair, monkeypatch):
    """Ctrl-C inside the sender's handling of a release record (the ring counts the
    record as read: its ids never come again) left every id after that point in flight,
    and the block being freed off the free list: the arena shrank for good."""
    src = np.zeros(256, np.uint8)
    ids = [pair.sender.put(src, 256)[1] for _ in range(40)]
    assert pair.statistics().blocks_in_flight == 40
    release = pair.sender._release
    calls = []

    def interrupted_release(offset, size):
        calls.append(offset)
        if len(calls) == 10:  # (taken off the block list, not yet on the free list)
            raise KeyboardInterrupt
        release(offset, size)

    monkeypatch.setattr(pair.sender, "_release", interrupted_release)
    with pytest.raises(KeyboardInterrupt):
        pair.sender.on_release(struct.pack(f"<{len(ids)}Q", *ids))
    monkeypatch.undo()
    st_ = pair.statistics()
    assert (st_.blocks_in_flight, st_.used_bytes, st_.free_extents) == (0, 0, 1)
    big = pair.sender.put(np.zeros(2 * MiB, np.uint8), 2 * MiB)  # the whole arena is there
    assert big is not None and big[0] == 0
    pair.sender.cancel(big)


class _InterruptedDeque(collections.deque):
    """A release queue whose third ``popleft`` raises KeyboardInterrupt (a signal)."""

    pops = 0

    def popleft(self):
        type(self).pops += 1
        if type(self).pops == 3:
            raise KeyboardInterrupt
        return super().popleft()


def test_taking_releases_interrupted_by_a_signal_loses_no_id(pair):
    """Ids taken off the receiver's queue when Ctrl-C landed were neither returned nor
    put back: their blocks stayed in flight at the sender for good. They stay queued now
    (an id may go twice, which the sender ignores)."""
    ids = list(range(1, 9))
    q = _InterruptedDeque(ids)
    pair.receiver._released = pair.receiver.pending = q
    with pytest.raises(KeyboardInterrupt):
        pair.receiver.take_releases()
    again = pair.receiver.take_releases()
    assert set(struct.unpack(f"<{len(again) // 8}Q", again)) == set(ids)
    assert pair.receiver.take_releases() is None


def test_blocks_are_aligned(pair):
    hs = [pair.sender.put(torch.zeros(n, dtype=torch.uint8), n) for n in (1, 300, 257, 4096)]
    assert all(h[2] % ALIGN == 0 for h in hs)
    for h in hs:
        pair.sender.cancel(h)
    assert pair.statistics().used_bytes == 0


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(0, 40), min_size=0, max_size=3),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.complex128, torch.uint8]),
    view_from=st.sampled_from([0, 1 << 40]),
)
def test_hypothesis_arena_roundtrip(shape, dtype, view_from):
    p = Pair(size=1 * MiB, view_from=view_from, threshold=0)
    try:
        t = torch.randint(0, 2, shape).to(dtype) if dtype is torch.bool else torch.randint(0, 100, shape).to(dtype)
        out = p.send(t)
        assert out.dtype == t.dtype and out.shape == t.shape and raw(out) == raw(t)
        del out
        p.flush()
        assert p.statistics().used_bytes == 0
    finally:
        p.close()


# -- across processes -------------------------------------------------------------------

MSG, REL, DIGEST, READY, STOP, BYE = 1, 2, 3, 4, 5, 6


@pytest.fixture(scope="module")
def _resource_tracker():
    """Spawning starts multiprocessing's resource tracker, which lives as long as this
    process; start it first so the per-test leak check does not count it."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()


def _child(data_spec, back_spec, arena_name: str) -> None:
    from shmclient import waiting
    from shmclient.ring_consumer import RingConsumer
    from shmclient.ring_producer import RingProducer

    rx = RingConsumer.attach(data_spec)
    tx = RingProducer.attach(back_spec)
    receiver = ShmTensorReceiver(Segment.attach(arena_name), view_from=32 * 1024)
    dec = Decoder(tensors=receiver)
    held: list = []
    waiting.send(tx, READY, b"", timeout=10)
    try:
        while True:
            for rtype, payload in waiting.recv(rx, timeout=30):
                if rtype == STOP:
                    held.clear()
                    rel = receiver.take_releases()
                    if rel:
                        waiting.send(tx, REL, rel, timeout=10)
                    waiting.send(tx, BYE, b"", timeout=10)
                    return
                seq, x = dec.decode(payload)
                waiting.send(tx, DIGEST, f"{seq}:{digest(x)}".encode(), timeout=10)
                held.append(x)
                if len(held) > 8:
                    held.pop(seq * 7 % len(held))  # drop an arbitrary one
                del x
                rel = receiver.take_releases()
                if rel:
                    waiting.send(tx, REL, rel, timeout=10)
    finally:
        receiver.close()
        rx.close()
        tx.close()


def test_across_processes_over_the_ring(_resource_tracker):
    from shmclient import waiting
    from shmclient.ring_consumer import RingConsumer
    from shmclient.ring_producer import RingProducer

    data = RingProducer.create(1 * MiB)
    back = RingConsumer.create(1 * MiB)
    arena = Segment.create(4 * MiB)
    sender = ShmTensorSender(arena)
    enc = Encoder(sender)
    ctx = mp.get_context("spawn")
    child = ctx.Process(target=_child, args=(data.spec, back.spec, arena.name))
    child.start()
    expected: dict[int, str] = {}
    got: dict[int, str] = {}

    def pump(records) -> bool:
        done = False
        for rtype, payload in records:
            if rtype == REL:
                sender.on_release(payload)
            elif rtype == DIGEST:
                seq, d = bytes(payload).decode().split(":", 1)
                got[int(seq)] = d
            elif rtype == BYE:
                done = True
        return done

    try:
        assert waiting.recv(back, timeout=60)[0][0] == READY
        data.unlink()
        back.unlink()
        arena.unlink()
        rng = np.random.default_rng(3)
        dtypes = [torch.float32, torch.bfloat16, torch.uint8, torch.complex64, torch.bool]
        for seq in range(600):
            n = int(rng.choice([10, 3000, 20_000, 100_000] * 10 + [1_500_000]))
            dt = dtypes[seq % len(dtypes)]
            t = torch.from_numpy(rng.integers(0, 2, n, dtype=np.uint8)).to(dt)
            if seq % 4 == 0:
                t = t[::2]
            expected[seq] = digest(t)
            waiting.send(data, MSG, enc.encode([seq, t]), timeout=30)
            pump(back.try_recv())
        waiting.send(data, STOP, b"", timeout=30)
        while not pump(waiting.recv(back, timeout=30)):
            pass
        child.join(30)
        assert child.exitcode == 0
        assert got == expected
        s = sender.statistics()
        assert s.used_bytes == 0 and s.blocks_in_flight == 0 and s.one_offs_in_flight == 0
        assert s.sent_arena > 300 and s.sent_one_off > 0
    finally:
        if child.is_alive():
            child.kill()
            child.join(5)
        sender.close()
        data.close()
        back.close()


def test_large_copies_split_over_threads_are_exact():
    n = tensors_mod.PARALLEL_FROM * 2 + 77  # odd size, several chunks
    p = Pair(size=24 * MiB, view_from=0)
    try:
        src = torch.from_numpy(np.random.default_rng(5).integers(0, 255, n, dtype=np.uint8))
        out = p.send(src)
        assert torch.equal(out, src) and p.statistics().sent_arena == 1
        nc = src[: n - 77].view(torch.int32).view(-1, 1024)[:, ::2]  # strided: not split
        assert torch.equal(p.send(nc), nc)
    finally:
        p.close()


def test_a_signal_during_a_split_copy_leaves_no_copier_writing_into_the_freed_block(monkeypatch):
    """Ctrl-C while a large tensor is copied over threads: put() frees its block, and the
    next tensor gets it. The interrupted join left a copier thread still writing the
    first tensor's bytes into that block (CPython marks a thread whose join was
    interrupted as stopped): the second tensor arrived corrupted, without an error. The
    copiers are now waited for before the block is freed."""
    import signal

    from shmclient import tensors_sender

    main = threading.get_ident()
    later = threading.Event()  # set once the second tensor is in the block
    stale_done = threading.Event()

    class HeldCopier:  # numpy, but the first tensor's copier thread interrupts the caller
        def __getattr__(self, name):
            return getattr(np, name)

        @staticmethod
        def copyto(dst, src, **kw):
            if threading.get_ident() == main or src[:1].tolist() != [0xAA]:
                return np.copyto(dst, src, **kw)
            signal.pthread_kill(main, signal.SIGINT)
            later.wait(1.0)  # (with the fix the caller waits for this copy instead)
            try:
                return np.copyto(dst, src, **kw)
            finally:
                stale_done.set()

    monkeypatch.setattr(tensors_sender, "_WORKERS", 2)
    monkeypatch.setattr(tensors_sender, "np", HeldCopier())
    n = 2 * tensors_sender.PARALLEL_FROM
    p = Pair(size=3 * n, view_from=1 << 40)
    try:
        with pytest.raises(KeyboardInterrupt):
            p.sender.put(np.full(n, 0xAA, np.uint8), n)
        assert p.sender.statistics().blocks_in_flight == 0
        handle = p.sender.put(np.full(n, 0x55, np.uint8), n)
        later.set()
        assert stale_done.wait(10)
        got = p.receiver.get(handle, n)
        assert int((got != 0x55).sum()) == 0
    finally:
        later.set()
        p.close()


def _three_tensors_sent():
    """A channel pair (frontend, engine) and one message of three 256-byte tensors in
    the frontend's arena sent on it, not yet read."""
    from shmclient.channel import REQ_UTILITY, ShmChannel
    from shmclient.messages import UtilityRequest

    front, spec = ShmChannel.create(ring_capacity=1 << 16, arena_bytes=1 << 20, spin_us=0, wake_fd=False)
    engine = ShmChannel.attach(spec)
    front.peer_attached()
    tensors = [torch.full((64,), i, dtype=torch.float32) for i in range(3)]
    front.send_nowait(REQ_UTILITY, front.encode(UtilityRequest(0, 1, "echo", tensors)))
    return front, engine


def test_releases_survive_a_signal_in_their_send():
    """The engine's pending tensor releases were taken out of its queue, then lost when
    their send raised (Ctrl-C landing in it): the frontend's arena blocks stayed taken
    for good. They are kept for the next flush."""
    front, engine = _three_tensors_sent()
    try:
        [(_, request)] = engine.try_recv()
        del request  # the engine is done with them: three releases pending
        assert front.statistics().tensors.blocks_in_flight == 3
        real = engine.tx.try_send

        def interrupted(rtype, payload):
            raise KeyboardInterrupt

        engine.tx.try_send = interrupted
        with pytest.raises(KeyboardInterrupt):
            engine.flush_releases()
        engine.tx.try_send = real
        engine.flush_releases()
        front.try_recv()
        assert front.statistics().tensors.blocks_in_flight == 0
    finally:
        engine.close()
        front.close()


def test_a_release_the_closed_peer_cannot_take_hides_nothing_it_wrote_before_closing():
    """Releases were pending for a peer that then wrote its last message and closed (an
    engine's exit): the flush before the read raised PeerDeadError, and that message
    was never read (an engine's last outputs and utility replies lost)."""
    from shmclient import waiting
    from shmclient.channel import REQ_UTILITY
    from shmclient.errors import PeerDeadError
    from shmclient.messages import UtilityRequest

    front, engine = _three_tensors_sent()
    try:
        [(_, request)] = engine.try_recv()
        del request  # three releases pending, for the frontend's arena
        front.send_nowait(REQ_UTILITY, front.encode(UtilityRequest(0, 2, "echo", ("last",))))
        front.close()
        [(_, last)] = waiting.recv(engine, timeout=5.0)
        assert (last.call_id, last.args) == (2, ("last",))
        with pytest.raises(PeerDeadError):
            engine.recv_nowait()
        engine.flush_releases()  # dropped: nobody frees those blocks any more
    finally:
        engine.close()
        front.close()


def test_no_arena_sends_tensors_as_one_off_segments():
    """``tensor_arena_bytes=0`` ("no arena") makes a channel whose tensors all travel as
    one-off segments (creating it used to fail: a segment of 0 bytes)."""
    from shmclient.channel import REQ_UTILITY, ShmChannel
    from shmclient.messages import UtilityRequest

    front, spec = ShmChannel.create(ring_capacity=1 * MiB, arena_bytes=0, spin_us=0, wake_fd=False)
    engine = ShmChannel.attach(spec)
    try:
        t = torch.arange(100_000, dtype=torch.float32)
        front.send_nowait(REQ_UTILITY, front.encode(UtilityRequest(0, 1, "echo", [t])))
        [(rtype, got)] = engine.recv_nowait()
        assert rtype == REQ_UTILITY and torch.equal(got.args[0], t)
        s = front.statistics().tensors
        assert s.sent_one_off == 1 and s.sent_arena == 0
    finally:
        engine.close()
        front.close()


def test_an_encode_that_fails_in_one_thread_frees_only_its_own_blocks(pair):
    """Clients encode from any number of threads with one encoder. The handles an encode
    placed were kept on the encoder itself, so an encode that failed in one thread freed
    the blocks another thread's encode had just placed: that message then went out naming
    free blocks, which the next tensor overwrote."""
    enc = Encoder(tensors=pair.sender)
    placed_a = threading.Event()
    b_done = threading.Event()
    put = pair.sender.put

    puts_a = []

    def put_then_wait(src, nbytes, placed):  # thread A, its second tensor: let B fail meanwhile
        if threading.current_thread().name == "encode-a":
            puts_a.append(nbytes)
            if len(puts_a) == 2:
                placed_a.set()
                assert b_done.wait(10)
        return put(src, nbytes, placed)

    pair.sender.put = put_then_wait
    out: dict = {}

    def encode_a() -> None:  # two tensors of 64 KiB: in the arena
        out["a"] = enc.encode([torch.full((128, 128), 7.0), torch.full((128, 128), 8.0)])

    a = threading.Thread(target=encode_a, name="encode-a")
    a.start()
    try:
        assert placed_a.wait(10)
        with pytest.raises(SerializationError, match="cannot serialize"):
            enc.encode([torch.ones(16384), object()])  # places a block, then fails
    finally:
        b_done.set()
        a.join(10)
    assert "a" in out
    assert pair.statistics().blocks_in_flight == 2  # A's two blocks, B's freed
    del pair.sender.put
    got = Decoder(tensors=pair.receiver).decode(out["a"])
    assert torch.equal(got[0], torch.full((128, 128), 7.0))
    assert torch.equal(got[1], torch.full((128, 128), 8.0))


@pytest.mark.parametrize("where", ["before", "after"])
def test_ctrl_c_while_a_message_decodes_gives_back_the_blocks_it_names(where):
    """Ctrl-C in the decode of a message naming three arena tensors (here in opening the
    second, before or after the receiver took it): the ring counts the record as read,
    and the blocks not opened stayed taken in the sender's arena for good (only an
    Exception ran the salvage). Every block comes back now."""
    front, engine = _three_tensors_sent()
    try:
        assert front.statistics().tensors.blocks_in_flight == 3
        receiver, calls = engine._tensor_rx, []
        real_get = receiver.get

        def get(handle, nbytes):
            calls.append(handle)
            if len(calls) == 2:
                if where == "after":
                    real_get(handle, nbytes)  # (taken, then dropped with the frame)
                raise KeyboardInterrupt
            return real_get(handle, nbytes)

        receiver.get = get
        with pytest.raises(KeyboardInterrupt):
            engine.try_recv()
        del receiver.get
        gc.collect()
        engine.flush_releases()
        front.try_recv()
        assert front.statistics().tensors.blocks_in_flight == 0
    finally:
        engine.close()
        front.close()


class _Interrupted(list):
    """The encoder's list of placed handles, with Ctrl-C landing as a handle is listed."""

    def append(self, item) -> None:
        super().append(item)
        raise KeyboardInterrupt


@pytest.mark.parametrize("where", ["in the allocation", "as the handle is listed", "in the one-off's close"])
def test_ctrl_c_anywhere_in_a_put_leaves_nothing_taken(monkeypatch, where):
    """A signal handler's exception can land in any statement of ``put``: between taking
    arena space and recording it (the space was lost for the channel's life), between
    recording a block and listing its handle (kept until the channel closed), or in the
    one-off segment's close (its descriptor and memory kept until the process exits).
    Whatever was taken comes back, and the arena is whole again."""
    p = Pair(size=1 * MiB)
    before = mine()
    try:
        placed: list = []
        src = torch.randn(1 << 14)
        if where == "in the allocation":
            real = p.sender._alloc

            def alloc(nbytes):
                real(nbytes)  # (the space is taken, not yet recorded)
                raise KeyboardInterrupt

            monkeypatch.setattr(p.sender, "_alloc", alloc)
        elif where == "as the handle is listed":
            placed = _Interrupted()
        else:
            src = torch.randn(1 << 19)  # 2 MiB: over the arena, a one-off segment
            real_close, calls = Segment.close, []

            def close(seg):  # (one signal: the first close)
                real_close(seg)
                calls.append(1)
                if len(calls) == 1:
                    raise KeyboardInterrupt

            monkeypatch.setattr(Segment, "close", close)
        with pytest.raises(KeyboardInterrupt):
            p.sender.put(src, src.nbytes, placed)
        monkeypatch.undo()
        s = p.statistics()
        assert (s.used_bytes, s.blocks_in_flight, s.one_offs_in_flight, s.free_extents) == (0, 0, 0, 1)
        assert mine() == before  # no one-off segment left open
        whole = torch.randn(MiB // 4)  # the whole arena: one block again
        assert torch.equal(p.send(whole), whole) and p.statistics().sent_one_off == 0
    finally:
        p.close()


def test_ctrl_c_as_a_segment_is_created_leaves_no_descriptor(monkeypatch):
    """The interpreter runs a signal handler as a C call returns, before its result is
    kept: a Ctrl-C landing as memfd_create returned left the new descriptor (and, for a
    one-off tensor, its memory) open until the process exited. It is found by its name
    and closed."""
    real = os.memfd_create

    def interrupted(name, flags=0):
        real(name, flags)  # created; its number never reaches the caller
        raise KeyboardInterrupt

    before = mine()
    monkeypatch.setattr(os, "memfd_create", interrupted)
    with pytest.raises(KeyboardInterrupt):
        Segment.create(1 << 16, prefix="shmc-t")
    monkeypatch.undo()
    assert mine() == before


def test_a_forked_child_unmaps_the_arena_but_keeps_a_tensor_it_still_holds(pair):
    """A forked child kept its copies of the parent's arena mappings for its life (both
    ends here: sender and receiver). It lets go of them at the fork, except the one a
    tensor received before the fork still reads, which stays readable and goes with the
    tensor."""
    src = torch.arange(64 * 1024, dtype=torch.float32)  # 256 KiB: a view, not a copy
    held = [pair.send({"t": src})["t"]]  # a zero-copy view into the arena, held only here
    handle = pair.sender._seg.name
    assert _mapped(handle) == 2

    def child() -> str:
        # (numpy: the thread pool of torch may hang in a forked child)
        want = np.arange(64 * 1024, dtype=np.float32)
        seen = [_mapped(handle), int(np.array_equal(held[0].numpy(), want))]
        held.clear()
        gc.collect()
        return " ".join(map(str, [*seen, _mapped(handle)]))

    report = in_child(child)
    assert report == "1 1 0", "child: mappings with the tensor, tensor intact, mappings without it"
    assert _mapped(handle) == 2 and torch.equal(held[0], src)  # the parent's are untouched


def test_a_signal_inside_the_first_reservation_leaves_the_arena_to_the_next_tensor(monkeypatch):
    """A Ctrl-C landing as the first tensor's arena reservation returns: that put fails,
    the next tensor still goes to the arena (it went as a one-off for good, the arena's
    memory reserved but never used)."""
    seg = Segment.create(1 * MiB, reserve=False)
    sender = ShmTensorSender(seg)
    reserve = Segment.reserve
    landed = []

    def interrupted(self):
        reserve(self)
        if not landed:
            landed.append(True)
            raise KeyboardInterrupt

    monkeypatch.setattr(Segment, "reserve", interrupted)
    x = np.arange(1024, dtype=np.uint8)
    try:
        with pytest.raises(KeyboardInterrupt):
            sender.put(x, x.nbytes)
        handles = [sender.put(x, x.nbytes) for _ in range(3)]
        assert [h[0] for h in handles] == [tensors_mod.ARENA] * 3, handles
    finally:
        seg.release_handle()
        sender.close()


def test_a_one_off_put_racing_close_leaves_no_segment(monkeypatch):
    """close() from another thread while a put copies into a one-off segment: the put
    fails (SerializationError) and the segment goes, instead of a handle returned after
    close with its memfd held for the process's life."""
    import shmclient.tensors_sender as sender_mod

    seg = Segment.create(64 * 1024)
    sender = ShmTensorSender(seg)
    seg.release_handle()
    before = mine()
    copy = sender_mod._copy_in

    def copy_then_closed(dst, src):
        copy(dst, src)
        sender.close()  # (what another thread's close does meanwhile)

    monkeypatch.setattr(sender_mod, "_copy_in", copy_then_closed)
    x = np.ones(256 * 1024, dtype=np.uint8)  # over the arena: a one-off
    try:
        with pytest.raises(SerializationError, match="closed"):
            sender.put(x, x.nbytes)
        assert mine() - before == set()
    finally:
        sender.close()


def test_a_discarded_half_sent_message_holds_back_no_release():
    """A request longer than the ring timed out half-way (the engine was not reading)
    and was discarded: the releases of the engine's output tensors the frontend then
    reads go back at once. They waited behind the half-sent message until the frontend
    sent twice more, the engine's arena filled and every later tensor went as a one-off."""
    from shmclient import waiting
    from shmclient.channel import REC_OUTPUTS, REQ_UTILITY, ShmChannel
    from shmclient.errors import PeerNotConsumingError
    from shmclient.messages import UtilityRequest

    front, spec = ShmChannel.create(ring_capacity=1 << 16, arena_bytes=1 << 20, spin_us=0, wake_fd=False)
    engine = ShmChannel.attach(spec)
    front.peer_attached()
    try:
        big = front.encode(UtilityRequest(0, 1, "echo", ("x" * (200 << 10),)))  # over the 64 KiB ring
        with pytest.raises(PeerNotConsumingError):
            waiting.send(front, REQ_UTILITY, big, timeout=0.05)  # the engine reads nothing meanwhile
        front.discard(REQ_UTILITY, big)
        assert not front.tx.partial_pending
        assert engine.try_recv() == []  # what came of it is dropped: no message
        for i in range(4):
            engine.send_nowait(REC_OUTPUTS, engine.encode(EngineCoreOutputs(utility_output=UtilityOutput(
                call_id=i, result=np.full(256 << 10, i, np.uint8)))))
            got = front.try_recv()
            assert [(r, int(o.utility_output.result[0])) for r, o in got] == [(REC_OUTPUTS, i)]
            del got  # the frontend is done with the tensor: its release goes with the next call
            front.flush_releases()
            engine.try_recv()  # takes the release
            stats = engine.statistics().tensors
            assert (stats.blocks_in_flight, stats.sent_one_off) == (0, 0), stats
        assert front.try_recv() == []
    finally:
        front.close()
        engine.close()
