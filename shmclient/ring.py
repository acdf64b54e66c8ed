"""SPSC ring of variable-length records in a named shared-memory segment.

Lowest layer, with ``shm``, ``doorbell`` and ``errors`` (its only imports from the
package); it knows nothing of codecs, clients, asyncio or the engine. It owns the ring's
layout, the record format, wrap-around, fragmentation of messages larger than the ring,
batching, backpressure and the ring's statistics. ``try_*`` methods never block; ``send``,
``send_batch``, ``recv`` and ``recv_into`` with a timeout spin, then block (see
``doorbell.wait_token``; the spin budget is ``spin_us``, stretched up to 8x while the
peer answers right after we block, see ``doorbell.Spin``). This module holds the layout,
the ``Ring`` base (construction, close, statistics) and the argument below; the two ends
are ``ring_producer.RingProducer`` and ``ring_consumer.RingConsumer``.

Layout: a 4 KiB header, then ``capacity`` data bytes. The header holds magic, version and
capacity; one 64-byte line written only by the producer (published-batch counter,
records, bytes); one producer line of rarely-changing statistics; one with the
producer's closed flag; and the same again for the consumer (released-batch counter,
records, bytes, spins, blocks; closed flag). A record is an 8-byte header (u32 payload
length, u8 type, u8 flags, 2 spare bytes) followed by the payload, padded to 8 bytes. A
record that does not fit before the end is preceded by a PAD record covering the rest;
the last record of a batch carries END_OF_BATCH; a message longer than ``max_record`` is
cut into fragments (MORE_FRAGMENTS / CONTINUATION, the first one prefixed with the u64
total length) and each fragment is published as its own batch, so the consumer can free
each one while the next is written; it reassembles them into one buffer, kept for the
next large message (up to 64 MiB) so that its pages are not faulted in again.

Memory ordering. Python promises nothing about when plain stores into shared memory
become visible to another process, and on weakly ordered CPUs (aarch64) they may become
visible out of order and loads may be satisfied early. So no decision that matters rests
on a plain load of a shared counter. The authority is two POSIX counting semaphores:
``items`` counts published batches, ``spaces`` counts released batches. POSIX (Base
Definitions 4.12, Memory Synchronization) lists sem_post, sem_wait, sem_trywait and
sem_timedwait among the functions that synchronize memory; glibc implements post as an
atomic add with release order and the waits as atomic read-modify-writes with acquire
order (STLXR/LDAXR or LSE LDADDL/CASA on aarch64, locked instructions on x86-64). Every
post and wait is a read-modify-write of the same word, so a wait that takes a token
synchronizes with every post before it in that word's modification order: everything
the poster stored before posting is visible after the wait. Hence:

* The producer writes every record of a batch, sets END_OF_BATCH on the last, stores its
  published counter, then posts ``items`` once. The consumer takes one token (trywait
  while spinning, timed wait when blocked) and only then reads, at its own local read
  position, up to END_OF_BATCH; the bytes it reads were stored before a post it has
  synchronized with. A producer killed mid-batch never posted, so nothing of that batch
  is ever read: no partial record can be seen.
* The consumer posts ``spaces`` once per batch after it has finished with the batch's
  bytes (copied them out, or the handler given views returned). The producer keeps a
  local deque of the end positions of batches it published; each ``spaces`` token pops
  one and frees the space up to it. It never reads the consumer's position.
* A side's ``close()`` sets its closed flag and then posts both semaphores once, so a
  blocked peer (or another thread of the same side) wakes. The token is told apart from
  a real one by the poster's counter read *after* the wait: the published (released)
  counter is stored before each post, so after taking the (k+1)-th token a real batch
  is there exactly when the counter exceeds k; otherwise the token is a close.
* Shared counters are written only by memoryview item assignment: one aligned 8-byte
  store, so a reader sees the old or the new value, never a mix. Never struct.pack_into:
  it zero-fills its destination before writing the fields, and a peer reading the
  published counter while the next batch is being published would see 0 and take a
  real batch's token for a close.
* The shared counters are also read with plain loads while spinning, as hints only: a
  memoryview load costs ~50 ns where a failed trywait raises BusyError (~1 µs). When
  the hint moves and the semaphore's value is non-zero, the spinner tries the
  semaphore; a BusyError then only means "not visible yet, keep spinning".
* No wake-up can be lost: a counting semaphore remembers every post. A batch that does
  not fit is published as far as it is written before the producer waits, so a
  half-written batch never holds space the consumer cannot free.

Threads: each ring end takes a local lock around every operation, so several threads of
one process may share an end while the ring itself stays single-producer single-consumer.
"""

