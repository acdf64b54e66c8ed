"""Benchmark of the shared-memory ring against pyzmq ipc:// PUSH/PULL, two processes.

Run ``python -m shmclient_bench.ring [--quick] [--json PATH]``; ``run(quick)`` returns the figures
as a ``RingBench`` (``shmclient_bench.ring_results``) for a top-level ``python -m
shmclient_bench``. Measures, in one run:

* ping-pong round trip p50 / p99 (µs) for 64 B, 4 KiB, 1 MiB, 16 MiB records, through
  the ring (default 4 MiB ring, so 16 MiB travels in fragments) and through two zmq
  PUSH/PULL pairs; warm-up excluded. The echo side reads zero-copy (``recv_into``) and
  sends the view back; the timing side copies small records out (``recv``) and reads
  large ones zero-copy. Every wait goes through ``shmclient.waiting``; a send tries the
  ring's non-blocking ``send_nowait`` first and waits there only when the ring is full.
* one-way throughput: 64 B messages per second (one doorbell each, and batches of 64)
  and 1 MiB GB/s (handed over as views the consumer does not read, and copied out), zmq
  alongside (its receiver does not read the frames either);
* a stream of 10^6 64 B messages through the default ring: the producer's time per send
  call (p50 / p99 / p99.99 / max), where any stall would show;
* idle CPU of a consumer blocked past its spin budget (its threads' schedstat run time, over ~2 s,
  from 1 s after it blocked);
* the cost per publish of a ring with a wake pipe (for event-loop consumers): one byte per
  read at most, so a producer that runs ahead of its consumer pays it once.

What the child processes run is in ``ring_peers``. Not a test: it asserts nothing, it
reports.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Any

import zmq

from shmclient import waiting
from shmclient.ring_consumer import RingConsumer
from shmclient.ring_producer import RingProducer

from .ring_peers import (CTX, KiB, MiB, SIZES, SPIN_US, STOP, ZMQ_RECV_TIMEOUT_MS, _enc, _finish, _pct,
                         _ring_echo, _ring_flood, _ring_idle, _ring_stream, _send, _start, _zmq_echo,
                         _zmq_flood)
from .cpu_time import process_cpu
from .ring_results import RingBench, RoundTrip, Stream, Throughput, WakePipe
from .section_results import SectionHost, typed


# ---------------------------------------------------------------- measurements


def _counts(size: int, quick: bool) -> tuple[int, int]:
    """(measured round trips, warm-up) for a size."""
    if size <= 4 * KiB:
        return (5_000, 500) if quick else (20_000, 2_000)
    if size <= MiB:
        return (300, 30) if quick else (2_000, 200)
    return (20, 3) if quick else (100, 10)


def ring_round_trips(quick: bool) -> dict:
    out_ring = RingProducer.create(spin_us=SPIN_US)
    in_ring = RingConsumer.create(spin_us=SPIN_US)
    child = _start(_ring_echo, _enc(out_ring), _enc(in_ring), os.getpid())
    alive = child.is_alive
    res = {}
    try:
        got = []

        def seen(rtype: int, view: memoryview) -> None:
            got.append(len(view))

        for size in SIZES:
            n, warm = _counts(size, quick)
            msg = b"\x5a" * size
            lat = []
            small = size <= 4 * KiB
            for i in range(n + warm):
                t0 = time.perf_counter_ns()
                _send(out_ring, 1, msg, alive)
                if small:
                    rec = waiting.recv(in_ring, alive=alive)
                else:
                    got.clear()
                    while not got:
                        waiting.recv_into(in_ring, seen, timeout=None, alive=alive)
                lat.append(time.perf_counter_ns() - t0)
                if i == 0:
                    out_ring.unlink()
                    in_ring.unlink()
                    assert (len(rec[0][1]) if small else got[0]) == size
            lat = sorted(lat[warm:])
            res[size] = {"p50_us": _pct(lat, 0.5), "p99_us": _pct(lat, 0.99), "n": n}
        waiting.send(out_ring, STOP, b"")
        _finish(child)
        res["stats"] = in_ring.statistics()
    finally:
        if child.is_alive():
            child.kill()
            child.join(5)
        out_ring.close()
        in_ring.close()
    return res


def zmq_round_trips(quick: bool, tmp: str) -> dict:
    ctx = zmq.Context()
    a_out, a_in = f"ipc://{tmp}/rt-out", f"ipc://{tmp}/rt-in"
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVTIMEO, ZMQ_RECV_TIMEOUT_MS)  # a lost peer raises zmq.Again
    push.bind(a_out)
    pull.bind(a_in)
    child = _start(_zmq_echo, a_out, a_in)
    res = {}
    try:
        for size in SIZES:
            n, warm = _counts(size, quick)
            msg = b"\x5a" * size
            copy = size < 64 * KiB
            lat = []
            for _ in range(n + warm):
                t0 = time.perf_counter_ns()
                push.send(msg, copy=copy)
                frame = pull.recv(copy=copy)
                lat.append(time.perf_counter_ns() - t0)
            assert len(frame) == size
            lat = sorted(lat[warm:])
            res[size] = {"p50_us": _pct(lat, 0.5), "p99_us": _pct(lat, 0.99), "n": n}
        push.send(b"")
        _finish(child)
    finally:
        if child.is_alive():
            child.kill()
            child.join(5)
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()
    return res


def ring_one_way(size: int, count: int, *, batch: int = 1, zero_copy: bool = True) -> float:
    """Messages per second, consumer here, producer in a child. ``zero_copy``: each
    message is handed to the consumer as a view into the ring, which it does not read
    (what a consumer then does with the bytes is its own cost); else copied out."""
    r = RingConsumer.create(spin_us=SPIN_US)
    child = _start(_ring_flood, _enc(r), size, count, batch, os.getpid())
    marks: list[int] = []
    done = []

    def seen(rtype: int, view: memoryview) -> None:
        if rtype == STOP:
            done.append(1)
        elif not marks:
            marks.append(time.perf_counter_ns())

    try:
        if zero_copy:
            while not done:
                waiting.recv_into(r, seen, timeout=None, alive=child.is_alive)
        else:
            while not done:
                for rtype, body in waiting.recv(r, alive=child.is_alive):
                    seen(rtype, body)
        t1 = time.perf_counter_ns()
        _finish(child)
    finally:
        if child.is_alive():
            child.kill()
            child.join(5)
        r.close()
    sent = count // batch * batch if batch > 1 else count  # (the producer sends whole batches)
    return (sent - 1) / ((t1 - marks[0]) / 1e9)


def zmq_one_way(size: int, count: int, tmp: str) -> float:
    ctx = zmq.Context()
    addr = f"ipc://{tmp}/flood-{size}"
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVTIMEO, ZMQ_RECV_TIMEOUT_MS)  # a lost peer raises zmq.Again
    pull.bind(addr)
    received = CTX.Event()
    child = _start(_zmq_flood, addr, size, count, received)
    copy = size < 64 * KiB
    try:
        pull.recv(copy=copy)
        t0 = time.perf_counter_ns()
        while len(pull.recv(copy=copy)):
            pass
        t1 = time.perf_counter_ns()
        received.set()
        _finish(child)
    finally:
        received.set()
        if child.is_alive():
            child.kill()
            child.join(5)
        pull.close(linger=0)
        ctx.term()
    return (count - 1) / ((t1 - t0) / 1e9)


def ring_stream(count: int) -> Stream:
    """A stream of ``count`` 64 B messages through the default 4 MiB ring, the consumer
    copying each out: the time each send took in the producer (percentiles and
    max), where a stall (reclaiming space, a full ring) would show. Raises RuntimeError
    when the producer does not report its figures."""
    r = RingConsumer.create(spin_us=SPIN_US)
    mine, theirs = CTX.Pipe()
    child = _start(_ring_stream, _enc(r), count, os.getpid(), theirs)
    theirs.close()
    got = 0
    try:
        done = False
        while not done:
            for rtype, _ in waiting.recv(r, alive=child.is_alive):
                if rtype == STOP:
                    done = True
                    break
                got += 1
        out = mine.recv() if mine.poll(60) else None
        _finish(child)
    finally:
        if child.is_alive():
            child.kill()
            child.join(5)
        mine.close()
        r.close()
    if out is None:
        raise RuntimeError(f"the stream's producer sent {got} messages but never reported its send times")
    return Stream(**out, received=got)


def idle_cpu(seconds: float, settle: float = 1.0) -> float:
    """Percent of one core used by a consumer blocked past its spin budget, ``settle``
    seconds after it said it blocks (the rest of its start-up is not idle time): its
    threads' run time from /proc schedstat (ns; psutil's clock ticks are 10 ms, half a
    percent of a 2 s window, and miss short runs), psutil's where schedstat is missing."""
    to_child = RingProducer.create()
    from_child = RingConsumer.create()
    child = _start(_ring_idle, _enc(to_child), _enc(from_child), os.getpid())
    try:
        waiting.recv(from_child, timeout=60, alive=child.is_alive)  # it is about to block
        time.sleep(settle)  # (the window starts once its start-up is over; not a synchronisation)
        c0, t0 = process_cpu(child.pid), time.perf_counter()
        time.sleep(seconds)  # the measurement window, not a synchronisation
        c1, t1 = process_cpu(child.pid), time.perf_counter()
        waiting.send(to_child, STOP, b"")
        _finish(child)
    finally:
        if child.is_alive():
            child.kill()
            child.join(5)
        to_child.close()
        from_child.close()
    key = "sched_ns" if c0["sched_ns"] is not None and c1["sched_ns"] is not None else "psutil_ns"
    used = (c1[key] - c0[key]) / 1e9
    return 100.0 * used / (t1 - t0)


