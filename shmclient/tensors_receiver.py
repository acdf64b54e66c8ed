"""The receiving side of the tensor transport: ``ShmTensorReceiver`` (see ``tensors``).

Transport layer under the codec: imports ``shm``, ``tensors_handles``, ``errors``,
numpy and the standard library (``tensors_cuda``, and with it torch, lazily, on the first
CUDA handle); never the sender, the codec, ``waiting``, asyncio, clients or the engine. It
owns turning a checked handle back into bytes (a copy below ``view_from``, else a
zero-copy view whose death queues the release), mapping one-off segments of the peer,
and the queue of ids ``take_releases()`` hands back. Nothing here blocks.
"""

from __future__ import annotations

import collections
import struct
import threading
import weakref
from typing import Any

import numpy as np

from . import forksafe
from .errors import SerializationError
from .shm import Segment
from .tensors_handles import ALIGN, ARENA, ONE_OFF, check_handle

__all__ = ["VIEW_FROM", "ShmTensorReceiver"]

#: Default size from which a received block is a zero-copy view (below: copied out).
VIEW_FROM = 64 * 1024


class ShmTensorReceiver:
    """Opens the peer sender's handles from the arena ``segment`` it attached.

    Takes ownership of ``segment``: ``close()`` closes it; the mapping itself lives on
    until the last received view is dropped. ``view_from``: blocks of at least this many
    bytes are zero-copy views (see the module docstring); 0 makes every block a view,
    a huge value makes every block a copy. ``get`` is called by the decoding thread;
    ``take_releases`` may be called from any thread; views may die in any thread.
    """

    def __init__(
        self, segment: Segment, *, view_from: int = VIEW_FROM, enable_cuda_ipc: bool = True
    ) -> None:
        self._seg = segment
        #: Whether CUDA IPC handles are opened at all (else refused before anything).
        self.enable_cuda_ipc = enable_cuda_ipc
        self._buf = segment.buf
        self._size = segment.size
        self.view_from = view_from
        self._released: collections.deque[int] = collections.deque()
        self._take_lock = threading.Lock()
        #: Ids waiting for ``take_releases``; a transport may test it for emptiness
        #: without a lock to skip the flush on its hot path.
        self.pending = self._released
        self._live: dict[int, weakref.ref] = {}
        self._cuda: Any = None
        self._closed = False
        #: The sender's pid: a one-off handle must name one of its segments (None: any
        #: pid, for a pair in one process). Set from the handshake.
        self.peer_pid: int | None = None
        forksafe.register(self)

    def get(self, handle: list, nbytes: int) -> np.ndarray:
        """A 1-D uint8 array of the block's bytes, valid for as long as it (or anything
        made from it) lives. Raises ``SerializationError`` for a malformed handle or a
        one-off segment that is gone. Does not block."""
        if self._closed:
            raise SerializationError("tensor receiver is closed")
        try:
            kind, bid, where = check_handle(handle, nbytes)
        except SerializationError:
            self.release_unopened(handle)  # its block (if it names one) goes back by id
            raise
        if kind == ARENA:
            if type(where) is not int or where < 0 or where % ALIGN or where + nbytes > self._size:
                self._released.append(bid)  # not opened: the sender frees it by id
                raise SerializationError(f"tensor block {bid} [{where}, +{nbytes}) is outside the arena")
            mv = self._buf[where : where + nbytes]
            if nbytes < self.view_from:
                out = np.frombuffer(mv, np.uint8).copy()
                mv.release()
                self._released.append(bid)
                return out
            return self._watch(np.frombuffer(mv, np.uint8), bid)
        if kind == ONE_OFF:
            return self._get_oneoff(bid, where, nbytes)
        raise SerializationError(f"unknown tensor handle kind {kind!r}")

    def _get_oneoff(self, bid: int, name: str, nbytes: int) -> np.ndarray:
        try:
            seg = Segment.attach_private(name, self.peer_pid)
        except FileNotFoundError as e:
            self._released.append(bid)
            raise SerializationError(f"one-off tensor segment {name} is gone (sender closed?)") from e
        except (ValueError, OSError) as e:
            self._released.append(bid)
            raise SerializationError(f"one-off tensor segment {name} refused: it is gone or "
                                     f"not a sealed segment of the sender: {e}") from None
        self._released.append(bid)
        if seg.size < nbytes:
            seg.close()
            raise SerializationError(f"one-off segment {name} holds {seg.size} bytes, need {nbytes}")
        mv = seg.buf[:nbytes]
        seg.close()  # the mapping lives on in ``mv`` until the last view is dropped
        return np.frombuffer(mv, np.uint8)

    def _watch(self, arr: np.ndarray, bid: int) -> np.ndarray:
        # numpy sets the base of every view made from ``arr`` (slices, reshapes, dtype
        # views, frombuffer) to ``arr`` itself, the last array before the non-array base,
        # and torch.frombuffer / from_numpy keep it too; so the death of ``arr`` is
        # exactly "nobody reads this block any more". (A weakref on the memoryview would
        # fire too early: numpy keeps a memoryview of its own.)
        released, live = self._released, self._live

        def dropped(_ref, bid=bid):
            released.append(bid)  # atomic; no lock, so safe inside GC in any thread
            live.pop(bid, None)

        live[bid] = weakref.ref(arr, dropped)
        return arr

    def get_cuda(self, handle: list) -> Any:
        """Open a CUDA IPC handle (cached per allocation; checked first by
        ``tensors_cuda.check_handle``). Refused (``SerializationError``, nothing opened)
        when this receiver was made with ``enable_cuda_ipc=False``."""
        if not self.enable_cuda_ipc:
            raise SerializationError(
                "message carries a CUDA IPC handle but this side has enable_cuda_ipc=False: "
                "refused, nothing was opened")
        if self._cuda is None:
            from .tensors_cuda import CudaIpcReceiver

            self._cuda = CudaIpcReceiver(self.peer_pid)
        return self._cuda.open(handle, self._released)

    def cuda_index_for_uuid(self, uuid: str) -> int | None:
        """This process's CUDA device index for a GPU UUID, or None."""
        from .gpus import local_index_for_uuid

        return local_index_for_uuid(uuid)

    def release_unopened(self, handle: Any) -> None:
        """A handle its sender placed for a message this side will not decode (the
        decode failed before reaching it): queue its block's release, opening nothing
        (an arena block, a one-off segment or a CUDA share: the sender frees it by id).
        A handle without a block id that is a u64 > 0 is ignored. Does not block."""
        if type(handle) is list and len(handle) > 1:
            bid = handle[1]
            if type(bid) is int and 0 < bid < 1 << 64:
                self._released.append(bid)

    def take_releases(self) -> bytes | None:
        """The ids finished with since the last call, packed for ``on_release``; None if
        there are none. Thread-safe, does not block. A signal handler's exception inside
        it loses no id (``peek_releases``)."""
        with self._take_lock:
            got = self.peek_releases()
            if got is None:
                return None
            count, payload = got
            try:
                self.drop_releases(count)
            except BaseException:  # (queued again: those not dropped yet go twice)
                self._released.extendleft(reversed(struct.unpack(f"<{count}Q", payload)))
                raise
            return payload

    def peek_releases(self) -> tuple[int, bytes] | None:
        """How many ids are finished with, and those ids packed for ``on_release``,
        leaving them queued: the caller keeps the payload where it cannot be lost, then
        calls ``drop_releases(count)``. An exception anywhere on the way (Ctrl-C) then
        loses none; at worst an id is sent twice, which the sender ignores (ids are
        never reused). One caller at a time (a channel's send lock); None if none."""
        ids = list(self._released)  # (one C call: no signal lands inside it)
        if not ids:
            return None
        return len(ids), struct.pack(f"<{len(ids)}Q", *ids)

    def drop_releases(self, count: int) -> None:
        """Take the ``count`` oldest ids, which ``peek_releases`` handed out, off the
        queue (ids queued since stay)."""
        q = self._released
        for _ in range(count):
            q.popleft()

    def in_use(self) -> int:
        """How many zero-copy views of the arena are still alive."""
        return len(self._live)

    def _forget_after_fork(self) -> None:
        """In a forked child: let go of this process's copy of the arena's mapping (a
        tensor received before the fork keeps it while it lives here)."""
        self._closed = True
        self._buf = None  # type: ignore[assignment]
        self._seg.close()

    def close(self) -> None:
        """Stop receiving and unmap (deferred until received views are gone). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._buf = None  # type: ignore[assignment]
        if self._cuda is not None:
            self._cuda.close()
        self._seg.close()
