"""Benchmark of tensor transfer between two processes: shared-memory arena vs pyzmq.

Run ``python -m shmclient_bench.tensors [--quick] [--json PATH]``; ``run(quick)`` returns the
figures as a typed ``TensorSweep`` (``shmclient_bench.tensor_results``) for a top-level
``python -m shmclient_bench``. For each size (4 KiB … 256 MiB;
``--quick`` stops at 64 MiB) it times a CPU tensor from "about to encode" in one process
to "decoded into a torch.Tensor" in the other (both clocks are CLOCK_MONOTONIC of the
same host), one transfer at a time, warm-up excluded:

* ``shm view``: codec + ``ShmTensorSender`` (one copy into the arena) + the ring for the
  metadata; the receiver gets a zero-copy view (the default for >= 64 KiB);
* ``shm copy``: the same with the receiver copying the block out (the default < 64 KiB);
* ``zmq``: codec ``encode_frames`` over pyzmq ipc:// PUSH/PULL with ``copy=False``
  frames, decoded zero-copy from the received frame (vLLM's path);
* the in-process limit: one memcpy into a preallocated buffer (``np.copyto``), plus
  ``torch.Tensor.copy_`` and ``clone`` for reference.

With CUDA, it also times the hand-off of a CUDA tensor by IPC handle (first open of a
new allocation, and a handle into an allocation the receiver already has open).

Not a test: it asserts nothing, it reports medians and p99s.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import statistics
import struct
import sys
import time

import msgspec
import numpy as np
import torch

from shmclient.codec import Decoder, Encoder
from shmclient import waiting
from shmclient.ring_consumer import RingConsumer
from shmclient.ring_producer import RingProducer
from shmclient.shm import Segment
from shmclient.tensors import ShmTensorReceiver, ShmTensorSender

from .stats import quantile
from .tensor_results import Copies, TensorHost, TensorSweep, Timing

CTX = mp.get_context("spawn")
KiB, MiB = 1 << 10, 1 << 20
SIZES = [4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB, 64 * MiB, 256 * MiB]
QUICK_SIZES = SIZES[:5]
MSG, ACK, STOP = 1, 2, 3
_T = struct.Struct("<d")


def _say(msg: str) -> None:
    """A progress line on stderr, only when stderr is a terminal."""
    try:
        if sys.stderr.isatty():
            print(f"[shmclient_bench.tensors] {msg}", file=sys.stderr, flush=True)
    except (AttributeError, ValueError):
        pass


def _reps(size: int, quick: bool) -> int:
    n = 300 if size <= 64 * KiB else 60 if size <= MiB else 15 if size <= 16 * MiB else 9 if size <= 64 * MiB else 5
    return max(5, n // 3) if quick else n


def _summary(samples: list[float]) -> Timing:
    s = sorted(samples)
    return Timing(
        median_us=statistics.median(s) * 1e6,
        p99_us=quantile(s, 0.99) * 1e6,
        min_us=s[0] * 1e6,
        n=len(s),
    )


# -- receivers (child processes) ---------------------------------------------------------


def _shm_receiver(data_spec, back_spec, arena: str, view_from: int) -> None:
    rx = RingConsumer.attach(data_spec)
    tx = RingProducer.attach(back_spec)
    receiver = ShmTensorReceiver(Segment.attach(arena), view_from=view_from)
    dec = Decoder(tensors=receiver)
    waiting.send(tx, ACK, b"", timeout=60)
    try:
        while True:
            for rtype, payload in waiting.recv(rx, timeout=120):
                if rtype == STOP:
                    return
                dec.decode(payload)  # the tensor is dropped at once: its release goes back
                t1 = time.perf_counter()
                waiting.send(tx, ACK, _T.pack(t1) + (receiver.take_releases() or b""), timeout=60)
    finally:
        receiver.close()
        rx.close()
        tx.close()


def _zmq_receiver(data_addr: str, back_addr: str) -> None:
    import zmq

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.connect(data_addr)
    push = ctx.socket(zmq.PUSH)
    push.connect(back_addr)
    dec = Decoder()
    push.send(b"")
    try:
        while True:
            frames = pull.recv_multipart(copy=False)
            if len(frames) == 1 and frames[0].bytes == b"stop":
                return
            dec.decode_frames(frames)
            t1 = time.perf_counter()
            del frames
            push.send(_T.pack(t1))
    finally:
        pull.close(linger=0)
        push.close(linger=0)
        ctx.term()


def _cuda_receiver(data_spec, back_spec, arena: str) -> None:
    """The same receiver; CUDA handles need no view threshold (they are never copied)."""
    from shmclient.tensors import VIEW_FROM

    _shm_receiver(data_spec, back_spec, arena, VIEW_FROM)


# -- senders (this process) --------------------------------------------------------------


def _source(size: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8))


def _bench_shm(sizes: list[int], quick: bool, view_from: int) -> dict[int, Timing]:
    arena = Segment.create(max(sizes) + MiB)
    data = RingProducer.create(1 * MiB)
    back = RingConsumer.create(1 * MiB)
    sender = ShmTensorSender(arena)
    child = CTX.Process(target=_shm_receiver, args=(data.spec, back.spec, arena.name, view_from))
    child.start()
    out: dict = {}
    try:
        waiting.recv(back, timeout=120)
        data.unlink(), back.unlink(), arena.unlink()
        enc = Encoder(sender)
        for size in sizes:
            _say(f"shm ({'view' if view_from == 0 else 'copy'}), {_fmt_size(size)}")
            src = _source(size)
            samples = []
            for i in range(_reps(size, quick) + 2):
                t0 = time.perf_counter()
                waiting.send(data, MSG, enc.encode(src), timeout=60)
                (rtype, payload), = waiting.recv(back, timeout=60)
                (t1,) = _T.unpack_from(payload)
                if len(payload) > 8:
                    sender.on_release(bytes(payload[8:]))
                if i >= 2:
                    samples.append(t1 - t0)
            out[size] = _summary(samples)
            assert sender.statistics().used_bytes == 0
        waiting.send(data, STOP, b"", timeout=10)
        child.join(30)
    finally:
        if child.is_alive():
            child.kill()
            child.join(5)
        sender.close()
        data.close()
        back.close()
    return out


def _bench_zmq(sizes: list[int], quick: bool) -> dict[int, Timing]:
    import tempfile

    import zmq

    tmp = tempfile.mkdtemp(prefix="shmc-bench-")
    data_addr, back_addr = f"ipc://{tmp}/data", f"ipc://{tmp}/back"
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.bind(data_addr)
    pull = ctx.socket(zmq.PULL)
    pull.bind(back_addr)
    child = CTX.Process(target=_zmq_receiver, args=(data_addr, back_addr))
    child.start()
    out: dict = {}
    try:
        pull.recv()
        enc = Encoder(inline_threshold=256)
        for size in sizes:
            _say(f"zmq, {_fmt_size(size)}")
            src = _source(size)
            samples = []
            for i in range(_reps(size, quick) + 2):
                t0 = time.perf_counter()
                push.send_multipart(enc.encode_frames(src), copy=False)
                (t1,) = _T.unpack(pull.recv())
                if i >= 2:
                    samples.append(t1 - t0)
            out[size] = _summary(samples)
        push.send(b"stop")
        child.join(30)
    finally:
        if child.is_alive():
            child.kill()
            child.join(5)
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()
        for name in ("data", "back"):
            try:
                os.unlink(os.path.join(tmp, name))
            except OSError:
                pass
        os.rmdir(tmp)
    return out


def _bench_memcpy(sizes: list[int], quick: bool) -> dict[int, Copies]:
    out: dict = {}
    for size in sizes:
        _say(f"memcpy, {_fmt_size(size)}")
        src = _source(size)
        dst = torch.empty_like(src)
        s, d = src.numpy(), dst.numpy()
        res = {}
        for name, fn in (
            ("np_copyto", lambda: np.copyto(d, s)),
            ("torch_copy_", lambda: dst.copy_(src)),
            ("torch_clone", lambda: src.clone()),
        ):
            samples = []
            for i in range(_reps(size, quick) + 2):
                t0 = time.perf_counter()
                fn()
                if i >= 2:
                    samples.append(time.perf_counter() - t0)
            res[name] = _summary(samples)
        out[size] = Copies(**res)
    return out


def _bench_cuda(sizes: list[int], quick: bool) -> dict[int, Timing]:
    """Hand-off of CUDA tensors by IPC handle: a fresh allocation each time (the handle
    is opened), and slices of one allocation the receiver keeps open (cached)."""
    arena = Segment.create(4 * MiB)
    data = RingProducer.create(1 * MiB)
    back = RingConsumer.create(1 * MiB)
    sender = ShmTensorSender(arena)
    child = CTX.Process(target=_cuda_receiver, args=(data.spec, back.spec, arena.name))
    child.start()
    out: dict = {}
    try:
        waiting.recv(back, timeout=120)
        data.unlink(), back.unlink(), arena.unlink()
        enc = Encoder(sender)
        for size in sizes:
            _say(f"cuda ipc, {_fmt_size(size)}")
            samples = []
            for i in range(min(_reps(size, quick), 30) + 2):
                t = torch.empty(size, dtype=torch.uint8, device="cuda").fill_(i % 251)
                t0 = time.perf_counter()
                waiting.send(data, MSG, enc.encode(t), timeout=60)
                (rtype, payload), = waiting.recv(back, timeout=60)
                (t1,) = _T.unpack_from(payload)
                if len(payload) > 8:
                    sender.on_release(bytes(payload[8:]))
                del t
                if i >= 2:
                    samples.append(t1 - t0)
            out[size] = _summary(samples)
        waiting.send(data, STOP, b"", timeout=10)
        child.join(30)
    finally:
        if child.is_alive():
            child.kill()
            child.join(5)
        sender.close()
        data.close()
        back.close()
    return out


# -- entry points ------------------------------------------------------------------------


def run(quick: bool = False) -> TensorSweep:
    """All measurements (times in microseconds, by size in bytes)."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    sizes = QUICK_SIZES if quick else SIZES
    load_before = os.getloadavg()[0]
    memcpy = _bench_memcpy(sizes, quick)
    shm_view = _bench_shm(sizes, quick, view_from=0)
    shm_copy = _bench_shm(sizes, quick, view_from=1 << 62)
    zmq = _bench_zmq(sizes, quick)
    cuda_ipc = _bench_cuda(sizes, quick) if torch.cuda.is_available() else None
    return TensorSweep(host=_host(load_before), quick=quick, memcpy=memcpy, shm_view=shm_view,
                       shm_copy=shm_copy, zmq=zmq, cuda_ipc=cuda_ipc)