def wake_pipe_cost(n: int, reps: int = 9) -> WakePipe:
    """CPU ns per published batch, in-process, with and without the wake pipe.

    The two rings are measured alternately, ``reps`` times each, and the medians are
    compared, so that load from other processes hits both alike."""
    rings = {}
    try:
        for wake in (False, True):
            p = RingProducer.create(1 << 20, consumer_wake_fd=wake)
            c = RingConsumer.attach(p.spec)
            p.unlink()
            rings[wake] = (p, c)
        msg = b"x" * 64
        per = {False: [], True: []}
        for _ in range(reps):
            for wake, (p, c) in rings.items():
                t = time.process_time_ns()
                for _ in range(n):
                    p.try_send(1, msg)
                per[wake].append((time.process_time_ns() - t) / n)
                c.try_recv()
                if wake:
                    c.drain_wake_fd()
    finally:
        for p, c in rings.values():
            p.close()
            c.close()
    without, with_ = statistics.median(per[False]), statistics.median(per[True])
    return WakePipe(without_pipe_ns=without, with_pipe_ns=with_, extra_ns_per_batch=with_ - without)


def run(quick: bool = False) -> RingBench:
    """Every figure of this benchmark."""
    tmp = tempfile.mkdtemp(prefix="shmc-bench-")
    try:
        ring_rt = ring_round_trips(quick)
        zmq_rt = zmq_round_trips(quick, tmp)
        n64 = 100_000 if quick else 400_000
        nmb = 500 if quick else 3_000
        tput = Throughput(
            ring_64B_msgs_per_s=ring_one_way(64, n64, zero_copy=False),
            ring_64B_batched64_msgs_per_s=ring_one_way(64, n64, batch=64, zero_copy=False),
            zmq_64B_msgs_per_s=zmq_one_way(64, n64, tmp),
            ring_1MiB_GBps_zero_copy=ring_one_way(MiB, nmb) * MiB / 1e9,
            ring_1MiB_GBps_copy_out=ring_one_way(MiB, nmb, zero_copy=False) * MiB / 1e9,
            zmq_1MiB_GBps=zmq_one_way(MiB, nmb, tmp) * MiB / 1e9,
        )
        stream = ring_stream(200_000 if quick else 1_000_000)
        idle = idle_cpu(1.0 if quick else 2.0)
        wake = wake_pipe_cost(5_000 if quick else 20_000)
    finally:
        for f in os.listdir(tmp):
            os.unlink(os.path.join(tmp, f))
        os.rmdir(tmp)
    rt = {}
    for size in SIZES:
        r, z = ring_rt[size], zmq_rt[size]
        rt[_label(size)] = RoundTrip(
            ring_p50_us=r["p50_us"],
            ring_p99_us=r["p99_us"],
            zmq_p50_us=z["p50_us"],
            zmq_p99_us=z["p99_us"],
            ratio_p50=z["p50_us"] / r["p50_us"],
            ratio_p99=z["p99_us"] / r["p99_us"],
            round_trips=r["n"],
        )
    return RingBench(
        machine=SectionHost(cpus=os.cpu_count(), load_1m=os.getloadavg()[0],
                            python=platform.python_version()),
        quick=quick,
        spin_us=SPIN_US,
        round_trip=rt,
        throughput=tput,
        stream_64B=stream,
        idle_consumer_cpu_percent=idle,
        wake_pipe=wake,
        ring_stats_after_round_trips=ring_rt["stats"],
    )


