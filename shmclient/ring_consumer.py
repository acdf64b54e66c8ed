"""The reading end of a ring: ``RingConsumer`` (built by ``Ring.create`` / ``Ring.attach``
with ``role="consumer"``).

Lowest layer, beside ``ring`` (layout, record format, the ordering argument; read its
docstring first), ``doorbell`` and ``errors``; imports nothing above them. Owns the read
position, taking and releasing batch tokens, reassembly of fragmented messages and the
wake FIFO's read end. ``try_recv`` and ``recv_into(timeout=0)`` never block; ``recv`` and
``recv_into`` with a timeout spin, then block, with a liveness check.
"""

from __future__ import annotations

from typing import Callable

from . import doorbell as db
from .errors import PeerDeadError, PeerNotProducingError
from .ring import (
    _C_BLOCKS,
    _C_BYTES,
    _C_RECORDS,
    _C_SPINS,
    _HEAD,
    _P_CLOSED,
    _REC,
    _TAIL,
    _U64,
    CONT,
    EOB,
    MAX_PAYLOAD,
    MORE,
    PAD,
    SCRATCH_KEEP,
    Ring,
)


class RingConsumer(Ring):
    """The reading end. Local state only: read position, batches taken and released,
    and the buffer of a fragmented message being reassembled."""

    role = "consumer"
    _peer = "producer"

    def _init_role(self) -> None:
        self._rpos = 0
        self._taken = 0
        self._released = 0
        self._records = 0
        self._bytes = 0
        self._spins = 0
        self._blocks = 0
        self._open = False  # holding the token of a batch not fully read
        self._frag: memoryview | None = None  # the message being reassembled
        self._frag_off = 0
        self._scratch: bytearray | None = None
        self._wake_r = -1
        if self.spec.wake_fifo:
            r, w = db.open_wake_reader(self.spec.wake_fifo)
            self._res.fds += [r, w]
            self._wake_r = r

    # ---- public

    def try_recv(self) -> list[tuple[int, bytes]]:
        """Every complete record available now, in order, copied out; [] if none.
        Never blocks. Raises PeerDeadError once the producer has closed and everything
        it sent has been read; ClientClosedError."""
        with self._lock:
            if self._closed:
                raise self._closed_error()
            out: list[tuple[int, bytes]] = []
            self._drain(out)
            if not out and self._peer_gone:
                raise PeerDeadError("the producer closed the ring")
            return out

    def recv(self, *, timeout: float | None = None, alive=None) -> list[tuple[int, bytes]]:
        """At least one record: everything available, copied out. Spins ``spin_us``,
        then blocks; ``timeout`` bounds each wait without progress (None: forever);
        ``alive`` runs every ``liveness_interval`` while blocked. Raises
        PeerNotProducingError, PeerDeadError, ClientClosedError."""
        lock = self._lock
        if timeout is None:
            lock.acquire()
        else:
            self._lock_for(timeout)
        try:
            if self._closed:
                raise self._closed_error()
            out: list[tuple[int, bytes]] = []
            while True:
                if self._open or self._items.value:  # skip the set-up when plainly empty
                    self._drain(out)
                    if out:
                        return out
                if self._peer_gone:
                    raise PeerDeadError("the producer closed the ring")
                self._wait_item(timeout, alive)
        finally:
            lock.release()

    def recv_into(
        self, handler: Callable[[int, memoryview], None], *, timeout: float | None = 0.0, alive=None
    ) -> int:
        """Zero-copy receive: call ``handler(rtype, view)`` for every record available,
        in order; ``view`` points into the ring and is valid only during the call (it is
        released afterwards). Each batch is released to the producer once the handler
        has returned for its last record. ``timeout=0`` (default) never blocks and may
        return 0; otherwise waits like ``recv`` for at least one record. Returns the
        number of records handled. If the handler raises, that record counts as
        consumed and the exception propagates; the rest come with the next call."""
        self._lock_for(timeout)
        try:
            if self._closed:
                raise self._closed_error()
            while True:
                count = self._drain_views(handler)
                if count:
                    return count
                if self._peer_gone:
                    raise PeerDeadError("the producer closed the ring")
                if timeout is not None and timeout <= 0:
                    return 0
                self._wait_item(timeout, alive)
        finally:
            self._lock.release()

    def fileno(self) -> int:
        """A descriptor that becomes readable when a batch is published (for
        ``loop.add_reader``). Call ``drain_wake_fd()`` and then ``try_recv()``."""
        if self._closed:
            raise self._closed_error()
        if self._wake_r < 0:
            raise ValueError("this ring was created without consumer_wake_fd=True")
        return self._wake_r

    def drain_wake_fd(self) -> None:
        """Consume pending wake bytes. Never blocks."""
        db.drain_wake(self.fileno())

    # ---- taking batches

    def _take(self) -> bool:
        """Take the token of the next published batch if one is there. Never blocks."""
        items = self._items
        if not items.value:
            return False
        try:
            items.acquire(0)
        except db.BusyError:
            return False
        return self._on_item()

    def _on_item(self) -> bool:
        """An ``items`` token was taken: a batch is there, or the producer closed."""
        if self._closed:
            raise self._closed_error()
        if self._q[_HEAD] > self._taken:
            self._taken += 1
            self._open = True
            return True
        if self._q[_P_CLOSED]:
            self._peer_gone = True
        return False

    def _wait_item(self, timeout, alive) -> None:
        r = db.wait_token(
            self._items, self._q, _HEAD, self._taken, self._spin, timeout, alive,
            self._interval, self._check_wait, self._peer,
        )
        if r == db.TIMED_OUT:
            raise PeerNotProducingError(
                f"the peer is not producing: nothing was published in the ring for {timeout} s"
            )
        if r == db.SPUN:
            self._spins = self._q[_C_SPINS] = self._spins + 1
        else:
            self._blocks = self._q[_C_BLOCKS] = self._blocks + 1
        self._on_item()

    def _release(self) -> None:
        """Give the current batch's space back to the producer."""
        self._open = False
        q = self._q
        q[_C_RECORDS] = self._records
        q[_C_BYTES] = self._bytes
        self._released = q[_TAIL] = self._released + 1
        self._spaces.release()

    # ---- reading

    def _drain(self, out: list) -> None:
        """Copy out every record of every batch available now (about one ring's worth
        at most). Token, read and release are inline here: this is the hot path."""
        items = self._items
        q = self._q
        data = self._data
        cap = self.capacity
        unpack = _REC.unpack_from
        budget = cap
        while budget > 0:
            if not self._open:
                if not items.value:
                    return
                try:
                    items.acquire(0)
                except db.BusyError:
                    return
                # what _on_item() does, inline
                if self._closed:
                    raise self._closed_error()
                if q[_HEAD] <= self._taken:
                    if q[_P_CLOSED]:
                        self._peer_gone = True
                    return
                self._taken += 1
            start = rpos = self._rpos
            pos = rpos % cap
            nrec = nbytes = 0
            while True:
                n, t, f = unpack(data, pos)
                size = (n + 15) & -8
                if f & PAD:
                    size = cap - pos
                elif pos + size > cap:
                    raise self._corrupt(pos, n)
                elif f & (MORE | CONT):
                    msg = self._fragment(t, f, pos, n)
                    if msg is not None:
                        out.append((t, msg.tobytes()))
                        nrec += 1
                        nbytes += len(msg)
                        msg.release()
                else:
                    if self._frag is not None:
                        self._frag = None  # the producer gave up on that message
                    out.append((t, data[pos + 8 : pos + 8 + n].tobytes()))
                    nrec += 1
                    nbytes += n
                rpos += size
                pos += size
                if pos == cap:
                    pos = 0
                if f & EOB:
                    break
            self._rpos = rpos
            budget -= rpos - start
            # release the batch: counters first, then the post that hands the space back
            self._open = False
            self._records = q[_C_RECORDS] = self._records + nrec
            self._bytes = q[_C_BYTES] = self._bytes + nbytes
            self._released = q[_TAIL] = self._released + 1
            self._spaces.release()

    def _drain_views(self, handler) -> int:
        data = self._data
        cap = self.capacity
        unpack = _REC.unpack_from
        count = 0
        budget = cap
        while budget > 0 and (self._open or self._take()):
            while True:  # one batch; state is advanced before the handler runs
                rpos = self._rpos
                pos = rpos % cap
                n, t, f = unpack(data, pos)
                size = (n + 15) & -8
                view = None
                if f & PAD:
                    size = cap - pos
                elif pos + size > cap:
                    raise self._corrupt(pos, n)
                elif f & (MORE | CONT):
                    msg = self._fragment(t, f, pos, n)
                    if msg is not None:
                        view = msg
                else:
                    self._frag = None
                    view = data[pos + 8 : pos + 8 + n]
                self._rpos = rpos + size
                budget -= size
                if view is None:
                    if f & EOB:
                        self._release()
                        break
                    continue
                count += 1
                self._records += 1
                self._bytes += len(view)
                try:
                    handler(t, view)
                finally:
                    try:
                        view.release()
                    except BufferError:
                        pass  # the handler kept an export; its problem to drop it
                    if self._closed:
                        raise self._closed_error()
                    if f & EOB:
                        self._release()
                if f & EOB:
                    break
        return count

    def _fragment(self, t: int, f: int, pos: int, n: int) -> memoryview | None:
        """Copy one fragment into the reassembly buffer; a view of exactly the message
        once complete. The buffer is kept for the next message (up to SCRATCH_KEEP
        bytes), which saves faulting in fresh pages for every large message."""
        data = self._data
        if not f & CONT:
            total = _U64.unpack_from(data, pos + 8)[0]
            if n < 8 or total > MAX_PAYLOAD or n - 8 > total:
                raise self._corrupt(pos, n)
            scratch = self._scratch
            if scratch is not None and len(scratch) >= total:
                buf = memoryview(scratch)[:total]
            else:
                scratch = bytearray(total)
                self._scratch = scratch if total <= SCRATCH_KEEP else None
                buf = memoryview(scratch)
            off = n - 8
            buf[:off] = data[pos + 16 : pos + 8 + n]
            self._frag = buf
        else:
            buf = self._frag
            off = self._frag_off
            if buf is None or off + n > len(buf):
                raise self._corrupt(pos, n)
            buf[off : off + n] = data[pos + 8 : pos + 8 + n]
            off += n
        self._frag_off = off
        if f & MORE:
            return None
        self._frag = None
        if off != len(buf):
            raise self._corrupt(pos, n)
        return buf

    def _corrupt(self, pos: int, n: int) -> RuntimeError:
        return RuntimeError(
            f"ring {self.spec.segment!r} is corrupt: record of {n} bytes at offset {pos} "
            f"of {self.capacity} (read position {self._rpos})"
        )
