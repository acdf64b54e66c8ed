"""The typed result of the raw ring benchmark (``shmclient_bench.ring``): ``RingBench``.

Round trips by record size (the size's label, '64 B' to '16 MiB'), one-way throughput,
the producer's send times in a long stream, a blocked consumer's idle CPU, the wake
pipe's cost and the ring's own counters after the round trips. It encodes
(``msgspec.json``) to the layout results.json has always had for the section. Only
``msgspec`` and shmclient's statistics record here, nothing that measures.
"""

from __future__ import annotations

import msgspec

from shmclient.stats import RingStatistics

from .section_results import SectionHost


class RoundTrip(msgspec.Struct, frozen=True):
    """Ping-pong at one record size, µs: the ring and zmq, and zmq / ring."""

    ring_p50_us: float
    ring_p99_us: float
    zmq_p50_us: float
    zmq_p99_us: float
    ratio_p50: float
    ratio_p99: float
    round_trips: int


class Throughput(msgspec.Struct, frozen=True):
    """One way, producer in a child: 64 B messages per second (one doorbell each, and in
    batches of 64) and 1 MiB GB/s (handed over as views, not read; and copied out), zmq
    beside them."""

    ring_64B_msgs_per_s: float
    ring_64B_batched64_msgs_per_s: float
    zmq_64B_msgs_per_s: float
    ring_1MiB_GBps_zero_copy: float
    ring_1MiB_GBps_copy_out: float
    zmq_1MiB_GBps: float


class Stream(msgspec.Struct, frozen=True):
    """A stream of 64 B messages through the default ring: the producer's rate and time
    per send call (µs), how often it waited on a full ring, and what the consumer got."""

    messages: int
    msgs_per_s: float
    send_p50_us: float
    send_p99_us: float
    send_p9999_us: float
    send_max_us: float
    waits_on_full: int
    received: int


class WakePipe(msgspec.Struct, frozen=True):
    """CPU ns per ``try_send`` without and with the wake pipe, and the difference."""

    without_pipe_ns: float
    with_pipe_ns: float
    extra_ns_per_batch: float


class RingBench(msgspec.Struct, frozen=True):
    """Every figure of the raw ring benchmark; ``round_trip`` by size label, smallest first."""

    machine: SectionHost
    quick: bool
    spin_us: float
    round_trip: dict[str, RoundTrip]
    throughput: Throughput
    stream_64B: Stream
    idle_consumer_cpu_percent: float
    wake_pipe: WakePipe
    ring_stats_after_round_trips: RingStatistics
