"""The typed result of the contention matrix (``shmclient_bench.contention``): ``Contention``.

One ``Cell`` per host state (``busy_<n>``: n busy processes; ``quota_1cpu``: a 1-CPU
quota), each with the round trips of the four clients and whether shm met its target
there, sync and async apart. It encodes (``msgspec.json``) to the layout results.json
has always had for the section (a cell's clients under their names, 'sync-shm' ...).
Only ``msgspec`` here, nothing that measures.
"""

from __future__ import annotations

import msgspec

from .section_results import SectionHost


class RoundTrips(msgspec.Struct, frozen=True):
    """One client's round trips in one cell, µs, and how many."""

    p50_us: float
    p99_us: float
    n: int


class Cell(msgspec.Struct, frozen=True):
    """The four clients in one host state, measured in alternating rounds, the rounds'
    wall time, and the target per mode (shm p50 <= zmq p50, shm p99 <= slack x zmq p99)."""

    sync_shm: RoundTrips = msgspec.field(name="sync-shm")
    sync_zmq: RoundTrips = msgspec.field(name="sync-zmq")
    async_shm: RoundTrips = msgspec.field(name="async-shm")
    async_zmq: RoundTrips = msgspec.field(name="async-zmq")
    wall_s: float
    sync_target_met: bool
    async_target_met: bool

    def pair(self, mode: str) -> tuple[RoundTrips, RoundTrips]:
        """(shm, zmq) of ``mode``, "sync" or "async"."""
        return (self.sync_shm, self.sync_zmq) if mode == "sync" else (self.async_shm, self.async_zmq)

    def target_met(self, mode: str) -> bool:
        return self.sync_target_met if mode == "sync" else self.async_target_met


class Contention(msgspec.Struct, frozen=True):
    """Every cell by name (``busy_0`` ... ``quota_1cpu``), in the order measured; notes
    (a cell skipped, and why); the host; whether every cell met both targets."""

    cells: dict[str, Cell]
    notes: list[str]
    machine: SectionHost
    all_targets_met: bool
