"""Out-of-band tensor transport: CPU tensors through a shared-memory arena, CUDA by IPC.

Transport layer under the codec: imports ``shm``, ``errors``, numpy, torch and the
standard library (``tensors_cuda`` lazily, on the first CUDA tensor); never clients,
asyncio, the engine or the codec. It owns one arena per direction: a ``Segment`` that
the connection's owner created and both sides mapped. The sending side
(``ShmTensorSender``) allocates blocks in it, copies each tensor in once and sends a
handle ``[ARENA, id, offset]`` inside the message; the receiving side
(``ShmTensorReceiver``) turns the handle back into bytes and later hands the ids it is
done with back through ``take_releases()``, which the channel carries to the sender's
``on_release()``. Only then is a block reused, so a block is never rewritten while the
receiver may still read it, and releases may come in any order.

Receive policy (measured; the figures are in ``RECEIVE_POLICY`` below): blocks of at least
``view_from`` bytes (default 64 KiB) are handed out as zero-copy views whose lifetime
keeps the block allocated; the release is queued by a weakref callback on the block's
ndarray (the base of every numpy view and the buffer owner of every tensor made from it)
when the last of them is dropped: a deque append, safe from any thread and during GC,
never a lock. Smaller blocks are copied out and released at once: the copy costs about
the same as tracking a view and the block returns to the arena immediately. The sender
copies in with numpy (a memcpy; split over short-lived threads from 8 MiB up).

When the arena is full or a tensor is bigger than it, the sender does not wait: it
puts the tensor in a one-off segment of its own (a memfd, see ``shm``) and sends
``[ONE_OFF, id, handle]``. The receiver maps it and releases the id; the sender keeps the
handles of one-offs still in flight open and closes each when its release comes back (or
in ``close()``). Nothing is named, so a one-off whose sender or receiver is killed at any
moment is freed with the last process that maps it. If the memory cannot be reserved,
``put`` declines and the codec sends the bytes inline. Nothing here blocks.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import logging
import os
import struct
import threading
import weakref
from typing import Any

import numpy as np
import torch

from .errors import SerializationError, ShmCapacityError
from .shm import Segment

__all__ = ["ShmTensorSender", "ShmTensorReceiver", "ARENA", "ONE_OFF", "CUDA_IPC"]

log = logging.getLogger("shmclient")

#: Handle kinds (first element of a handle).
ARENA, ONE_OFF, CUDA_IPC = 0, 1, 2
#: Block alignment in the arena: a cache line multiple, and enough for any dtype view.
ALIGN = 256
#: Default size from which a received block is a zero-copy view (below: copied out).
VIEW_FROM = 64 * 1024

#: Contiguous copies of at least this size are split over ``_WORKERS`` threads.
PARALLEL_FROM = 8 * 1024 * 1024
_WORKERS = min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)

_ID = struct.Struct("<Q")

RECEIVE_POLICY = """
Receiver side of one block (get + wrap as a tensor + drop + release round trip), median,
3 runs, 2-core x86-64 VM with a load average of ~3.5 from other work:
  size     copy out + immediate release   zero-copy view + weakref release
  4 KiB    8.6-9.0 us                      8.6-9.2 us
  16 KiB   8.9-9.9 us                      8.9-9.5 us
  64 KiB   10.5-11.4 us                    9.1-9.5 us
  1 MiB    95-123 us                       17-23 us
  64 MiB   23.6-32.1 ms                    0.12-0.16 ms