from __future__ import annotations

import os
import struct
import threading
import weakref
from typing import Callable, Literal, Sequence, Union

import msgspec
import posix_ipc

from . import doorbell as db
from .errors import ClientClosedError, PeerDeadError, PeerNotConsumingError, PeerNotProducingError
from .shm import Segment

__all__ = ["DEFAULT_CAPACITY", "Ring", "RingSpec"]

DEFAULT_CAPACITY = 4 << 20
MAGIC = 0x31474E4952434D53  # b"SMCRING1", little-endian
VERSION = 1
HEADER_BYTES = 4096
REC_HDR = 8
MAX_PAYLOAD = 0xFFFF_FFFF
MIN_CAPACITY = 64
MAX_CAPACITY = 1 << 40
SCRATCH_KEEP = 64 << 20  # a reassembly buffer up to this size is reused

# record flags
EOB, PAD, MORE, CONT = 0x01, 0x02, 0x04, 0x08

# header slots (u64 index = byte offset // 8); each group starts a 64-byte line
_MAGIC, _VERSION, _CAPACITY = 0, 1, 2
_HEAD, _P_RECORDS, _P_BYTES = 8, 9, 10  # producer hot line (head = published batches)
_P_SPINS, _P_BLOCKS, _WRAPS, _WAITS_FULL, _FRAGMENTS = 16, 17, 18, 19, 20
_P_CLOSED = 24
_TAIL, _C_RECORDS, _C_BYTES, _C_SPINS, _C_BLOCKS = 32, 33, 34, 35, 36  # consumer hot line
_C_CLOSED = 40

_REC = struct.Struct("<IBB")
_U64 = struct.Struct("<Q")

BytesLike = Union[bytes, bytearray, memoryview]
Role = Literal["producer", "consumer"]


class RingSpec(msgspec.Struct, frozen=True):
    """Everything the peer process needs to attach (msgpack-able)."""

    segment: str
    items: str
    spaces: str
    capacity: int
    wake_fifo: str = ""


class _Resources:
    """OS resources of one ring end; owned by a finalizer, not by the Ring itself."""

    def __init__(self, owner: bool) -> None:
        self.owner = owner
        self.seg: Segment | None = None
        self.sems: list[posix_ipc.Semaphore] = []
        self.fds: list[int] = []
        self.views: list[memoryview] = []
        self.fifo = ""
        self.unlinked = not owner

    def unlink(self) -> None:
        if self.unlinked:
            return
        self.unlinked = True
        if self.seg is not None:
            self.seg.unlink()
        for s in self.sems:
            db.unlink_semaphore(s.name)
        if self.fifo:
            db.remove_wake_fifo(self.fifo)

    def release(self) -> None:
        for v in self.views:
            v.release()
        self.views.clear()
        if self.seg is not None:
            self.seg.close()
        for s in self.sems:
            try:
                s.close()
            except posix_ipc.ExistentialError:
                pass
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds.clear()
        self.unlink()


def _as_bytes(payload) -> memoryview:
    mv = memoryview(payload)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def _bad_type(rtype) -> ValueError:
    return ValueError(f"record type must be an int in 0..255, got {rtype!r}")


def _too_big(n: int) -> ValueError:
    return ValueError(f"payload of {n} bytes is larger than a record can carry ({MAX_PAYLOAD} bytes)")


