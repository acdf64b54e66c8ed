"""The raw ring benchmark's other side: what its child processes run, and how they start.

The echo peers (ring and zmq), the floods and the 64 B stream's producer, the idle
consumer, and the helpers both sides share: the ring's spec over a pipe (``_enc`` /
``_dec``), a send that waits only on a full ring (``_send``, ``_send_batch``), and
``_start`` / ``_finish`` for a spawned child. Children are spawned, so they import this
module only: it imports shmclient's ring ends, ``waiting`` and zmq, never the run of
the benchmark (``shmclient_bench.ring``) or its results.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import msgspec
import zmq

from shmclient import waiting
from shmclient.errors import WouldBlock
from shmclient.ring import Ring, RingSpec
from shmclient.ring_consumer import RingConsumer
from shmclient.ring_producer import RingProducer
from .stats import quantile

CTX = mp.get_context("spawn")
STOP = 255
KiB, MiB = 1 << 10, 1 << 20
SIZES = [64, 4 * KiB, 1 * MiB, 16 * MiB]
SPIN_US = 30.0


def _enc(r: Ring) -> bytes:
    return msgspec.msgpack.encode(r.spec)


def _dec(b: bytes) -> RingSpec:
    return msgspec.msgpack.decode(b, type=RingSpec)


def _parent_alive(ppid: int):
    return lambda: os.getppid() == ppid


def _pct(sorted_ns: list[int], q: float) -> float:
    return quantile(sorted_ns, q) / 1e3


def _send(tx: RingProducer, rtype: int, payload, alive) -> None:
    """Send as a producer that keeps up with its consumer does: the ring's non-blocking
    ``send_nowait`` (one C call when there is room), and only when the ring is full, a
    wait for room through ``shmclient.waiting`` (which resumes a fragmented message)."""
    try:
        tx.send_nowait(rtype, payload)
    except WouldBlock:
        waiting.send(tx, rtype, payload, alive=alive)


def _send_batch(tx: RingProducer, recs: list, alive) -> None:
    """Every record of ``recs``, as many at a time as fit, each group written and
    published together (``send_batch_nowait``: one doorbell); when not even one fits,
    the next waits for room through ``shmclient.waiting``."""
    i = 0
    while i < len(recs):
        try:
            i += tx.send_batch_nowait(recs[i:] if i else recs)
        except WouldBlock:
            waiting.send(tx, *recs[i], alive=alive)
            i += 1


# ---------------------------------------------------------------- child processes


def _ring_echo(spec_in: bytes, spec_out: bytes, ppid: int) -> None:
    rx = RingConsumer.attach(_dec(spec_in), spin_us=SPIN_US)
    tx = RingProducer.attach(_dec(spec_out), spin_us=SPIN_US)
    alive = _parent_alive(ppid)
    stop = []

    def echo(rtype: int, view: memoryview) -> None:
        if rtype == STOP:
            stop.append(1)
        else:
            _send(tx, rtype, view, alive)

    try:
        while not stop:
            waiting.recv_into(rx, echo, timeout=None, alive=alive)
    finally:
        rx.close()
        tx.close()


#: No receive in the zmq baseline waits longer than this: a lost peer fails the section.
ZMQ_RECV_TIMEOUT_MS = 30_000


def _zmq_echo(addr_in: str, addr_out: str) -> None:
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(addr_in)
    push.connect(addr_out)
    try:
        while True:
            frame = pull.recv(copy=False)
            if len(frame) == 0:
                return
            push.send(frame, copy=False)
    finally:
        pull.close(linger=0)
        push.close(linger=0)
        ctx.term()


def _ring_flood(spec: bytes, size: int, count: int, batch: int, ppid: int) -> None:
    tx = RingProducer.attach(_dec(spec), spin_us=SPIN_US)
    alive = _parent_alive(ppid)
    msg = b"\xab" * size
    try:
        if batch > 1:
            recs = [(1, msg)] * batch
            for _ in range(count // batch):
                _send_batch(tx, recs, alive)
        else:
            for _ in range(count):
                _send(tx, 1, msg, alive)
        waiting.send(tx, STOP, b"", alive=alive)
    finally:
        tx.close()


def _ring_stream(spec: bytes, count: int, ppid: int, back) -> None:
    """Send ``count`` 64-byte messages flat out, timing every send call; report the
    percentiles of those times (and the stream's rate) through ``back``."""
    import numpy as np

    tx = RingProducer.attach(_dec(spec), spin_us=SPIN_US)
    alive = _parent_alive(ppid)
    msg = b"\x5a" * 64
    took = np.empty(count, dtype=np.int64)
    now = time.perf_counter_ns
    try:
        t_start = now()
        for i in range(count):
            t = now()
            _send(tx, 1, msg, alive)
            took[i] = now() - t
        t_end = now()
        waits = tx.statistics().waits_on_full
        waiting.send(tx, STOP, b"", alive=alive)
    finally:
        tx.close()
    took.sort()
    per = lambda q: float(took[min(count - 1, int(q * count))]) / 1e3  # noqa: E731
    back.send(
        {
            "messages": count,
            "msgs_per_s": count / ((t_end - t_start) / 1e9),
            "send_p50_us": per(0.5),
            "send_p99_us": per(0.99),
            "send_p9999_us": per(0.9999),
            "send_max_us": float(took[-1]) / 1e3,
            "waits_on_full": waits,
        }
    )
    back.close()


def _zmq_flood(addr: str, size: int, count: int, received) -> None:
    """Send ``count`` messages and an empty one, then stay until the receiver says it
    has them all (``received``, an Event; 60 s at most): a sender that exited at once
    lost the last few hundred of 400,000 now and then, though it lingers (pyzmq ipc
    here, 1 run in 20), and the receiver waited out its timeout."""
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(addr)
    msg = b"\xab" * size
    copy = size < 64 * KiB
    try:
        for _ in range(count):
            push.send(msg, copy=copy)
        push.send(b"")
        received.wait(60)
    finally:
        push.close(linger=-1)
        ctx.term()


def _ring_idle(spec_in: bytes, spec_out: bytes, ppid: int) -> None:
    rx = RingConsumer.attach(_dec(spec_in), spin_us=SPIN_US)
    tx = RingProducer.attach(_dec(spec_out))
    try:
        waiting.send(tx, 1, b"blocking now")
        waiting.recv(rx, alive=_parent_alive(ppid))  # spins SPIN_US, then sleeps on the futex
    finally:
        rx.close()
        tx.close()


def _start(target, *args) -> mp.Process:
    p = CTX.Process(target=target, args=args, daemon=True)
    p.start()
    return p


def _finish(p: mp.Process) -> None:
    p.join(60)
    if p.is_alive():
        p.kill()
        p.join(5)