Below 64 KiB the copy costs at most ~1.5 us more and gives the block back at once, so a
small tensor the user keeps for long never pins (and fragments) the arena; from 64 KiB
up the view wins, and for large tensors it is what keeps a transfer near one memcpy.
"""


def _int_view(dtype: torch.dtype) -> torch.dtype:
    """A same-sized dtype numpy knows, for any torch dtype (bfloat16, uint1..7, float8...)."""
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(
        dtype.itemsize, dtype
    )


def _copy_in(dst: np.ndarray, src: Any) -> None:
    """Write ``src``'s values in C order into the flat uint8 array ``dst``.

    Copies with numpy (a memcpy, split over a few threads from ``PARALLEL_FROM`` up, or a
    strided loop): torch's OpenMP ``copy_`` matched the split copy on an idle 2-core host
    but was 1.5-100x slower than one memcpy when the cores were busy.
    """
    if isinstance(src, torch.Tensor):
        src = src.view(_int_view(src.dtype)).numpy()  # shares memory, any strides
    if src.flags.c_contiguous:
        flat = src.reshape(-1).view(np.uint8)
        if flat.nbytes >= PARALLEL_FROM and _WORKERS > 1:
            _split_copy(dst, flat)
        else:
            np.copyto(dst, flat)
    else:
        np.copyto(dst.view(src.dtype).reshape(src.shape), src, casting="no")


def _split_copy(dst: np.ndarray, src: np.ndarray) -> None:
    """memcpy in ``_WORKERS`` chunks on short-lived threads (numpy drops the GIL while
    copying). Threads are started and joined here, so none outlives the call; unlike an
    OpenMP pool they never spin, so a busy host degrades this to about one memcpy."""
    n = src.nbytes
    step = -(-n // _WORKERS) + 63 & ~63
    threads = [
        threading.Thread(target=np.copyto, args=(dst[i : i + step], src[i : i + step]), daemon=True)
        for i in range(step, n, step)
    ]
    for t in threads:
        t.start()
    try:
        np.copyto(dst[:step], src[:step])
    finally:
        for t in threads:
            t.join()


class ShmTensorSender:
    """Writes tensors into the arena ``segment`` (one copy in) and tracks their blocks.

    Takes ownership of ``segment``: ``close()`` closes it (its creator still unlinks it).
    ``enable_cuda_ipc``: share CUDA tensors by IPC handle (else host copies);
    ``peer_gpu_uuids``: the GPUs the receiver sees (from the handshake); ``None`` means
    unknown, assumed the same machine's GPUs. Thread-safe: ``put`` and ``on_release`` may
    be called from different threads. Nothing blocks.
    """

    def __init__(
        self,
        segment: Segment,
        *,
        enable_cuda_ipc: bool = True,
        peer_gpu_uuids: "list[str] | None" = None,
    ) -> None:
        self._seg = segment
        self._lock = threading.Lock()
        self._arena = np.frombuffer(segment.buf, np.uint8)
        self._usable = usable = segment.size - segment.size % ALIGN
        #: A segment not yet reserved is reserved on the first tensor that needs it.
        self._lazy = usable > 0 and not segment.reserved
        self._free: list[list[int]] = [[0, usable]] if usable and not self._lazy else []  # sorted [offset, size]
        self._blocks: dict[int, tuple[int, int]] = {}  # id -> (offset, size)
        self._oneoffs: dict[int, Segment] = {}  # id -> segment, its handle still open
        self._ids = itertools.count(1)
        self._cuda_args = (enable_cuda_ipc, peer_gpu_uuids)
        self._cuda: Any = None
        self._closed = False
        self._used = self._peak = 0
        self._n = collections.Counter()

    def set_peer_gpus(self, peer_gpu_uuids: "list[str] | None") -> None:
        """The GPUs the receiver sees, once the handshake has told us (before any send)."""
        with self._lock:
            self._cuda_args = (self._cuda_args[0], peer_gpu_uuids)
            if self._cuda is not None:
                self._cuda.peer = None if peer_gpu_uuids is None else set(peer_gpu_uuids)

    # -- sending --------------------------------------------------------------------------

    def put(self, src: Any, nbytes: int) -> list | None:
        """Copy ``src`` (CPU tensor or ndarray, any strides) into shared memory.

        Returns the handle to put in the message, or None when neither the arena nor a
        one-off segment can take it (the codec then sends it inline). Does not block.
        """
        if self._closed:
            raise SerializationError("tensor sender is closed")
        if nbytes <= 0:
            return None  # nothing to place: inline is free
        with self._lock:
            if self._lazy:
                self._reserve_arena()
            offset = self._alloc(nbytes)
            if offset is not None:
                bid = next(self._ids)
                self._blocks[bid] = (offset, _round(nbytes))
                self._n["arena"] += 1
        if offset is not None:
            try:
                _copy_in(self._arena[offset : offset + nbytes], src)
            except BaseException:
                self.cancel([ARENA, bid, offset])
                raise
            return [ARENA, bid, offset]
        return self._put_oneoff(src, nbytes)

    def _reserve_arena(self) -> None:
        """First tensor: reserve the arena's memory (checked against the memory limits;
        on failure the arena stays unused and tensors go as one-offs or inline). Caller
        holds the lock."""
        self._lazy = False
        try:
            self._seg.reserve()
        except ShmCapacityError as e:
            log.warning("tensor arena of %d bytes not used: %s", self._seg.size, e)
            return
        self._free = [[0, self._usable]]

    def _put_oneoff(self, src: Any, nbytes: int) -> list | None:
        try:
            seg = Segment.create(nbytes, prefix="shmc-t")
        except (ShmCapacityError, OSError) as e:
            self._n["inline_fallback"] += 1
            log.warning("tensor of %d bytes sent inline: %s", nbytes, e)
            return None
        try:
            dst = np.frombuffer(seg.buf, np.uint8)
            _copy_in(dst, src)
            del dst
        except BaseException:
            seg.close()
            seg.release_handle()
            raise
        seg.close()  # unmapped here; the handle stays open until the receiver releases it
        bid = next(self._ids)
        with self._lock:
            self._oneoffs[bid] = seg
            self._n["one_off"] += 1
        return [ONE_OFF, bid, seg.name]

    def put_cuda(self, tensor: torch.Tensor) -> list | None:
        """Share a CUDA tensor by IPC handle; None means "send a host copy" (logged once)."""
        if self._cuda is None:
            from .tensors_cuda import CudaIpcSender

            self._cuda = CudaIpcSender(*self._cuda_args)
        handle = self._cuda.share(tensor, next(self._ids))
        if handle is not None:
            self._n["cuda"] += 1
        return handle

    def cancel(self, handle: list) -> None:
        """Free a handle whose message will not be sent (a failed encode). Idempotent."""
        self._free_ids([handle[1]])

    def on_release(self, payload: bytes) -> None:
        """Free the blocks named in a peer's ``take_releases()`` payload (any order).

        Unknown ids (already freed, or after close) are ignored. Does not block.
        """
        ids = [i for (i,) in _ID.iter_unpack(payload)]
        self._free_ids(ids)

    def _free_ids(self, ids) -> None:
        segs = []
        with self._lock:
            for bid in ids:
                blk = self._blocks.pop(bid, None)
                if blk is not None:
                    self._release(*blk)
                    self._n["released"] += 1
                    continue
                seg = self._oneoffs.pop(bid, None)
                if seg is not None:
                    segs.append(seg)
                    self._n["released"] += 1
                elif self._cuda is not None and self._cuda.release(bid):
                    self._n["released"] += 1
        for seg in segs:
            seg.release_handle()

    # -- allocator (first fit over a sorted free list, coalescing on free) -------------------

    def _alloc(self, nbytes: int) -> int | None:
        size = _round(nbytes)
        for i, ext in enumerate(self._free):
            if ext[1] >= size:
                offset = ext[0]
                if ext[1] == size:
                    del self._free[i]
                else:
                    ext[0] += size
                    ext[1] -= size
                self._used += size
                self._peak = max(self._peak, self._used)
                return offset
        return None

    def _release(self, offset: int, size: int) -> None:
        self._used -= size
        free = self._free
        i = bisect.bisect_left(free, [offset, 0])
        if i > 0 and free[i - 1][0] + free[i - 1][1] == offset:  # merge with left
            free[i - 1][1] += size
            if i < len(free) and offset + size == free[i][0]:  # and right
                free[i - 1][1] += free[i][1]
                del free[i]
        elif i < len(free) and offset + size == free[i][0]:  # merge with right
            free[i][0] = offset
            free[i][1] += size
        else:
            free.insert(i, [offset, size])

    # -- state ------------------------------------------------------------------------------

    def stats(self) -> dict:
        """Arena usage and counters (a snapshot; does not block)."""
        with self._lock:
            return {
                "arena_bytes": self._seg.size,
                "used_bytes": self._used,
                "peak_used_bytes": self._peak,
                "blocks_in_flight": len(self._blocks),
                "one_offs_in_flight": len(self._oneoffs),
                "cuda_in_flight": self._cuda.in_flight() if self._cuda is not None else 0,
                "free_extents": len(self._free),
                "sent_arena": self._n["arena"],
                "sent_one_off": self._n["one_off"],
                "sent_cuda": self._n["cuda"],
                "sent_inline_fallback": self._n["inline_fallback"],
                "released": self._n["released"],
            }

    def close(self) -> None:
        """Unlink one-offs still in flight, drop shared CUDA tensors, unmap. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            segs, self._oneoffs = list(self._oneoffs.values()), {}
            self._blocks.clear()
        for seg in segs:
            seg.release_handle()
        if self._cuda is not None:
            self._cuda.close()
        self._arena = None  # type: ignore[assignment]
        self._seg.close()


