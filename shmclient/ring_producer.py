"""The writing end of a ring: ``RingProducer`` (built by ``Ring.create`` / ``Ring.attach``
with ``role="producer"``).

Lowest layer, beside ``ring`` (layout, record format, the ordering argument; read its
docstring first), ``doorbell`` and ``errors``; imports nothing above them. Owns the write
position, the local deque of published batches not yet released, fragmentation and the
wake FIFO's write end. Nothing here blocks except ``send`` / ``send_batch`` waiting for
space, with their timeout and liveness check.
"""

from __future__ import annotations

import struct
from collections import deque
from typing import Sequence

from . import doorbell as db
from .errors import PeerDeadError, PeerNotConsumingError
from .ring import (
    _C_CLOSED,
    _FRAGMENTS,
    _HEAD,
    _P_BLOCKS,
    _P_BYTES,
    _P_RECORDS,
    _P_SPINS,
    _REC,
    _TAIL,
    _U64,
    _WAITS_FULL,
    _WRAPS,
    CONT,
    EOB,
    MAX_PAYLOAD,
    MORE,
    PAD,
    BytesLike,
    Ring,
    _as_bytes,
    _bad_type,
    _too_big,
)


class RingProducer(Ring):
    """The writing end. Local state only: write position, freed position, and the end
    positions of published batches not yet released."""

    role = "producer"
    _peer = "consumer"

    def _init_role(self) -> None:
        self._wpos = 0  # bytes written, monotonic
        self._fpos = 0  # bytes freed by the consumer, monotonic
        self._extents: deque[int] = deque()  # end position of each unreleased batch
        self._published = 0
        self._reclaimed = 0
        self._records = 0
        self._bytes = 0
        self._last = -1  # offset of the last header of the unpublished batch
        self._last_flags = 0
        self._pend_records = 0
        self._pend_bytes = 0
        self._frag_chunk = max(8, (self.capacity // 4 - 16) & -8)
        self._want_wake = bool(self.spec.wake_fifo)
        self._wake: int | None = None
        if self._want_wake:
            self._open_wake()

    # ---- public

    def try_send(self, rtype: int, payload: BytesLike) -> bool:
        """Write one record and publish it if it fits now; False if it does not (a
        message longer than ``max_record`` never fits here: use ``send``; a record that
        must wrap may first need the consumer to release the padding). Never waits for
        space (it may wait for another thread of this side to finish its call). Raises
        ValueError (type not in 0..255, payload over 4 GiB), PeerDeadError (the consumer
        closed), ClientClosedError."""
        if type(payload) is not bytes:
            payload = _as_bytes(payload)
        with self._lock:
            if self._fast(rtype, payload):
                return True
            try:
                return self._put(rtype, payload, len(payload), False, None, None)
            finally:
                self._publish()

    def send(self, rtype: int, payload: BytesLike, *, timeout: float | None = None, alive=None) -> None:
        """Write one record and publish it, waiting for space while the ring is full
        (spin ``spin_us``, then block; never drops, never grows). ``timeout`` bounds each
        wait without progress (None: forever); ``alive`` runs every ``liveness_interval``
        while blocked. Raises PeerNotConsumingError, PeerDeadError, ValueError,
        ClientClosedError. A message longer than the ring is sent in fragments; if it
        fails half-way the consumer drops the part it got."""
        if type(payload) is not bytes:
            payload = _as_bytes(payload)
        lock = self._lock
        if timeout is None:
            lock.acquire()
        else:
            self._lock_for(timeout)
        try:
            if self._fast(rtype, payload):
                return
            n = len(payload)
            try:
                self._put(rtype, payload, n, True, timeout, alive)
            finally:
                if not self._closed:
                    self._publish()
        finally:
            lock.release()

    def _fast(self, rtype, payload) -> bool:
        """The common case, in one piece: nothing pending, the record fits before the
        end and in the free space. Writes and publishes it, or returns False having
        changed nothing. Caller holds the lock."""
        if self._closed:
            raise self._closed_error()
        q = self._q
        if q[_C_CLOSED]:
            self._consumer_gone()
        n = len(payload)
        size = (n + 15) & -8
        cap = self.capacity
        wpos = self._wpos
        pos = wpos % cap
        if size > cap - pos or size > cap - (wpos - self._fpos) or self._last >= 0:
            return False
        data = self._data
        try:
            _REC.pack_into(data, pos, n, rtype, EOB)
        except struct.error:
            raise _bad_type(rtype) from None
        data[pos + 8 : pos + 8 + n] = payload
        self._wpos = wpos = wpos + size
        self._extents.append(wpos)
        self._published = b = self._published + 1
        self._records = q[_P_RECORDS] = self._records + 1
        self._bytes = q[_P_BYTES] = self._bytes + n
        q[_HEAD] = b  # one aligned 8-byte store, before the post that publishes it
        self._items.release()
        if self._want_wake:
            self._ring_wake()
        if pos + size == cap:
            q[_WRAPS] += 1
        return True

    def send_batch(
        self, records: Sequence[tuple[int, BytesLike]], *, timeout: float | None = None, alive=None
    ) -> None:
        """Write several records and publish them with one doorbell when they fit (else
        publish what is written, wait, go on). Blocks and raises like ``send``; when it
        raises, the records before the failing one may have been sent."""
        self._lock_for(timeout)
        try:
            if self._closed:
                raise self._closed_error()
            if self._q[_C_CLOSED]:
                self._consumer_gone()
            put = self._put
            for rtype, payload in records:
                if type(payload) is not bytes:
                    payload = _as_bytes(payload)
                put(rtype, payload, len(payload), True, timeout, alive)
        finally:
            if not self._closed:
                self._publish()
            self._lock.release()

    def unlink(self) -> None:
        if self._want_wake and self._wake is None and not self._closed:
            self._open_wake()  # the consumer has attached by now; later the name is gone
        super().unlink()

    # ---- writing

    def _put(self, rtype, mv, n: int, wait: bool, timeout, alive) -> bool:
        size = (n + 15) & -8  # header + payload padded to 8
        cap = self.capacity
        if size > self._fit:
            if n > MAX_PAYLOAD:
                raise _too_big(n)
            if not wait:
                return False
            self._put_fragments(rtype, mv, n, timeout, alive)
            return True
        wpos = self._wpos
        pos = wpos % cap
        if size > cap - pos or size > cap - (wpos - self._fpos):
            pos = self._reserve(size, wait, timeout, alive)
            if pos < 0:
                return False
            wpos = self._wpos
        data = self._data
        try:
            _REC.pack_into(data, pos, n, rtype, 0)
        except struct.error:
            raise _bad_type(rtype) from None
        data[pos + 8 : pos + 8 + n] = mv
        self._last = pos
        self._last_flags = 0
        self._wpos = wpos + size
        self._pend_records += 1
        self._pend_bytes += n
        if pos + size == cap:
            self._q[_WRAPS] += 1
        return True

    def _put_fragments(self, rtype, mv, n: int, timeout, alive) -> None:
        try:
            _REC.pack(0, rtype, 0)
        except struct.error:
            raise _bad_type(rtype) from None
        self._publish()
        data = self._data
        chunk = self._frag_chunk
        off = 0
        while off < n:
            take = min(chunk, n - off)
            first = off == 0
            plen = take + 8 if first else take
            size = (plen + 15) & -8
            pos = self._reserve(size, True, timeout, alive)
            flags = (0 if first else CONT) | (MORE if off + take < n else 0)
            _REC.pack_into(data, pos, plen, rtype, flags)
            body = pos + 8
            if first:
                _U64.pack_into(data, body, n)
                body += 8
            data[body : body + take] = mv[off : off + take]
            self._last = pos
            self._last_flags = flags
            self._wpos += size
            off += take
            if off == n:
                self._pend_records += 1
                self._pend_bytes += n
            self._q[_FRAGMENTS] += 1
            self._publish()

    def _reserve(self, size: int, wait: bool, timeout, alive) -> int:
        """Offset where ``size`` bytes fit contiguously, padding the end of the ring
        when the record must wrap; -1 if it does not fit and ``wait`` is False."""
        cap = self.capacity
        while True:
            wpos = self._wpos
            pos = wpos % cap
            room = cap - pos
            free = cap - (wpos - self._fpos)
            if size <= room:
                if size <= free:
                    return pos
            elif room <= free:
                _REC.pack_into(self._data, pos, 0, 0, PAD)
                self._last = pos
                self._last_flags = PAD
                self._wpos = wpos + room
                self._q[_WRAPS] += 1
                continue
            if self._reclaim():
                continue
            if not wait:
                return -1
            self._publish()  # never wait on space a half-written batch holds
            self._wait_space(timeout, alive)

    def _publish(self) -> None:
        last = self._last
        if last < 0:
            return
        self._data[last + 5] = self._last_flags | EOB
        self._last = -1
        q = self._q
        self._published = p = self._published + 1
        self._records = q[_P_RECORDS] = self._records + self._pend_records
        self._bytes = q[_P_BYTES] = self._bytes + self._pend_bytes
        self._pend_records = self._pend_bytes = 0
        self._extents.append(self._wpos)
        q[_HEAD] = p  # one aligned 8-byte store, before the post that publishes it
        self._items.release()
        if self._want_wake:
            self._ring_wake()

    # ---- space

    def _reclaim(self) -> bool:
        spaces = self._spaces
        got = False
        while spaces.value:
            try:
                spaces.acquire(0)
            except db.BusyError:
                break
            self._on_space()
            got = True
        return got

    def _on_space(self) -> None:
        """A ``spaces`` token was taken: free the oldest batch, or learn of a close."""
        if self._closed:
            raise self._closed_error()
        if self._q[_TAIL] > self._reclaimed:
            self._fpos = self._extents.popleft()
            self._reclaimed += 1
        elif self._q[_C_CLOSED]:
            self._consumer_gone()

    def _wait_space(self, timeout, alive) -> None:
        if self._peer_gone:
            self._consumer_gone()
        q = self._q
        q[_WAITS_FULL] += 1
        r = db.wait_token(
            self._spaces, q, _TAIL, self._reclaimed, self._spin, timeout, alive,
            self._interval, self._check_wait, self._peer,
        )
        if r == db.TIMED_OUT:
            used = self._wpos - self._fpos
            raise PeerNotConsumingError(
                f"the peer is not consuming: no space was released in the ring for {timeout} s "
                f"({used} of {self.capacity} bytes still unread)"
            )
        q[_P_SPINS if r == db.SPUN else _P_BLOCKS] += 1
        self._on_space()

    def _consumer_gone(self):
        self._peer_gone = True
        raise PeerDeadError("the consumer closed the ring")

    # ---- wake fifo

    def _open_wake(self) -> int | None:
        fd = db.open_wake_writer(self.spec.wake_fifo)
        if fd is not None:
            self._wake = fd
            self._res.fds.append(fd)
        return fd

    def _ring_wake(self) -> None:
        fd = self._wake if self._wake is not None else self._open_wake()
        if fd is not None:
            db.ring_wake(fd)

    def _after_close_posts(self) -> None:
        if self._wake is not None:
            db.ring_wake(self._wake)