def _label(size: int) -> str:
    return f"{size // MiB} MiB" if size >= MiB else f"{size // KiB} KiB" if size >= KiB else f"{size} B"


def report(res: RingBench | dict[str, Any]) -> str:
    """The section's table; ``res`` a ``RingBench`` or its JSON form."""
    res = typed(res, RingBench)
    lines = [f"ring vs pyzmq ipc PUSH/PULL   (cpus={res.machine.cpus}, load={res.machine.load_1m:.2f})", ""]
    lines.append(f"{'round trip':>10} | {'ring p50':>9} {'p99':>9} | {'zmq p50':>9} {'p99':>9} | {'zmq/ring p50':>12} {'p99':>6}")
    for label, r in res.round_trip.items():
        lines.append(
            f"{label:>10} | {r.ring_p50_us:9.1f} {r.ring_p99_us:9.1f} | {r.zmq_p50_us:9.1f} "
            f"{r.zmq_p99_us:9.1f} | {r.ratio_p50:11.1f}x {r.ratio_p99:5.1f}x"
        )
    t, st, wake = res.throughput, res.stream_64B, res.wake_pipe
    lines += [
        "",
        f"one way 64 B : ring {t.ring_64B_msgs_per_s / 1e6:.2f} M msg/s "
        f"(batches of 64: {t.ring_64B_batched64_msgs_per_s / 1e6:.2f}), zmq {t.zmq_64B_msgs_per_s / 1e6:.2f} M msg/s",
        f"one way 1 MiB: ring {t.ring_1MiB_GBps_zero_copy:.1f} GB/s as views (not read), "
        f"{t.ring_1MiB_GBps_copy_out:.1f} GB/s copied out; zmq {t.zmq_1MiB_GBps:.1f} GB/s",
        f"stream of {st.messages:,} x 64 B: {st.msgs_per_s / 1e6:.2f} M msg/s; "
        f"time per send p50 {st.send_p50_us:.2f} / p99 {st.send_p99_us:.2f} / "
        f"p99.99 {st.send_p9999_us:.1f} / max {st.send_max_us:.0f} us",
        f"idle consumer: {res.idle_consumer_cpu_percent:.2f} % of a core",
        f"wake pipe: +{wake.extra_ns_per_batch:.0f} ns per batch "
        f"({wake.without_pipe_ns:.0f} -> {wake.with_pipe_ns:.0f} ns per try_send)",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from .sections import section_main

    return section_main(argv, __doc__, run, report, "fewer iterations (~10 s)")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