def _host(load_before: float) -> TensorHost:
    """This machine, with the load average before the sweep and now (after it)."""
    return TensorHost(
        python=platform.python_version(),
        torch=str(torch.__version__),  # a TorchVersion, which JSON does not know
        cpus=os.cpu_count(),
        torch_threads=torch.get_num_threads(),
        load_avg_1m=load_before,
        machine=platform.machine(),
        load_avg_1m_after=os.getloadavg()[0],
    )


def _fmt_size(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def _vs(t: float, base: float) -> str:
    """A time against another: '1.33x slower' or '1.25x faster'."""
    if t <= 0 or base <= 0:
        return "-"
    return f"{t / base:.2f}x slower" if t >= base else f"{base / t:.2f}x faster"


def table(result: TensorSweep) -> str:
    """A plain-text table of medians (p99) in microseconds."""
    lines = [
        "CPU tensor, process A -> torch.Tensor in process B; median (p99) in us; memcpy = "
        "np.copyto into a preallocated buffer, copy_ = torch.Tensor.copy_ (multi-threaded)",
        f"{'size':>8} | {'memcpy':>9} | {'copy_':>9} | {'shm view':>19} | {'shm copy':>19} | "
        f"{'zmq copy=False':>19} | {'view vs memcpy':>14} | {'view vs copy_':>14}",
    ]

    def cell(x: Timing) -> str:
        return f"{x.median_us:9.1f} ({x.p99_us:7.1f})"

    for size, copies in result.memcpy.items():
        m, c = copies.np_copyto.median_us, copies.torch_copy_.median_us
        view = result.shm_view[size]
        lines.append(
            f"{_fmt_size(size):>8} | {m:9.1f} | {c:9.1f} | "
            f"{cell(view)} | {cell(result.shm_copy[size])} | {cell(result.zmq[size])} | "
            f"{_vs(view.median_us, m):>14} | {_vs(view.median_us, c):>14}"
        )
    if result.cuda_ipc is not None:
        lines.append("CUDA tensor hand-off by IPC handle (fresh allocation each time); median (p99) in us")
        for size, x in result.cuda_ipc.items():
            lines.append(f"{_fmt_size(size):>8} | {cell(x)}")
    h = result.host
    lines.append(
        f"host: {h.cpus} CPUs, torch {h.torch} ({h.torch_threads} threads), "
        f"load average {h.load_avg_1m:.1f} -> {h.load_avg_1m_after:.1f}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shmclient_bench.tensors", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="sizes up to 64 MiB, fewer repetitions")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON here")
    args = p.parse_args(argv)
    result = run(args.quick)
    print(table(result))
    if args.json:
        with open(args.json, "wb") as f:
            f.write(msgspec.json.format(msgspec.json.encode(result), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
