"""The spin policy of a ring waiter, and the wake pipe's read side.

Lowest layer, beside ``ring`` (its only user): imports only the standard library. The
spin itself and the futex sleep are C (``shmclient._ring``); this module decides how long
the next spin may be, from how the last waits ended. Nothing here blocks and nothing
here knows records, layouts or roles.
"""

from __future__ import annotations

import os

__all__ = ["Spin", "drain_pipe"]


class Spin:
    """The spin budget of one waiter: ``base`` seconds as configured, adapted to whether
    spinning has been paying off.

    * Stretch: waking a sleeping process costs more than a short spin on some hosts (tens
      of µs on a virtual machine whose idle vCPU has to be woken), and a ping-pong whose
      sides both fall asleep once stays asleep: each reply arrives just after the other
      side's budget ran out. So a wait that slept and was woken within ``SLACK`` doubles
      the next budget (at most ``STRETCH`` × base).
    * Back off: a spin is a loss when the CPU it burns is the one the peer needs (a busy
      host: more runnable threads than cores). ``MISSES`` spins in a row that ended in a
      sleep anyway stop spinning; every ``PROBE``-th wait after that spins once at base,
      and a probe that pays resumes spinning.
    * A wait that slept long (the peer was idle) resets the budget to base.

    ``budget`` is what the next wait may spin. A base of 0 never spins. Whether the host
    lets a waiter spin at all right now (a free CPU for the peer, no tight CPU quota, no
    preemption in the last spin) is the spin gate's call, in C (``_spin_gate.h``): it
    vetoes any budget given here.
    """

    __slots__ = ("base", "budget", "misses", "skipped")
    STRETCH = 8
    SLACK = 200e-6
    MISSES = 8
    PROBE = 32

    def __init__(self, base: float) -> None:
        self.base = self.budget = base
        self.misses = 0
        self.skipped = 0

    def after(self, spun: bool, slept_for: float) -> None:
        """Record how a wait ended: ``spun`` when it was ready within the spin, else how
        long it slept (``slept_for`` seconds, 0 for a timeout)."""
        base = self.base
        if base <= 0.0:
            return
        if self.budget == 0.0:  # backed off (a quick answer after sleeping proves nothing:
            # on a busy host our sleep is what let the peer run)
            self.skipped += 1
            if self.skipped >= self.PROBE:
                self.skipped = 0
                self.budget = base  # probe once
                self.misses = self.MISSES - 1
            return
        if spun:
            self.misses = 0
            return
        self.misses += 1
        if self.misses >= self.MISSES:
            self.budget = 0.0
            self.skipped = 0
        elif slept_for and slept_for < self.SLACK:
            self.budget = min(self.budget * 2.0, base * self.STRETCH)
        else:
            self.budget = base

    def after_block(self, blocked_for: float) -> None:
        """A wait that spun in vain and then slept ``blocked_for`` seconds (for waiters
        that spin and park themselves, such as an event-loop task)."""
        self.after(False, blocked_for)


def drain_pipe(fd: int) -> None:
    """Read every pending wake byte. Never blocks."""
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass
