"""The typed result of the event-loop fairness benchmark (``shmclient_bench.fairness``):
``Fairness``.

How late a concurrent task's 1 ms sleep woke, per configuration: the loop alone, then
shm and zmq with the engine idle and busy. It encodes (``msgspec.json``) to the layout
results.json has always had for the section. Only ``msgspec`` here, nothing that
measures.
"""

from __future__ import annotations

import msgspec

from .section_results import SectionHost


class Lateness(msgspec.Struct, frozen=True, omit_defaults=True):
    """The overshoot of the ticker's sleeps (wake-up time - the sleep), µs, and how many;
    ``output_batches``: what the client read meanwhile (busy configurations only)."""

    p50_us: float
    p99_us: float
    max_us: float
    n: int
    output_batches: int | None = None


class Fairness(msgspec.Struct, frozen=True):
    """The ticker's sleep and the busy engine's step (ms), one ``Lateness`` per
    configuration, and the host."""

    tick_ms: float
    step_ms: float
    loop_alone: Lateness
    shm_idle: Lateness
    shm_busy: Lateness
    zmq_idle: Lateness
    zmq_busy: Lateness
    machine: SectionHost

    def rows(self) -> list[tuple[str, Lateness]]:
        """(label, figures) of every configuration, in the order reported."""
        return [("loop alone (no client)", self.loop_alone), ("shm idle", self.shm_idle),
                ("shm busy", self.shm_busy), ("zmq idle", self.zmq_idle), ("zmq busy", self.zmq_busy)]
