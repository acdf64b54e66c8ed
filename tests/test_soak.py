"""Soak (slow): 10^6 records of random sizes from 1 B to 16 MiB through one ring between
two processes, both ends waiting through the waiting module: the producer on its
non-blocking path (send_nowait, wait for room, resume), the consumer reading in place
(recv_into). Every record is checked: its sequence number, its length and every byte.

Sizes: 999,000 log-uniform in 1 B – 64 KiB and 1,000 uniform in 64 KiB – 16 MiB (the
large ones go in fragments through the 4 MiB ring; ~14 GB in all: a log-uniform draw over
the whole range would be ~1 TB). Run with ``python -m pytest -m slow tests/test_soak.py``.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import random
import time

import msgspec
import pytest

from shmclient import waiting
from shmclient.ring import RingSpec
from shmclient.ring_consumer import RingConsumer
from shmclient.ring_producer import RingProducer

from .test_ring_procs import _resource_tracker  # noqa: F401 - the spawn helper, started once

pytestmark = pytest.mark.slow

CTX = mp.get_context("spawn")
COUNT = 1_000_000
LARGE = 1_000
SEED = 20261201
MAX = 16 << 20
#: Every payload is a slice of this block, at an offset drawn from the record's number.
POOL = random.Random(SEED).randbytes(MAX + 4096)


def sizes() -> list[int]:
    rnd = random.Random(SEED)
    top = math.log(64 << 10)
    out = [max(1, int(math.exp(rnd.uniform(0, top)))) for _ in range(COUNT)]
    for i in rnd.sample(range(COUNT), LARGE):
        out[i] = rnd.randrange(64 << 10, MAX + 1)
    return out


def payload(seq: int, n: int) -> memoryview:
    off = (seq * 2654435761) % 4096
    return memoryview(POOL)[off:off + n]


def _produce(spec_bytes: bytes, parent: int) -> None:
    ring = RingProducer.attach(msgspec.msgpack.decode(spec_bytes, type=RingSpec))
    try:
        for seq, n in enumerate(sizes()):
            # the record type carries the low byte of seq; the length says the rest
            waiting.send(ring, seq & 0xFF, payload(seq, n), timeout=60,
                         alive=lambda: os.getppid() == parent)
    finally:
        ring.close()


def test_a_million_records_of_1_byte_to_16_mib_arrive_whole_and_in_order():
    want = sizes()
    ring = RingConsumer.create(4 << 20)
    child = CTX.Process(target=_produce, args=(msgspec.msgpack.encode(ring.spec), os.getpid()))
    child.start()
    seq = 0
    nbytes = 0
    bad: list[str] = []

    def check(rtype: int, view: memoryview) -> None:
        nonlocal seq, nbytes
        n = want[seq]
        if rtype != seq & 0xFF or len(view) != n or view != payload(seq, n):
            bad.append(f"record {seq}: type {rtype}, {len(view)} bytes (want {n})")
        seq += 1
        nbytes += len(view)

    t0 = time.monotonic()
    try:
        while seq < COUNT and not bad:
            waiting.recv_into(ring, check, timeout=60, alive=child.is_alive)
    finally:
        ring.close()
        child.join(30)
        if child.is_alive():
            child.kill()
            child.join(5)
    elapsed = time.monotonic() - t0
    assert not bad, bad[:5]
    assert seq == COUNT and nbytes == sum(want)
    assert child.exitcode == 0
    print(f"{COUNT} records, {nbytes / 1e9:.1f} GB in {elapsed:.1f} s")