class Ring:
    """One end of a shared-memory ring. Build with ``Ring.create`` or ``Ring.attach``.

    Producer methods: ``try_send``, ``send``, ``send_batch``. Consumer methods:
    ``try_recv``, ``recv``, ``recv_into``, ``fileno``, ``drain_wake_fd``. Calling a
    method of the other role raises TypeError; any use after ``close()`` raises
    ClientClosedError.
    """

    role: Role
    _peer: str

    def __init__(self) -> None:
        raise TypeError("use Ring.create() or Ring.attach()")

    # ----------------------------------------------------------------- construction

    @classmethod
    def create(
        cls,
        role: Role,
        capacity: int = DEFAULT_CAPACITY,
        *,
        prefix: str = "shmc",
        spin_us: float = 30.0,
        consumer_wake_fd: bool = False,
        liveness_interval: float = 0.1,
    ) -> "Ring":
        """Create a ring (owner side) and return this process's end of it.

        ``capacity``: data bytes, a multiple of 8, at least 64. ``spin_us``: how long a
        waiter spins before it blocks (0: never spins). ``consumer_wake_fd``: also make
        a FIFO the consumer can watch with an event loop (``fileno()``); the producer
        then writes a byte per published batch (a system call, ~1 µs). ``liveness_interval``:
        seconds between ``alive()`` checks while blocked. Raises ShmCapacityError if
        /dev/shm cannot hold it (nothing is left behind), ValueError for bad
        arguments. Call ``unlink()`` once the peer has attached. Does not block.
        """
        kind = _role_class(role)
        if not isinstance(capacity, int) or not MIN_CAPACITY <= capacity <= MAX_CAPACITY or capacity % 8:
            raise ValueError(
                f"capacity must be a multiple of 8 between {MIN_CAPACITY} and {MAX_CAPACITY}, got {capacity!r}"
            )
        _check_tuning(spin_us, liveness_interval)
        res = _Resources(owner=True)
        try:
            res.seg = Segment.create(HEADER_BYTES + capacity, prefix=prefix)
            q = res.seg.buf[:HEADER_BYTES].cast("Q")
            q[_CAPACITY] = capacity
            q[_VERSION] = VERSION
            q[_MAGIC] = MAGIC
            q.release()
            res.sems.append(db.create_semaphore(prefix))
            res.sems.append(db.create_semaphore(prefix))
            if consumer_wake_fd:
                res.fifo = db.make_wake_fifo()
            spec = RingSpec(res.seg.name, res.sems[0].name, res.sems[1].name, capacity, res.fifo)
            return kind._build(spec, res, spin_us, liveness_interval)
        except BaseException:
            res.release()
            raise

    @classmethod
    def attach(
        cls, spec: RingSpec, role: Role, *, spin_us: float = 30.0, liveness_interval: float = 0.1
    ) -> "Ring":
        """Attach to a ring another process created (peer side). Raises FileNotFoundError
        if a name is gone, ValueError if the segment is not a ring of ``spec.capacity``.
        Does not block."""
        kind = _role_class(role)
        _check_tuning(spin_us, liveness_interval)
        res = _Resources(owner=False)
        try:
            res.seg = Segment.attach(spec.segment)
            q = res.seg.buf[:HEADER_BYTES].cast("Q") if res.seg.size >= HEADER_BYTES else None
            ok = (
                q is not None
                and q[_MAGIC] == MAGIC
                and q[_VERSION] == VERSION
                and q[_CAPACITY] == spec.capacity
                and res.seg.size >= HEADER_BYTES + spec.capacity
            )
            if q is not None:
                q.release()
            if not ok:
                raise ValueError(f"{spec.segment!r} is not a version-{VERSION} ring of {spec.capacity} bytes")
            res.sems.append(db.open_semaphore(spec.items))
            res.sems.append(db.open_semaphore(spec.spaces))
            return kind._build(spec, res, spin_us, liveness_interval)
        except BaseException:
            res.release()
            raise

    @classmethod
    def _build(cls, spec: RingSpec, res: _Resources, spin_us: float, interval: float) -> "Ring":
        self = object.__new__(cls)
        self.spec = spec
        self.capacity = spec.capacity
        self.max_record = min(spec.capacity - REC_HDR, MAX_PAYLOAD)
        self._fit = self.max_record + 15 & -8  # largest record size written unfragmented
        self._res = res
        seg = res.seg
        assert seg is not None
        self._q = seg.buf[:HEADER_BYTES].cast("Q")
        self._data = seg.buf[HEADER_BYTES : HEADER_BYTES + spec.capacity]
        res.views += [self._q, self._data]
        self._items, self._spaces = res.sems
        self._spin = db.Spin(spin_us * 1e-6)
        self._interval = interval
        self._lock = threading.RLock()
        self._closed = False
        self._peer_gone = False
        self._final_stats: dict[str, int] | None = None
        self._finalizer = weakref.finalize(self, res.release)
        self._init_role()
        return self

    def _init_role(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    # ----------------------------------------------------------------- lifecycle

    def unlink(self) -> None:
        """Remove every name (segment, both semaphores, wake FIFO) so that nothing is
        left in /dev/shm whatever happens later. Owner only (a no-op on the attached
        side); call it once the peer has attached; idempotent. Does not block."""
        self._res.unlink()

    def close(self) -> None:
        """Tell the peer this side has gone, wake anything blocked on the ring, unmap,
        and (owner) unlink. Idempotent. Waits for an operation in progress on another
        thread of this side to finish (it is woken first)."""
        if self._closed:
            return
        try:
            self._final_stats = self._read_stats()
        except ValueError:  # pragma: no cover - views already gone
            pass
        self._closed = True
        try:
            self._q[_P_CLOSED if self.role == "producer" else _C_CLOSED] = 1
            self._items.release()
            self._spaces.release()
            self._after_close_posts()
        finally:
            got = self._lock.acquire(timeout=10.0)
            try:
                self._finalizer()
            finally:
                if got:
                    self._lock.release()

    def _after_close_posts(self) -> None:
        pass

    def __enter__(self) -> "Ring":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def peer_closed(self) -> bool:
        """True once the other side has called ``close()`` (plain read; a hint)."""
        if self._closed:
            return self._peer_gone
        return self._peer_gone or bool(self._q[_C_CLOSED if self.role == "producer" else _P_CLOSED])

    def stats(self) -> dict[str, int]:
        """Counters of both sides, read from the shared header (after ``close()``: as
        they were when closed). Does not block."""
        if self._closed:
            return dict(self._final_stats or {})
        return self._read_stats()

    def _read_stats(self) -> dict[str, int]:
        q = self._q
        return {
            "capacity": self.capacity,
            "tx_records": q[_P_RECORDS],
            "tx_bytes": q[_P_BYTES],
            "tx_batches": q[_HEAD],
            "tx_spins": q[_P_SPINS],
            "tx_blocks": q[_P_BLOCKS],
            "wraps": q[_WRAPS],
            "waits_on_full": q[_WAITS_FULL],
            "fragments": q[_FRAGMENTS],
            "rx_records": q[_C_RECORDS],
            "rx_bytes": q[_C_BYTES],
            "rx_batches": q[_TAIL],
            "rx_spins": q[_C_SPINS],
            "rx_blocks": q[_C_BLOCKS],
        }

    def _closed_error(self) -> ClientClosedError:
        return ClientClosedError(f"this {self.role} end of the ring was closed")

    def _check_wait(self, slices: int) -> None:
        if self._closed:
            raise self._closed_error()
        # The peer's close() sets its flag and then posts; give that post one slice to
        # arrive (it carries any data published before it) before trusting the flag.
        if slices and self._q[_C_CLOSED if self.role == "producer" else _P_CLOSED]:
            self._peer_gone = True
            raise PeerDeadError(f"the {self._peer} closed the ring")

    def _lock_for(self, timeout: float | None) -> None:
        if not self._lock.acquire(True, -1 if timeout is None else max(timeout, 0.0)):
            err = PeerNotConsumingError if self.role == "producer" else PeerNotProducingError
            raise err(f"another thread held this {self.role} end for the whole timeout ({timeout} s)")

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.capacity} bytes"
        return f"<Ring {self.role} {self.spec.segment} {state}>"

    # ----------------------------------------------------------------- wrong role

    def _wrong(self, name: str) -> TypeError:
        other = "consumer" if self.role == "producer" else "producer"
        return TypeError(f"{name}() is a {other} method; this end of the ring is the {self.role}")

    def try_send(self, rtype: int, payload: BytesLike) -> bool:
        raise self._wrong("try_send")

    def send(self, rtype: int, payload: BytesLike, *, timeout: float | None = None, alive=None) -> None:
        raise self._wrong("send")

    def send_batch(self, records: Sequence[tuple[int, BytesLike]], *, timeout: float | None = None, alive=None) -> None:
        raise self._wrong("send_batch")

    def try_recv(self) -> list[tuple[int, bytes]]:
        raise self._wrong("try_recv")

    def recv(self, *, timeout: float | None = None, alive=None) -> list[tuple[int, bytes]]:
        raise self._wrong("recv")

    def recv_into(self, handler: Callable[[int, memoryview], None], *, timeout: float | None = 0.0, alive=None) -> int:
        raise self._wrong("recv_into")

    def fileno(self) -> int:
        raise self._wrong("fileno")

    def drain_wake_fd(self) -> None:
        raise self._wrong("drain_wake_fd")


def _check_tuning(spin_us: float, interval: float) -> None:
    if not spin_us >= 0:
        raise ValueError(f"spin_us must be >= 0, got {spin_us!r}")
    if not interval > 0:
        raise ValueError(f"liveness_interval must be > 0 seconds, got {interval!r}")


def _role_class(role: str) -> type[Ring]:
    # The ends live in modules of their own that import this one.
    if role == "producer":
        from .ring_producer import RingProducer

        return RingProducer
    if role == "consumer":
        from .ring_consumer import RingConsumer

        return RingConsumer
    raise ValueError(f"role must be 'producer' or 'consumer', got {role!r}")
