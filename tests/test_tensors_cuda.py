"""CUDA tensors by IPC handle: the decision logic on any machine; the real path (marked
``cuda``, run with ``-m cuda``) only where torch sees a GPU."""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing as mp
import os
import subprocess
import sys
import types

import msgspec
import pytest
import torch

from shmclient import gpus, tensors_cuda
from shmclient.codec import Decoder, Encoder
from shmclient.errors import SerializationError
from shmclient.shm import Segment
from shmclient.tensors import ShmTensorReceiver, ShmTensorSender
from shmclient.tensors_cuda import CudaIpcReceiver, CudaIpcSender, ipc_unavailable_reason

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
H = b"\x03c" + b"\x01" * 64  # a storage handle as torch 2.13 writes one (version, 'c', 64 bytes)
EV = b"\x02" * 64  # an event handle
MiB = 1 << 20
PRODUCER_WARNING = "Producer process has been terminated before all shared CUDA tensors released"


# -- decision logic, no GPU needed --------------------------------------------------------


def test_reasons_for_a_host_copy():
    assert ipc_unavailable_reason(True, "GPU-a", None) is None
    assert ipc_unavailable_reason(True, "GPU-a", {"GPU-a", "GPU-b"}) is None
    assert "disabled" in ipc_unavailable_reason(False, "GPU-a", None)
    assert "no CUDA" in ipc_unavailable_reason(True, "GPU-a", set())
    assert "does not see GPU GPU-a" in ipc_unavailable_reason(True, "GPU-a", {"GPU-b"})
    assert "UUID" in ipc_unavailable_reason(True, None, None)


def _fake_cuda_tensor():
    return types.SimpleNamespace(device=types.SimpleNamespace(index=0))


def test_disabled_ipc_sends_host_copies_and_logs_once(caplog, monkeypatch):
    monkeypatch.setattr(tensors_cuda, "device_uuid", lambda i: "GPU-a")
    sender = CudaIpcSender(enabled=False)
    with caplog.at_level(logging.INFO, logger="shmclient"):
        assert sender.share(_fake_cuda_tensor(), 1) is None
        assert sender.share(_fake_cuda_tensor(), 2) is None
    msgs = [r.getMessage() for r in caplog.records if "host copies" in r.getMessage()]
    assert len(msgs) == 1 and "enable_cuda_ipc=False" in msgs[0]
    assert sender.in_flight() == 0


def test_peer_without_the_gpu_gets_host_copies(caplog, monkeypatch):
    monkeypatch.setattr(tensors_cuda, "device_uuid", lambda i: "GPU-a")
    for peer, words in (([], "no CUDA device"), (["GPU-b"], "does not see GPU GPU-a")):
        caplog.clear()
        sender = CudaIpcSender(enabled=True, peer_gpu_uuids=peer)
        with caplog.at_level(logging.INFO, logger="shmclient"):
            assert sender.share(_fake_cuda_tensor(), 1) is None
        assert any(words in r.getMessage() for r in caplog.records)


def test_failed_export_falls_back(caplog, monkeypatch):
    monkeypatch.setattr(tensors_cuda, "device_uuid", lambda i: "GPU-a")

    def boom(t):
        raise RuntimeError("expandable segments")

    monkeypatch.setattr(tensors_cuda._reductions, "reduce_tensor", boom)
    with caplog.at_level(logging.INFO, logger="shmclient"):
        assert CudaIpcSender().share(_fake_cuda_tensor(), 1) is None
    assert any("could not export" in r.getMessage() for r in caplog.records)


