"""The writing end of a ring: ``RingProducer`` (``RingProducer.create`` / ``.attach``).

Lowest layer, beside ``ring`` (the shared life cycle and layout; read its docstring
first) and the C end ``_ring.Producer`` (records, wrap-around, fragments, publication);
imports ``ring`` and nothing above it: not ``ring_consumer``, ``waiting`` or asyncio.
It owns writing: ``try_send``, ``send_nowait`` and ``send_batch_nowait`` never wait for
room, and the one wait for it is ``wait_writable`` (``wait_send``), a single spin then
sleep; with ``abandon`` these are the wait handle through which ``shmclient.waiting``
sends with a deadline and a liveness check, or ``space_fileno`` / ``arm_space`` for an
event loop. A message longer than ``max_record`` is written in fragments as room allows;
when the ring fills half-way, sending the same payload again resumes at the fragment
where it stopped.
"""

from __future__ import annotations

import os
from typing import Sequence

from . import _ring
from .doorbell import drain_pipe
from .errors import WouldBlock
from .ring import MAX_PAYLOAD, BytesLike, Ring, _as_bytes


def _too_big(n: int) -> ValueError:
    return ValueError(f"payload of {n} bytes is larger than a message can carry ({MAX_PAYLOAD} bytes)")


def _nbytes(payload) -> int:
    return payload.nbytes if isinstance(payload, memoryview) else len(payload)