_U64 = 1 << 64


def _check_handle(handle: Any, nbytes: Any) -> tuple[int, int, Any]:
    """``(kind, block id, where)`` of an ``[ARENA, id, offset]`` or ``[ONE_OFF, id,
    segment handle]`` handle from the wire, or ``SerializationError`` (nothing queued
    for release: an id that is not a u64 would break the release record)."""
    if type(handle) is not list or len(handle) != 3:
        raise SerializationError("malformed tensor handle: expected [kind, id, where]")
    kind, bid, where = handle
    if type(bid) is not int or not 0 < bid < _U64:
        raise SerializationError(f"malformed tensor handle: block id {bid!r} is not a u64 > 0")
    if type(nbytes) is not int or nbytes < 0:
        raise SerializationError(f"malformed tensor length {nbytes!r}")
    if kind == ARENA:
        if type(where) is not int:
            raise SerializationError(f"malformed tensor handle: offset {where!r} is not an int")
    elif kind == ONE_OFF:
        if type(where) is not str or len(where) > 100:
            raise SerializationError("malformed one-off tensor handle")
    else:
        raise SerializationError(f"unknown tensor handle kind {kind!r}")
    return kind, bid, where


def _round(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


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
        #: Ids waiting for ``take_releases``; a transport may test it for emptiness
        #: without a lock to skip the flush on its hot path.
        self.pending = self._released
        self._live: dict[int, weakref.ref] = {}
        self._cuda: Any = None
        self._closed = False
        #: The sender's pid: a one-off handle must name one of its segments (None: any
        #: pid, for a pair in one process). Set from the handshake.
        self.peer_pid: int | None = None

    def get(self, handle: list, nbytes: int) -> np.ndarray:
        """A 1-D uint8 array of the block's bytes, valid for as long as it (or anything
        made from it) lives. Raises ``SerializationError`` for a malformed handle or a
        one-off segment that is gone. Does not block."""
        if self._closed:
            raise SerializationError("tensor receiver is closed")
        kind, bid, where = _check_handle(handle, nbytes)
        if kind == ARENA:
            if type(where) is not int or where < 0 or where % ALIGN or where + nbytes > self._size:
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

    def get_cuda(self, handle: list) -> torch.Tensor:
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
        from .tensors_cuda import local_index_for_uuid

        return local_index_for_uuid(uuid)

    def take_releases(self) -> bytes | None:
        """The ids finished with since the last call, packed for ``on_release``; None if
        there are none. Thread-safe, does not block."""
        q = self._released
        if not q:
            return None
        ids = []
        try:
            while True:
                ids.append(q.popleft())
        except IndexError:
            pass
        return struct.pack(f"<{len(ids)}Q", *ids)

    def in_use(self) -> int:
        """How many zero-copy views of the arena are still alive."""
        return len(self._live)

    def close(self) -> None:
        """Stop receiving and unmap (deferred until received views are gone). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._buf = None  # type: ignore[assignment]
        if self._cuda is not None:
            self._cuda.close()
        self._seg.close()