def test_an_expandable_segments_handle_is_sent_as_a_host_copy(caplog, monkeypatch):
    """The receiving side refuses an expandable segment's handle (its header names a
    process and descriptors torch would open, and a size it divides by): its sender sends
    a host copy instead of a handle that would be refused."""
    monkeypatch.setattr(tensors_cuda, "device_uuid", lambda i: "GPU-a")
    args = (torch.Tensor, (4,), (1,), 0, None, torch.float32, 0, b"\x03e" + b"\x00" * 40, 16, 0,
            False, b"/torch_1_2_0", 0, EV, True)
    monkeypatch.setattr(tensors_cuda._reductions, "reduce_tensor", lambda t: (None, args))
    sender = CudaIpcSender()
    t = types.SimpleNamespace(device=types.SimpleNamespace(index=0), detach=lambda: None)
    with caplog.at_level(logging.INFO, logger="shmclient"):
        assert sender.share(t, 1) is None
    assert any("expandable segment" in r.getMessage() for r in caplog.records)
    assert sender.in_flight() == 0
    good = args[:7] + (H,) + args[8:]
    monkeypatch.setattr(tensors_cuda._reductions, "reduce_tensor", lambda t: (None, good))
    assert sender.share(t, 2)[3] == H


def test_put_cuda_after_close_is_refused(monkeypatch):
    """put refused after close, put_cuda shared and kept the tensor in a table close had
    already cleared (an encode racing the close)."""
    monkeypatch.setattr(tensors_cuda, "device_uuid", lambda i: "GPU-a")
    seg = Segment.create(64 * 1024)
    seg.unlink()
    sender = ShmTensorSender(seg)
    sender.close()
    with pytest.raises(SerializationError, match="closed"):
        sender.put_cuda(_fake_cuda_tensor())
    assert sender.statistics().sent_cuda == 0


def test_shm_sender_passes_the_switch_through(monkeypatch):
    monkeypatch.setattr(tensors_cuda, "device_uuid", lambda i: "GPU-a")
    seg = Segment.create(64 * 1024)
    seg.unlink()
    sender = ShmTensorSender(seg, enable_cuda_ipc=False)
    try:
        assert sender.put_cuda(_fake_cuda_tensor()) is None
        assert sender.statistics().sent_cuda == 0
    finally:
        sender.close()


def test_receiver_refuses_a_gpu_it_does_not_see(monkeypatch):
    monkeypatch.setattr(tensors_cuda, "local_index_for_uuid", lambda u: None)
    released: list[int] = []
    handle = [2, 17, "GPU-zz", H, 4, 0, [1], [1], 0, "float32", b"/torch_1_2_0", 0, EV, True]
    with pytest.raises(SerializationError, match="does not see"):
        CudaIpcReceiver().open(handle, released)
    assert released == [17]  # the sender may drop its reference


def test_a_handle_that_fails_to_open_is_released(monkeypatch):
    """A CUDA IPC handle that passed its checks but did not open (its memory or event
    handle refused, out of memory): nothing held it, yet no release was queued, so the
    sender kept that GPU tensor alive until the channel closed."""
    monkeypatch.setattr(tensors_cuda, "local_index_for_uuid", lambda u: 0)

    def refused(*args, **kwargs):
        raise RuntimeError("CUDA error: invalid resource handle")

    monkeypatch.setattr(tensors_cuda._reductions, "storage_from_cache", refused)
    released: list[int] = []
    handle = [2, 17, "GPU-zz", H, 4, 0, [1], [1], 0, "float32", b"/torch_1_2_0", 0, EV, True]
    with pytest.raises(SerializationError, match="block 17 could not be opened: RuntimeError"):
        CudaIpcReceiver().open(handle, released)
    assert released == [17]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answer")
def test_no_gpus_without_cuda():
    assert gpus.local_gpu_uuids() == []
    assert gpus.local_index_for_uuid("GPU-a") is None


# -- the real thing --------------------------------------------------------------------------

MSG, REL, DIGEST, READY, STOP, BYE = 1, 2, 3, 4, 5, 6


def _digest(t: torch.Tensor) -> str:
    c = t.detach().cpu().contiguous()
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[c.dtype.itemsize]
    data = c.view(as_int).numpy().tobytes() if c.numel() else b""
    return f"{c.dtype}|{tuple(c.shape)}|{hashlib.blake2b(data, digest_size=16).hexdigest()}"


