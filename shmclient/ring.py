"""What both ends of an SPSC ring of variable-length records share: the segment's life
cycle and layout.

Lowest layer: imports only ``_ring`` (the C end), ``ring_resources`` (the segment, the
pipes, ``RingSpec``), ``shm``, ``stats``, ``doorbell``, ``errors`` and ``forksafe``;
never the two ends (``ring_producer.RingProducer`` and ``ring_consumer.RingConsumer``,
which subclass ``Ring`` and import this module), ``waiting``, asyncio, codecs, clients
or the engine. It owns creating and attaching an end (``Ring.create`` / ``Ring.attach``,
called on an end's class), closing and unmapping, fork safety, statistics
(``RingStatistics``), errors, and the one C wait with its adaptive spin
(``doorbell.Spin``). Nothing here or in the ends waits more than once:
each end tries without waiting (``try_*`` / ``*_nowait``) and offers one single wait
(``wait_readable`` / ``wait_writable``); the deadline and the liveness check around
them are ``shmclient.waiting``'s. The per-message path (write and publish, see and read
and release, the spin, the futex sleep and wake) is C, in ``shmclient/_ring.c``, whose
module docstring carries the layout and the memory-ordering argument for x86-64 and
aarch64. Its contract (state, fragments, naming, threads, trust of the peer, fork):
docs/design.md, "Module notes", ``shmclient.ring``.
"""

from __future__ import annotations

import os
import threading
import weakref
from time import perf_counter
from typing import Callable, TypeVar, Union

from . import _ring, forksafe
from .doorbell import Spin
from .errors import ClientClosedError, ForkedError, PeerDeadError, RingCorruptError
from .ring_resources import (
    DEFAULT_CAPACITY,
    HEADER_BYTES,
    MAX_CAPACITY,
    MAX_PAYLOAD,
    MIN_CAPACITY,
    REC_HDR,
    VERSION,
    Resources,
    RingHandles,
    RingSpec,
    make,
)
from .shm import Segment, open_handle
from .stats import RingStatistics

__all__ = [
    "DEFAULT_CAPACITY", "HEADER_BYTES", "MAX_CAPACITY", "MAX_PAYLOAD", "MIN_CAPACITY", "REC_HDR",
    "VERSION", "Ring", "RingCorruptError", "RingHandles", "RingSpec", "RingStatistics", "gate",
]

#: The process's spin gate (``_spin_gate.h``), which every ring wait asks whether to spin;
#: code that spins outside a ring wait asks it too (``allows(now)``, ``free_cpu()``).
gate = _ring.gate

BytesLike = Union[bytes, bytearray, memoryview]
E = TypeVar("E", bound="Ring")


def _as_bytes(payload) -> memoryview:
    mv = memoryview(payload)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