class RingProducer(Ring):
    """The writing end."""

    role = "producer"
    _peer = "consumer"
    _reads_space = True

    def _make_end(self, res):
        end = _ring.Producer(res.seg.buf, res.wake_w)
        self._frag_chunk = max(8, (self.capacity // 4 - 16) & -8)
        #: A fragmented message half-way: (type, payload as given, bytes written).
        self._partial: tuple[int, object, int, int] | None = None
        return end

    # ---- public

    def try_send(self, rtype: int, payload: BytesLike) -> bool:
        """Write one record and publish it if it fits now; False if it does not (a
        message longer than ``max_record`` never fits here: use ``send_nowait``), and
        False whatever the room while a fragmented message is half-way
        (``partial_pending``, also after ``abandon``): it never lands between its
        fragments; ``send_nowait`` resumes that message, or sends another record first
        (the consumer then drops the half-sent one). Never
        waits for space (it may wait for another thread of this side to finish its call).
        Raises ValueError (type not in 0..255, payload over MAX_PAYLOAD), PeerDeadError
        (the consumer closed), ClientClosedError."""
        try:
            if self._c.try_send(rtype, payload):  # fast path: no lock, one C call
                return True
        except OverflowError:
            pass
        with self._lock:
            if self._closed:
                raise self._closed_error()
            if self._partial is not None:
                return False  # a fragmented message is half-way: it goes first
            try:
                r = self._c.try_send(rtype, payload, True)
            except OverflowError:
                if _nbytes(payload) > MAX_PAYLOAD:
                    raise _too_big(_nbytes(payload)) from None
                return False
            if r is None:
                raise self._peer_dead()
            return r

    def send_nowait(self, rtype: int, payload: BytesLike) -> None:
        """Write and publish one message without waiting for room: raises WouldBlock when
        the ring has none now. A message longer than ``max_record`` goes in fragments: as
        many as fit now are written, then WouldBlock; calling again with the same payload
        resumes after them (any other record sent first makes the consumer drop the
        partial message; a mutable buffer passed again must hold what it held: one
        resized since starts the message anew). May wait for another thread of this side to finish its own
        non-blocking call. Raises ValueError (type not in 0..255, payload over
        MAX_PAYLOAD), PeerDeadError (the consumer closed), ClientClosedError."""
        try:
            if self._c.try_send(rtype, payload):  # fast path: no lock, one C call
                return
        except OverflowError:
            pass
        with self._lock:
            c = self._c
            if self._closed:
                raise self._closed_error()
            c.held = True
            try:
                off = self._resume_at(rtype, payload)
                if off is not None:
                    self._fragments_nowait(rtype, payload, off)
                    return
                try:
                    r = c.try_send(rtype, payload, True)
                except OverflowError:  # longer than one record: fragments
                    self._fragments_nowait(rtype, payload, 0)
                    return
                if r is None:
                    raise self._peer_dead()
                if not r:
                    raise WouldBlock(f"the ring is full ({c.pending()} of {self.capacity} bytes unread)")
            finally:
                # a message left half-way keeps the fast path closed: nothing may be
                # written between its fragments
                c.held = self._partial is not None

    def send_batch_nowait(self, records: Sequence[tuple[int, BytesLike]]) -> int:
        """Write as many of ``records`` (``(type, payload)`` pairs) as fit now, in order,
        and publish them together (one doorbell, one wake-up of the consumer); return how
        many went. The rest did not fit: send them with the next call (or wait for room
        first). Raises WouldBlock when not even the first fits. A batch carries records
        of up to ``max_record`` bytes: the batch stops before a longer one (it goes alone
        with ``send_nowait``), and ValueError when it comes first. A fragmented message
        left half-way is given up (the consumer drops it). Raises as ``send_nowait``."""
        with self._lock:
            c = self._c
            if self._closed:
                raise self._closed_error()
            c.held = True
            self._partial = None
            n = 0
            try:
                for rtype, payload in records:
                    try:
                        r = c.append(rtype, payload, True)
                    except OverflowError:
                        if n:
                            break
                        size = _nbytes(payload)
                        if size > MAX_PAYLOAD:
                            raise _too_big(size) from None
                        raise ValueError(f"a record of {size} bytes is longer than one record of "
                                         f"this ring ({self.max_record} bytes): send it with "
                                         "send_nowait()") from None
                    if r is None:
                        raise self._peer_dead()
                    if not r:
                        break
                    n += 1
            finally:
                if not self._closed:
                    c.publish()
                c.held = False
            if not n and records:
                raise WouldBlock(f"the ring is full ({c.pending()} of {self.capacity} bytes unread)")
            return n

    def drop_partial(self, payload: BytesLike) -> None:
        """``payload``, left half-way, will not be sent again: forget it, so that any
        record may go next (``try_send`` too; the consumer drops the fragments it has of
        it when that record comes). A payload that is not the one half-way changes
        nothing. Never blocks for long (another thread's non-blocking call at most)."""
        with self._lock:
            if self._partial is not None and self._partial[1] is payload:
                self._partial = None
                self._c.held = False

    def abandon(self, payload: BytesLike) -> None:
        """A send of ``payload`` gave up (the wait handle's call, see ``shmclient.waiting``).
        Nothing to do for a bare ring end: a fragmented message left half-way needs no
        forgetting here, because sending the same payload again resumes it, and any
        other record sent first makes the consumer drop it (``partial_pending`` says one
        is half-way). Whoever shares an end between senders decides who goes next (the
        channel does)."""

    def wait_writable(self, timeout: float, *, spin: float | None = None, first: bool = True) -> bool:
        """Wait, once, for the consumer to release space since the last write that did
        not fit: spin (``spin`` seconds, None: the adaptive budget), then sleep up to
        ``timeout`` seconds. True when space was released or the consumer closed (the
        next send says which), False on the timeout. No liveness check, no retry (see
        ``shmclient.waiting``). Raises ClientClosedError or what a signal handler raised."""
        return self._wait_once(self._c.wait_space, timeout, spin, first)

    #: The wait handle's name for ``wait_writable`` (``shmclient.waiting.send``).
    wait_send = wait_writable

    def poke(self) -> None:
        """Write a wake byte to the consumer's wake pipe now, whether or not anything was
        published (an early wake-up: the consumer then looks and finds nothing, or what
        was published meanwhile). A no-op without a wake pipe or once closed; never
        blocks (a full pipe is readable already), but may wait for another thread of this
        side to finish its non-blocking call: the byte is written under the lock, because
        a close waits for this lock before it closes the pipe, whose number may be
        another file's after (an uncontended lock costs well under a microsecond)."""
        if self._closed:  # (first without the lock: a forked child's, whose holder may not exist there)
            return
        with self._lock:
            fd = self._res.wake_w
            if fd < 0 or self._closed:
                return
            try:
                os.write(fd, b"\1")
            except OSError:  # full (already readable), or the consumer is gone
                pass

    @property
    def quiet(self) -> bool:
        """While True, a publish stores the new records but does not wake the consumer:
        the wake-up is owed until ``wake_owed()`` (whoever sets it must call that)."""
        return self._c.quiet

    @quiet.setter
    def quiet(self, value: bool) -> None:
        self._c.quiet = value

    def wake_owed(self) -> bool:
        """Wake the consumer if a publish while ``quiet`` held its wake-up back; whether
        one was owed. Never blocks; False once this end is closed (the close woke it)."""
        return self._c.wake_owed()

    @property
    def partial_pending(self) -> bool:
        """A fragmented message is half-way (``send_nowait`` ran out of room): it must
        be finished before any other record goes."""
        return self._partial is not None

    def space_fileno(self) -> int:
        """A descriptor that turns readable when the consumer released space after
        ``arm_space()`` (for ``loop.add_reader``). Needs ``producer_wake_fd=True`` at
        creation. Does not block."""
        if self._closed:
            raise self._closed_error()
        if self._res.space_r < 0:
            raise ValueError("this ring was created without producer_wake_fd=True")
        return self._res.space_r

    def arm_space(self) -> None:
        """Drain the space pipe and ask the consumer for a byte at its next release;
        then retry the send (no wake-up is lost between the two). ClientClosedError
        once closed (the pipe's number may be another file's by then: a close waits for
        this lock before it closes the pipe). Does not block."""
        with self._lock:
            if self._closed:
                raise self._closed_error()
            if self._res.space_r >= 0:
                drain_pipe(self._res.space_r)
            self._c.arm_space()

    # ---- fragments

    def _resume_at(self, rtype: int, payload) -> int | None:
        """Where to resume ``payload`` if it is the fragmented message left half-way,
        else None; either way the half-way message is forgotten here (anything else sent
        first makes the consumer drop it). Caller holds the lock."""
        partial, self._partial = self._partial, None
        if partial is None:
            return None
        ptype, ppayload, off, plen = partial
        if ptype != rtype:
            return None
        if ppayload is payload:
            # (a mutable buffer resized since: its fragments would not add up to the total
            # the first one announced, and the consumer would close the ring)
            return off if type(payload) is bytes or _as_bytes(payload).nbytes == plen else None
        try:  # an equal copy resumes too (compared as bytes: any buffer, any format)
            return off if _as_bytes(ppayload) == _as_bytes(payload) else None
        except TypeError:
            return None

    def _fragments_nowait(self, rtype: int, payload, off: int) -> None:
        data = payload if type(payload) is bytes else _as_bytes(payload)
        n = len(data)
        if n > MAX_PAYLOAD:
            raise _too_big(n)
        new = self._c.send_part(rtype, data, off, self._frag_chunk)
        if new is None:
            raise self._peer_dead()
        if new < n:
            # the payload as given: a retry passes the same object (compared by identity;
            # a mutable one must keep its content meanwhile, see send_nowait)
            self._partial = (rtype, payload, new, n)
            raise WouldBlock(f"{new} of {n} bytes of a fragmented message written; the ring is full")