def _consumer(data_spec, back_spec, arena: str) -> None:
    from shmclient import waiting
    from shmclient.ring_consumer import RingConsumer
    from shmclient.ring_producer import RingProducer

    rx = RingConsumer.attach(data_spec)
    tx = RingProducer.attach(back_spec)
    receiver = ShmTensorReceiver(Segment.attach(arena))
    dec = Decoder(tensors=receiver)
    held = []
    waiting.send(tx, READY, b"", timeout=30)
    try:
        while True:
            for rtype, payload in waiting.recv(rx, timeout=60):
                if rtype == STOP:
                    held.clear()
                    torch.cuda.synchronize()
                    rel = receiver.take_releases()
                    if rel:
                        waiting.send(tx, REL, rel, timeout=10)
                    opened = receiver._cuda.opened if receiver._cuda is not None else 0
                    waiting.send(tx, BYE, str(opened).encode(), timeout=10)
                    return
                seq, t, keep = dec.decode(payload)
                assert t.is_cuda
                waiting.send(tx, DIGEST, f"{seq}:{_digest(t)}".encode(), timeout=10)
                if keep:
                    held.append(t)
                del t
                rel = receiver.take_releases()
                if rel:
                    waiting.send(tx, REL, rel, timeout=10)
    finally:
        receiver.close()
        rx.close()
        tx.close()


def _produce(count: int = 1000) -> dict:
    """Send ``count`` CUDA tensors to a spawned consumer; return what was checked."""
    from multiprocessing import resource_tracker

    from shmclient import waiting
    from shmclient.ring_consumer import RingConsumer
    from shmclient.ring_producer import RingProducer

    resource_tracker.ensure_running()
    torch.cuda.init()
    baseline = torch.cuda.memory_allocated()
    data = RingProducer.create(1 * MiB)
    back = RingConsumer.create(1 * MiB)
    arena = Segment.create(4 * MiB)
    sender = ShmTensorSender(arena)
    enc = Encoder(sender)
    child = mp.get_context("spawn").Process(target=_consumer, args=(data.spec, back.spec, arena.name))
    child.start()
    expected, got, opened = {}, {}, None
    try:
        (rtype, _), = waiting.recv(back, timeout=120)
        assert rtype == READY
        data.unlink(), back.unlink(), arena.unlink()

        def pump(records):
            nonlocal opened
            for rtype, payload in records:
                if rtype == REL:
                    sender.on_release(bytes(payload))
                elif rtype == DIGEST:
                    seq, d = bytes(payload).decode().split(":", 1)
                    got[int(seq)] = d
                elif rtype == BYE:
                    opened = int(bytes(payload))

        big = torch.arange(1 << 20, dtype=torch.int32, device="cuda")  # one allocation
        dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8]
        g = torch.Generator(device="cuda").manual_seed(0)
        for seq in range(count):
            if seq % 10 == 0:  # slices of the same allocation: opened once while held
                t = big[seq * 100 : seq * 100 + 1000]
            else:
                n = [1, 100, 4096, 100_000, 1_000_000][seq % 5]
                t = torch.randint(0, 120, (n,), device="cuda", generator=g).to(dtypes[seq % 5])
                if seq % 7 == 0:
                    t = t[::3]
            expected[seq] = _digest(t)
            waiting.send(data, MSG, enc.encode([seq, t, seq % 10 == 0]), timeout=30)
            del t
            pump(back.try_recv())
        del big
        waiting.send(data, STOP, b"", timeout=30)
        while opened is None:
            pump(waiting.recv(back, timeout=60))
        child.join(60)
        assert child.exitcode == 0
        stats = msgspec.structs.asdict(sender.statistics())
    finally:
        if child.is_alive():
            child.kill()
            child.join(10)
        sender.close()
        data.close()
        back.close()
    torch.cuda.synchronize()
    torch.cuda.ipc_collect()
    return {
        "ok": got == expected,
        "count": len(got),
        "stats": stats,
        "opened": opened,
        "leftover_bytes": torch.cuda.memory_allocated() - baseline,
    }