class Ring:
    """What both ends of a shared-memory ring share. Not an end itself: build one with
    ``RingProducer.create`` / ``RingProducer.attach`` or ``RingConsumer.create`` /
    ``RingConsumer.attach``. Any use after ``close()`` raises ClientClosedError."""

    #: "producer" or "consumer": names this end in messages.
    role: str
    #: What the other end is called in messages.
    _peer: str
    #: Which pipe read ends this end keeps: the consumer reads its wake pipe, the
    #: producer its space pipe (the other ends keep only write ends).
    _reads_wake = False
    _reads_space = False

    def __init__(self) -> None:
        raise TypeError("use RingProducer.create() / .attach() or RingConsumer.create() / .attach()")

    # ----------------------------------------------------------------- construction

    @classmethod
    def create(
        cls: type[E],
        capacity: int = DEFAULT_CAPACITY,
        *,
        prefix: str = "shmc",
        spin_us: float = 30.0,
        consumer_wake_fd: bool = False,
        producer_wake_fd: bool = False,
    ) -> E:
        """Create a ring (owner side) and return this process's end of it (of the class it
        is called on).

        ``capacity``: data bytes, a multiple of 8, at least 64. ``spin_us``: how long a
        waiter spins before it sleeps (0: never spins; adapted, see ``doorbell.Spin``).
        ``consumer_wake_fd``: also make a pipe the consumer can watch with an event loop
        (``fileno()``); the producer then writes a byte when a parked consumer asked for
        one. ``producer_wake_fd``: also make a pipe the producer can watch with an event
        loop while it waits for room (``space_fileno()``, ``arm_space()``); the consumer
        then writes a byte when it releases space the producer asked for.
        Raises ShmCapacityError if the memory cannot be reserved (nothing is left
        behind), ValueError for bad arguments. Call ``unlink()`` once the peer has
        attached. Does not block.
        """
        cls._check_end()
        _check_spin(spin_us)
        res, spec = make(capacity, prefix, consumer_wake_fd, producer_wake_fd, populate=True)
        try:
            if cls._reads_wake and spec.wake_pipe:
                res.wake_r = res.fds[0]
            if cls._reads_space and spec.space_pipe:
                res.space_r = res.fds[-1]
            return cls._build(spec, res, spin_us)
        except BaseException:
            res.release()
            raise

    @classmethod
    def attach(cls: type[E], spec: RingSpec, *, spin_us: float = 30.0) -> E:
        """Attach to a ring another process (or this one) created and return this end
        of it (of the class it is called on). Raises FileNotFoundError if its creator is
        gone or released it, ValueError if the segment is not a ring of
        ``spec.capacity``. Does not block."""
        cls._check_end()
        _check_spin(spin_us)
        res = Resources(owner=False)
        try:
            if not isinstance(spec.capacity, int) or not MIN_CAPACITY <= spec.capacity <= MAX_CAPACITY:
                raise ValueError(f"a ring's capacity must be {MIN_CAPACITY}..{MAX_CAPACITY} bytes, "
                                 f"got {spec.capacity!r}")
            # (its size checked before it is mapped, every page at once)
            res.seg = Segment.attach(spec.segment, populate=True, size=HEADER_BYTES + spec.capacity)
            try:
                counters, _ = _ring.stats(res.seg.buf)
            except ValueError:
                counters = {}
            if counters.get("capacity") != spec.capacity:
                raise ValueError(f"{spec.segment!r} is not a version-{VERSION} ring of {spec.capacity} bytes")
            if spec.wake_pipe:
                if cls._reads_wake:
                    res.wake_r = open_handle(spec.wake_pipe, os.O_RDONLY | os.O_NONBLOCK)
                    res.fds.append(res.wake_r)
                res.wake_w = open_handle(spec.wake_pipe, os.O_WRONLY | os.O_NONBLOCK)
            if spec.space_pipe:
                if cls._reads_space:
                    res.space_r = open_handle(spec.space_pipe, os.O_RDONLY | os.O_NONBLOCK)
                    res.fds.append(res.space_r)
                res.space_w = open_handle(spec.space_pipe, os.O_WRONLY | os.O_NONBLOCK)
            return cls._build(spec, res, spin_us)
        except BaseException:
            res.release()
            raise

    @classmethod
    def _check_end(cls) -> None:
        if cls._make_end is Ring._make_end:
            raise TypeError(f"{cls.__name__} is not a ring end: use RingProducer.create() / .attach() "
                            "or RingConsumer.create() / .attach()")

    @classmethod
    def _build(cls: type[E], spec: RingSpec, res: Resources, spin_us: float) -> E:
        self = object.__new__(cls)
        self.spec = spec
        self.capacity = spec.capacity
        self._res = res
        self._spin = Spin(spin_us * 1e-6)
        self._lock = threading.RLock()
        self._closed = False
        self._forked = False
        self._peer_gone = False
        self._final_statistics: RingStatistics | None = None
        self._finalizer = weakref.finalize(self, res.release)
        try:
            self._c = self._make_end(res)
        except ValueError as e:
            raise ValueError(f"{spec.segment!r} is not a version-{VERSION} ring: {e}") from None
        res.ends.append(self._c)
        if self._c.capacity != spec.capacity:  # the value the C end read once and uses
            raise ValueError(
                f"{spec.segment!r} is not a version-{VERSION} ring of {spec.capacity} bytes: its "
                f"header says capacity = {self._c.capacity}")
        self.max_record = min(self.capacity - REC_HDR, 0xFFFFFFF8)
        forksafe.register(self)
        return self

    def _make_end(self, res: Resources):
        """The C end of this side (``_ring.Producer`` / ``_ring.Consumer``)."""
        raise NotImplementedError

    def _forget_after_fork(self) -> None:
        """In a forked child: this end belongs to the parent; never close it from here,
        and every use raises ForkedError (the C end refuses it too). The child's copy of
        the mapping is let go of at once (a record view it still holds keeps it until it
        is gone); its descriptors stay (see ``Resources.forget_after_fork``)."""
        self._finalizer.detach()
        self._forked = True
        self._closed = True
        self._final_statistics = None
        self._res.forget_after_fork()

    # ----------------------------------------------------------------- lifecycle

    def unlink(self) -> None:
        """Release the handles (segment, wake pipe) so that nothing can attach any more.
        Owner only (a no-op on the attached side); call it once the peer has attached;
        idempotent. Nothing is named, so this only matters for who may attach. Does not
        block."""
        self._res.unlink()

    def handle_fds(self) -> list[int]:
        """Owner: the fds behind ``spec`` (segment, pipes) while they are still open, for
        a child process to inherit; attach then uses them instead of /proc."""
        res = self._res
        seg = res.seg.fd if res.seg is not None else -1
        return [fd for fd in (seg, res.wake_w, res.space_w) if fd >= 0]

    def close(self) -> None:
        """Tell the peer this side has gone, wake anything waiting on the ring, unmap.
        Idempotent. Waits for a call in progress on another thread of this side to
        finish (it is woken first)."""
        if self._closed:
            return
        if not self._finalizer.alive:
            # Its resources went first: at the interpreter's exit the finalizers run
            # newest first, this ring's before its client's, which closes it.
            self._closed = True
            return
        self._final_statistics = self._read_statistics()
        self._closed = True
        try:
            self._c.close()  # sets the flag, wakes both sides' waiters (and the pipe)
        finally:
            # (try_hold: a Ctrl-C as the lock is taken cannot leave it held, which would
            # block this side's later calls that take it, poke and drain_wake_fd included)
            with _ring.try_hold(self._lock, 10.0):
                self._finalizer()

    def __enter__(self: E) -> E:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def peer_closed(self) -> bool:
        """True once the other side has called ``close()``."""
        if self._closed:
            return self._peer_gone
        return self._peer_gone or self._c.peer_closed

    def statistics(self) -> RingStatistics:
        """Counters of both sides, read from the shared header (after ``close()``: as
        they were when closed). Raises ForkedError in a forked child (the counters are
        the parent's). Does not block."""
        if self._closed:
            if self._final_statistics is None:
                raise self._closed_error()
            return self._final_statistics
        return self._read_statistics()

    def _read_statistics(self) -> RingStatistics:
        counters, _ = _ring.stats(self._res.seg.buf)
        return RingStatistics(**counters)

    def _closed_error(self) -> ClientClosedError:
        if self._forked:
            return ForkedError(
                f"this {self.role} end of the ring belongs to the parent of this forked process "
                f"({os.getpid()}); a forked child cannot use it: make a new client in the child")
        return ClientClosedError(f"this {self.role} end of the ring was closed")

    def _peer_dead(self) -> PeerDeadError:
        self._peer_gone = True
        return PeerDeadError(f"the {self._peer} closed the ring")

    def _wait_once(self, wait: Callable[..., int], timeout: float, spin: float | None, first: bool) -> bool:
        """One C wait: spin (``spin`` seconds, or None: the adaptive budget; on a first
        wait only, so that a wait's later slices sleep at once; the spin gate may veto
        it), then sleep until ready or ``timeout``
        seconds after the call (a spin never outlasts a timeout > 0: ``timeout`` 0 is a
        pure spin, and a vetoed one returns at once). True when ready (or the peer closed: the
        caller's next try says so), False on the timeout. Raises ClientClosedError, or
        what a signal handler raised. No lock is taken: the C end refuses re-entry
        itself, and a wait changes nothing but statistics."""
        if self._closed:
            raise self._closed_error()
        if not timeout >= 0:
            raise ValueError(f"a wait's timeout must be >= 0 seconds (inf: none), got {timeout!r}")
        adaptive = spin is None
        if not first:
            budget = 0.0
        else:
            budget = self._spin.budget if adaptive else max(spin, 0.0)
        if 0 < timeout < budget:  # (a short timeout is not overrun by the spin)
            budget = timeout
        t0 = perf_counter()
        r = wait(budget, timeout, first)
        if adaptive:
            if r == _ring.READY:
                self._spin.after(True, 0.0)
            elif r == _ring.WOKEN:  # spun (the whole budget, or until the gate cut it), then slept
                self._spin.after(False, max(perf_counter() - t0 - budget, 0.0))
            elif r == _ring.SLEPT and budget == 0.0:
                # no spin asked: backed off (counts towards the next probe), or a later
                # slice of a wait (its first slice spun, or was vetoed, and timed out)
                self._spin.after(False, perf_counter() - t0)
            # A spin the gate vetoed, and a timeout, say nothing about whether spinning
            # pays (the host was busy; the caller's window was just short).
        if self._closed:
            raise self._closed_error()
        return r != _ring.TIMEOUT

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.capacity} bytes"
        return f"<{type(self).__name__} {self.spec.segment} {state}>"


def _check_spin(spin_us: float) -> None:
    if not 0 <= spin_us < float("inf"):
        raise ValueError(f"spin_us must be a finite number >= 0, got {spin_us!r}")
