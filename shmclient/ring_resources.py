"""A ring's operating-system resources: its shared segment and pipes, made, described
and released, with no end of the ring attached.

Lowest layer, under ``ring``: imports only ``_ring`` (to write a fresh header), ``shm``
and msgspec; never ``ring`` or its ends, ``waiting``, asyncio, codecs, clients or the
engine. It owns the size limits of a ring, ``RingSpec`` (what a peer needs to attach),
``Resources`` (the fds, the mapping and the C ends of one side, released by a
finalizer, never by the ``Ring`` object itself), ``make`` (a new segment with its header
written, and its pipes) and ``RingHandles`` (a ring one process makes for two others to
attach). Nothing here blocks.
"""

from __future__ import annotations

import os
import weakref

import msgspec

from . import _ring
from .shm import Segment, make_pipe

__all__ = ["DEFAULT_CAPACITY", "HEADER_BYTES", "MAX_PAYLOAD", "Resources", "RingHandles", "RingSpec", "make"]

DEFAULT_CAPACITY = 4 << 20
HEADER_BYTES = _ring.HEADER_BYTES
REC_HDR = _ring.REC_HDR
VERSION = _ring.VERSION
MAX_PAYLOAD = _ring.MAX_MESSAGE  # the largest message (fragmented; the consumer refuses a
# longer total); one record carries max_record
MIN_CAPACITY = 64
MAX_CAPACITY = 1 << 40


class RingSpec(msgspec.Struct, frozen=True):
    """Everything the peer process needs to attach (msgpack-able): the segment's handle,
    the capacity and the handles of the pipes' write ends: ``wake_pipe`` for a consumer
    that waits in an event loop (the producer writes it on publish), ``space_pipe`` for a
    producer that waits for room in an event loop (the consumer writes it on release)."""

    segment: str
    capacity: int
    wake_pipe: str = ""
    space_pipe: str = ""


class Resources:
    """OS resources of one ring end; owned by a finalizer, not by the Ring itself."""

    def __init__(self, owner: bool) -> None:
        self.owner = owner
        self.seg: Segment | None = None
        self.fds: list[int] = []
        self.wake_w = -1  # a write end of the consumer's wake pipe (both ends keep one)
        self.wake_r = -1  # the consumer's: its wake pipe's read end
        self.space_w = -1  # a write end of the producer's space pipe (both ends keep one)
        self.space_r = -1  # the producer's: its space pipe's read end
        self.ends: list = []  # the C end: dropped before the mapping is closed
        self.detached: list = []  # the C ends once released (one may still hold the mapping)

    def forget_after_fork(self) -> None:
        """In a forked child: let go of this process's copy of the mapping without
        writing a byte of the parent's ring (a record view the child still holds keeps
        it until it is gone). The descriptors stay as they are: a child may pass them on
        (Popen's pass_fds runs these hooks when it has a preexec_fn); they close at its
        exec or exit."""
        on_drop = self.seg.close if self.seg is not None else None
        for end in (*self.ends, *self.detached):
            end.forget(on_drop)
        if self.seg is not None:
            self.seg.close()

    def unlink(self) -> None:
        """Release the segment's handle (the peer has attached): it no longer opens. The
        wake pipe's write end stays until ``release``: a pipe whose last writer closed
        reads as end-of-file, which an event loop would report as readable forever."""
        if self.seg is not None:
            self.seg.release_handle()

    def release(self) -> None:
        # A C end still used (a thread waits on it, a handler runs, a view lives) keeps
        # its mapping; the last of them drops it and calls seg.close() again, which
        # then unmaps (the first one below could not).
        on_drop = self.seg.close if self.seg is not None else None
        for end in self.ends:
            end.close()
            end.detach(on_drop)
        self.detached += self.ends  # (a fork before its waiter left: forget_after_fork)
        self.ends.clear()
        self.unlink()
        for name in ("wake_w", "space_w"):
            fd = getattr(self, name)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)
        if self.seg is not None:
            self.seg.close()
        self.wake_r = self.space_r = -1  # (closed below: their numbers may be reused)
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds.clear()


def make(capacity: int, prefix: str, consumer_wake_fd: bool, producer_wake_fd: bool, *,
         populate: bool) -> tuple[Resources, RingSpec]:
    """A new ring's segment (header written) and pipes, and its spec. ``res.fds`` holds
    the pipes' read ends, the wake pipe's first."""
    if not isinstance(capacity, int) or not MIN_CAPACITY <= capacity <= MAX_CAPACITY or capacity % 8:
        raise ValueError(
            f"capacity must be a multiple of 8 between {MIN_CAPACITY} and {MAX_CAPACITY}, got {capacity!r}"
        )
    res = Resources(owner=True)
    try:
        res.seg = Segment.create(HEADER_BYTES + capacity, prefix=prefix, populate=populate)
        _ring.init_header(res.seg.buf, capacity)
        wake = space = ""
        if consumer_wake_fd:
            r, res.wake_w, wake = make_pipe()
            res.fds.append(r)
        if producer_wake_fd:
            r, res.space_w, space = make_pipe()
            res.fds.append(r)
        return res, RingSpec(res.seg.name, capacity, wake, space)
    except BaseException:
        res.release()
        raise


class RingHandles:
    """A ring made by one process for two others to attach (a launcher, for a pair of
    processes it starts): the handles in ``spec`` and nothing else, no end. Its memory is
    not mapped here. ``release()`` once both ends have attached (or at the latest when
    this process ends, which releases them too): the handles stop opening and the ring
    lives as long as its ends."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, *, prefix: str = "shmc",
                 consumer_wake_fd: bool = False, producer_wake_fd: bool = False) -> None:
        self._res, self.spec = make(capacity, prefix, consumer_wake_fd, producer_wake_fd, populate=False)
        self._res.seg.close()  # the fd (the handle) stays, the mapping goes
        self._finalizer = weakref.finalize(self, self._res.release)

    def handle_fds(self) -> list[int]:
        """The fds behind ``spec`` while they are open (for a forked child to close)."""
        res = self._res
        seg = res.seg.fd if res.seg is not None else -1
        return [fd for fd in (seg, res.wake_w, res.space_w) if fd >= 0]

    def release(self) -> None:
        """Close every fd of the ring here (idempotent); never blocks."""
        self._finalizer()