@pytest.fixture(scope="module")
def produced():
    """Run a producer in its own process (so torch's IPC ref-count files and its exit
    path are its own), sending 1000 tensors to a consumer it spawns."""
    code = (
        "import sys, json; sys.path.insert(0, %r); import test_tensors_cuda as m; "
        "r = m._produce(1000); print('RESULT', json.dumps(r))" % os.path.dirname(__file__)
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
        cwd=os.path.dirname(os.path.dirname(__file__)),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[7:]), proc.stderr


@pytest.mark.cuda
@needs_cuda
def test_thousand_tensors_between_processes(produced):
    r, _ = produced
    assert r["ok"] and r["count"] == 1000
    assert r["stats"]["cuda_in_flight"] == 0 and r["stats"]["sent_cuda"] == 1000
    assert r["leftover_bytes"] == 0, "producer GPU memory not back to baseline"
    # 100 slices of one allocation the consumer keeps alive share one opened handle.
    assert r["opened"] is not None and r["opened"] <= 1000 - 100 + 1


@pytest.mark.cuda
@needs_cuda
def test_clean_shutdown_has_no_producer_warning(produced):
    _, stderr = produced
    assert PRODUCER_WARNING not in stderr


@pytest.mark.cuda
@needs_cuda
def test_host_copy_when_disabled_lands_on_the_same_gpu(caplog):
    seg = Segment.create(4 * MiB)
    peer = Segment.attach(seg.name)
    seg.unlink()
    sender = ShmTensorSender(seg, enable_cuda_ipc=False)
    receiver = ShmTensorReceiver(peer)
    try:
        t = torch.randn(1000, device="cuda")
        with caplog.at_level(logging.INFO, logger="shmclient"):
            out = Decoder(tensors=receiver).decode(Encoder(sender).encode(t))
            Encoder(sender).encode(t)
        assert out.device == t.device and torch.equal(out, t)
        assert sum("host copies" in r.getMessage() for r in caplog.records) == 1
    finally:
        receiver.close()
        sender.close()


@pytest.mark.cuda
@needs_cuda
def test_uuid_map_covers_every_visible_gpu():
    assert gpus.gpu_driver_present()
    uuids = gpus.local_gpu_uuids()
    assert len(uuids) == torch.cuda.device_count() == len(set(uuids))
    for i, u in enumerate(uuids):
        assert gpus.local_index_for_uuid(u) == i


def test_first_cuda_tensors_from_two_threads_share_one_ipc_sender(monkeypatch):
    """The IPC sender is made on the first CUDA tensor. Two threads sending their first
    at once got one each, and the tensor kept by the one overwritten was never released
    (its release went to the other) and dropped with it while the peer might still open
    it. Now one is made, and both tensors are kept by it until released."""
    import threading

    made: list[CudaIpcSender] = []
    both_in = threading.Barrier(2, timeout=0.5)

    class Counted(CudaIpcSender):
        def __init__(self, *args) -> None:
            super().__init__(*args)
            made.append(self)
            try:
                both_in.wait()  # without the lock both threads meet here
            except threading.BrokenBarrierError:
                pass

    fake_args = (None, [4], [1], 0, None, torch.float32, None, H, 16, 0, None, b"rc", 0, EV, False)
    monkeypatch.setattr(tensors_cuda, "CudaIpcSender", Counted)
    monkeypatch.setattr(tensors_cuda, "device_uuid", lambda i: "GPU-a")
    monkeypatch.setattr(tensors_cuda._reductions, "reduce_tensor", lambda t: (None, fake_args))
    seg = Segment.create(64 * 1024)
    seg.unlink()
    sender = ShmTensorSender(seg)
    handles: list = []
    tensor = types.SimpleNamespace(device=types.SimpleNamespace(index=0), detach=lambda: None)
    threads = [threading.Thread(target=lambda: handles.append(sender.put_cuda(tensor))) for _ in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert len(made) == 1 and len(handles) == 2 and None not in handles
        assert made[0].in_flight() == 2
        sender.on_release(b"".join(h[1].to_bytes(8, "little") for h in handles))
        assert made[0].in_flight() == 0
    finally:
        sender.close()
