"""Doorbells of the shared-memory ring: counting semaphores, the spin-then-block wait, and
the optional wake FIFO for event loops.

Lowest layer, beside ``ring`` (its only user): imports ``errors``, ``shm`` (names),
posix_ipc and the standard library; it must not import anything above it. It owns the one
loop in the ring that may block. A doorbell is a POSIX counting semaphore whose tokens
are the authority ("a batch was published" / "a batch was released"), plus a plain
counter in the shared header that the poster bumps before each post and that a waiter
only uses as a cheap hint while spinning. Why that is correct is argued in ``ring``.

Nothing here knows records, layouts or roles.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from time import perf_counter
from typing import Callable

import posix_ipc

from .errors import PeerDeadError
from .shm import make_name

BusyError = posix_ipc.BusyError

#: ``wait_token`` results.
TIMED_OUT, SPUN, BLOCKED = 0, 1, 2


def create_semaphore(prefix: str) -> posix_ipc.Semaphore:
    """A new semaphore, value 0, created exclusively (O_CREAT | O_EXCL) with mode 0600.
    ``FileExistsError`` on a name clash. Does not block."""
    name = make_name(prefix)
    try:
        return posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=0o600, initial_value=0)
    except posix_ipc.ExistentialError as e:
        raise FileExistsError(f"semaphore {name!r} already exists") from e


def open_semaphore(name: str) -> posix_ipc.Semaphore:
    """Open an existing semaphore; ``FileNotFoundError`` if its name is gone."""
    try:
        return posix_ipc.Semaphore(name)
    except posix_ipc.ExistentialError as e:
        raise FileNotFoundError(f"semaphore {name!r} does not exist") from e


def unlink_semaphore(name: str) -> None:
    """Remove a semaphore's name; a name already gone is fine."""
    try:
        posix_ipc.unlink_semaphore(name)
    except posix_ipc.ExistentialError:
        pass


class Spin:
    """The spin budget of one waiter: ``base`` seconds as configured, stretched while
    spinning a little longer would have avoided blocking.

    Waking a blocked process costs more than a short spin on some hosts (tens of µs on a
    virtual machine whose idle vCPU has to be woken). Then a ping-pong whose sides both
    fall asleep once stays asleep: each reply arrives after the other side's budget ran
    out. So when a blocked wait ends within ``SLACK`` of the spin giving up, the next
    budget doubles (at most ``STRETCH`` × base); a wait that blocked for longer (the
    peer was idle) resets it to base. A base of 0 never spins.
    """

    __slots__ = ("base", "budget")
    STRETCH = 8
    SLACK = 200e-6

    def __init__(self, base: float) -> None:
        self.base = self.budget = base

    def after_block(self, blocked_for: float) -> None:
        if blocked_for < self.SLACK:
            self.budget = min(self.budget * 2.0, self.base * self.STRETCH)
        else:
            self.budget = self.base


def wait_token(
    sem: posix_ipc.Semaphore,
    hints: memoryview,
    idx: int,
    seen: int,
    spin: Spin,
    timeout: float | None,
    alive: Callable[[], bool] | None,
    interval: float,
    check: Callable[[int], None],
    peer: str,
) -> int:
    """Take one token from ``sem``: spin for ``spin.budget`` seconds, then block.

    While spinning it reads ``hints[idx]`` (a plain counter the poster bumps before
    posting) and only tries the semaphore once that differs from ``seen`` and the
    semaphore's value is non-zero; a failed try just means the post is not visible yet.
    Blocking waits in slices of ``interval`` seconds (GIL released); before each slice
    it runs ``check(slices_done)`` (which raises for a closed ring or a peer that said
    it has gone) and ``alive()``; a False from ``alive`` raises ``PeerDeadError`` unless a
    token is there after all. ``timeout`` None waits forever.

    Returns SPUN or BLOCKED (how the token came), or TIMED_OUT.
    """
    acquire = sem.acquire
    now = perf_counter()
    deadline = None if timeout is None else now + timeout
    budget = spin.budget
    if budget > 0.0:
        end = now + budget
        if deadline is not None and deadline < end:
            end = deadline
        while True:
            if hints[idx] != seen and sem.value:
                try:
                    acquire(0)
                    return SPUN
                except BusyError:
                    pass
            now = perf_counter()
            if now >= end:
                break
    slices = 0
    while True:
        check(slices)
        if alive is not None and not alive():
            try:
                acquire(0)  # it may have published just before it went
                return BLOCKED
            except BusyError:
                raise PeerDeadError(
                    f"the {peer} is gone: its liveness check failed while we waited"
                ) from None
        if deadline is None:
            t = interval
        else:
            t = deadline - perf_counter()
            if t <= 0.0:
                try:
                    acquire(0)
                    return BLOCKED
                except BusyError:
                    return TIMED_OUT
            if t > interval:
                t = interval
        try:
            acquire(t)
            if budget > 0.0:
                spin.after_block(perf_counter() - now)
            return BLOCKED
        except BusyError:
            slices += 1


# --- wake FIFO: lets an event loop watch a file descriptor instead of a semaphore ---


def make_wake_fifo() -> str:
    """Create a FIFO (mode 0600) in a fresh private directory; return its path."""
    d = tempfile.mkdtemp(prefix="shmc-wake-")
    path = os.path.join(d, "wake")
    try:
        os.mkfifo(path, 0o600)
    except BaseException:
        shutil.rmtree(d, ignore_errors=True)
        raise
    return path


def remove_wake_fifo(path: str) -> None:
    """Remove the FIFO and its directory (idempotent). Open descriptors stay usable."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    try:
        os.rmdir(os.path.dirname(path))
    except FileNotFoundError:
        pass


def open_wake_reader(path: str) -> tuple[int, int]:
    """Open the consumer's end: a non-blocking read descriptor, plus a write descriptor
    kept only so that the read end never reports end-of-file (an event loop would
    otherwise spin on POLLHUP once the producer exits)."""
    r = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        w = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except BaseException:
        os.close(r)
        raise
    return r, w


def open_wake_writer(path: str) -> int | None:
    """Open the producer's end, or None while no reader has it open (or it is gone)."""
    try:
        return os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in (errno.ENXIO, errno.ENOENT):
            return None
        raise


def ring_wake(fd: int) -> None:
    """Write one byte; a full pipe already means "wake", a gone reader is ignored."""
    try:
        os.write(fd, b"\x01")
    except (BlockingIOError, BrokenPipeError):
        pass


def drain_wake(fd: int) -> None:
    """Read every pending wake byte. Never blocks."""
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass
