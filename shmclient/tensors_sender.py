"""The sending side of the tensor transport: ``ShmTensorSender`` (see ``tensors``).

Transport layer under the codec: imports ``shm``, ``tensors_handles``, ``stats``,
``errors``, numpy and the standard library (never torch itself: a tensor it is given
comes from a process that has imported torch; ``tensors_cuda`` lazily, on the first CUDA
tensor); never the receiver, the codec, ``waiting``, asyncio, clients or the
engine. It owns the sender's arena: a first-fit allocator over a sorted free list that
coalesces on free, the copy of each tensor into its block (one memcpy, split over
short-lived threads from ``PARALLEL_FROM`` up), one-off segments for what the arena
cannot take, the ids still in flight until the receiver's release comes back, and the
sender's ``TensorStatistics``. Nothing here blocks.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import logging
import os
import sys
import threading
from typing import Any

import numpy as np

from . import forksafe
from .errors import SerializationError, ShmCapacityError
from .shm import Segment
from .stats import TensorStatistics
from .tensors_handles import ALIGN, ARENA, ONE_OFF, RELEASE_ID, round_block

__all__ = ["PARALLEL_FROM", "ShmTensorSender"]

log = logging.getLogger("shmclient")

#: Contiguous copies of at least this size are split over ``_WORKERS`` threads.
PARALLEL_FROM = 8 * 1024 * 1024
_WORKERS = min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def _int_view(dtype: Any) -> Any:
    """A same-sized dtype numpy knows, for any torch dtype (bfloat16, uint1..7, float8...)."""
    torch = sys.modules["torch"]  # a tensor exists, so torch is imported
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(
        dtype.itemsize, dtype
    )


def _copy_in(dst: np.ndarray, src: Any) -> None:
    """Write ``src``'s values in C order into the flat uint8 array ``dst``.

    Copies with numpy (a memcpy, split over a few threads from ``PARALLEL_FROM`` up, or a
    strided loop), not torch's OpenMP ``copy_``, which degrades badly on a busy host
    (docs/measurements.md).
    """
    if not isinstance(src, np.ndarray):  # a CPU torch.Tensor (the codec passes no other)
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
    copying). None copies into ``dst`` after the call: on success all have copied; on an
    exception (a signal handler's too) those copying are waited for, those not yet
    started never copy, so the caller may free the block at once. Unlike an OpenMP pool
    they never spin, so a busy host degrades this to about one memcpy."""
    n = src.nbytes
    step = -(-n // _WORKERS) + 63 & ~63
    copiers = _Copiers()
    threads = [
        threading.Thread(target=copiers.copy, args=(dst[i : i + step], src[i : i + step]), daemon=True)
        for i in range(step, n, step)
    ]
    try:
        for t in threads:
            t.start()
        np.copyto(dst[:step], src[:step])
        copiers.wait_done(len(threads))
    except BaseException:
        copiers.abandon()
        raise


class _Copiers:
    """The copier threads of one split copy: how many copy now and how many are done.
    Waited for with a Condition, not ``Thread.join``: a join that a signal handler's
    exception interrupts may leave a running thread marked as stopped, so joining again
    would not wait for it."""

    __slots__ = ("cond", "running", "done", "abandoned")

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.running = self.done = 0
        self.abandoned = False

    def copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        cond = self.cond
        with cond:
            if self.abandoned:  # the call gave up before this thread ran: no copy
                self.done += 1
                cond.notify_all()
                return
            self.running += 1
        try:
            np.copyto(dst, src)
        finally:
            with cond:
                self.running -= 1
                self.done += 1
                cond.notify_all()

    def wait_done(self, n: int) -> None:
        with self.cond:
            while self.done < n:
                self.cond.wait()

    def abandon(self) -> None:
        """No copier starts after this; wait for those copying. Goes on through a signal
        handler's exceptions (the first is raised once none copies)."""
        pending: BaseException | None = None
        while True:
            try:
                with self.cond:
                    self.abandoned = True
                    while self.running:
                        self.cond.wait()
                break
            except BaseException as e:  # noqa: BLE001 - raised below, after the wait
                if pending is None:
                    pending = e
        if pending is not None:
            raise pending


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
        #: The arena takes blocks (reserved); ``_free`` then covers what ``_blocks`` does not.
        self._arena_live = bool(self._free)
        self._blocks: dict[int, tuple[int, int]] = {}  # id -> (offset, size)
        self._oneoffs: dict[int, Segment] = {}  # id -> segment, its handle still open
        self._ids = itertools.count(1)
        self._cuda_args = (enable_cuda_ipc, peer_gpu_uuids)
        self._cuda: Any = None
        self._closed = False
        self._used = self._peak = 0
        forksafe.register(self)
        self._n = collections.Counter()

    def set_peer_gpus(self, peer_gpu_uuids: "list[str] | None") -> None:
        """The GPUs the receiver sees, once the handshake has told us (before any send)."""
        with self._lock:
            self._cuda_args = (self._cuda_args[0], peer_gpu_uuids)
            if self._cuda is not None:
                self._cuda.peer = None if peer_gpu_uuids is None else set(peer_gpu_uuids)

    # -- sending --------------------------------------------------------------------------

    def put(self, src: Any, nbytes: int, placed: "list | None" = None) -> list | None:
        """Copy ``src`` (CPU tensor or ndarray, any strides) into shared memory.

        Returns the handle to put in the message, or None when neither the arena nor a
        one-off segment can take it (the codec then sends it inline); ``placed``: the
        encoder's list of the message's handles, which gets it before it is returned.
        Any exception (a signal handler's too, wherever it lands) leaves nothing taken
        that no list names. Does not block.
        """
        if self._closed:
            raise SerializationError("tensor sender is closed")
        if nbytes <= 0:
            return None  # nothing to place: inline is free
        handle = None
        try:
            with self._lock:
                if self._lazy:
                    self._reserve_arena()
                offset = self._alloc(nbytes)
                if offset is not None:
                    handle = [ARENA, next(self._ids), offset]
                    self._blocks[handle[1]] = (offset, round_block(nbytes))
                    self._n["arena"] += 1
            if handle is None:
                return self._put_oneoff(src, nbytes, placed)
            _copy_in(self._arena[offset : offset + nbytes], src)
            if placed is not None:
                placed.append(handle)
            return handle
        except BaseException:
            if handle is not None:
                self.cancel(handle)  # (idempotent: the encoder cancels what it lists too)
            with self._lock:  # an allocation a signal parted from its record comes back
                self._rebuild_free()
            raise

    def _reserve_arena(self) -> None:
        """First tensor: reserve the arena's memory (checked against the memory limits;
        on failure the arena stays unused and tensors go as one-offs or inline). Caller
        holds the lock. An exception of a signal handler in between leaves it to be done
        again by the next tensor (``reserve`` is idempotent); the arena never stays
        reserved but unused."""
        try:
            self._seg.reserve()
        except ShmCapacityError as e:
            self._lazy = False
            log.warning("tensor arena of %d bytes not used: %s", self._seg.size, e)
            return
        self._free = [[0, self._usable]]
        self._arena_live = True
        self._lazy = False

    def _put_oneoff(self, src: Any, nbytes: int, placed: "list | None") -> list | None:
        try:
            seg = Segment.create(nbytes, prefix="shmc-t")
        except (ShmCapacityError, OSError) as e:
            self._n["inline_fallback"] += 1
            log.warning("tensor of %d bytes sent inline: %s", nbytes, e)
            return None
        bid = None
        try:
            dst = np.frombuffer(seg.buf, np.uint8)
            _copy_in(dst, src)
            del dst
            seg.close()  # unmapped here; the handle stays open until the receiver releases it
            bid = next(self._ids)
            with self._lock:
                if self._closed:  # closed by another thread meanwhile: its table is gone
                    raise SerializationError("tensor sender is closed")
                self._oneoffs[bid] = seg
                self._n["one_off"] += 1
            handle = [ONE_OFF, bid, seg.name]
            if placed is not None:
                placed.append(handle)
            return handle
        except BaseException:
            if bid is not None:
                with self._lock:
                    self._oneoffs.pop(bid, None)
            seg.close()
            seg.release_handle()
            raise

    def put_cuda(self, tensor: Any) -> list | None:
        """Share a CUDA tensor by IPC handle; None means "send a host copy" (logged once).
        Raises SerializationError once closed (as ``put``): a share then would be kept in
        a table close has already cleared."""
        if self._closed:
            raise SerializationError("tensor sender is closed")
        cuda = self._cuda
        if cuda is None:
            from .tensors_cuda import CudaIpcSender

            with self._lock:  # one sender, whoever comes first, with the peer's GPUs of now
                if self._cuda is None:
                    self._cuda = CudaIpcSender(*self._cuda_args)
                cuda = self._cuda
        handle = cuda.share(tensor, next(self._ids))
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
        ids = [i for (i,) in RELEASE_ID.iter_unpack(payload)]
        self._free_ids(ids)

    def _free_ids(self, ids) -> None:
        segs: list = []
        try:
            with self._lock:
                todo = iter(ids)
                try:
                    for bid in todo:
                        self._free_id(bid, segs)
                except BaseException:
                    # A signal handler's exception (Ctrl-C) mid-way: the release record
                    # was read and will not come again, so the rest are freed now, and
                    # the free list is made again (a block may have left ``_blocks``
                    # without reaching it).
                    for bid in todo:
                        self._free_id(bid, segs)
                    self._rebuild_free()
                    raise
        finally:
            self._release_segments(segs)

    def _free_id(self, bid: int, segs: list) -> None:
        blk = self._blocks.pop(bid, None)
        if blk is not None:
            self._release(*blk)
            self._n["released"] += 1
            return
        seg = self._oneoffs.pop(bid, None)
        if seg is not None:
            segs.append(seg)
            self._n["released"] += 1
        elif self._cuda is not None and self._cuda.release(bid):
            self._n["released"] += 1

    @staticmethod
    def _release_segments(segs: list) -> None:
        try:
            for seg in segs:
                seg.release_handle()
        except BaseException:
            for seg in segs:  # (a signal mid-way: none is left open; idempotent)
                seg.release_handle()
            raise

    # -- allocator (first fit over a sorted free list, coalescing on free) -------------------

    def _alloc(self, nbytes: int) -> int | None:
        size = round_block(nbytes)
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

    def _rebuild_free(self) -> None:
        """The free list and the bytes used, made again from ``_blocks`` (caller holds
        the lock; after an exception that may have parted an allocation from its
        record: no other allocation is under way, each runs under the lock)."""
        if not self._arena_live:
            return
        free: list[list[int]] = []
        pos = used = 0
        for offset, size in sorted(self._blocks.values()):
            if offset > pos:
                free.append([pos, offset - pos])
            pos = max(pos, offset + size)
            used += size
        if pos < self._usable:
            free.append([pos, self._usable - pos])
        self._free, self._used = free, used

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

    def statistics(self) -> TensorStatistics:
        """Arena usage and counters (a snapshot taken under the lock; does not block)."""
        with self._lock:
            return TensorStatistics(
                arena_bytes=self._seg.size,
                used_bytes=self._used,
                peak_used_bytes=self._peak,
                blocks_in_flight=len(self._blocks),
                one_offs_in_flight=len(self._oneoffs),
                cuda_in_flight=self._cuda.in_flight() if self._cuda is not None else 0,
                free_extents=len(self._free),
                sent_arena=self._n["arena"],
                sent_one_off=self._n["one_off"],
                sent_cuda=self._n["cuda"],
                sent_inline_fallback=self._n["inline_fallback"],
                released=self._n["released"],
            )

    def _forget_after_fork(self) -> None:
        """In a forked child: let go of this process's copies of the arena's mapping and
        the one-offs' handles (the parent's blocks stay as they are)."""
        self._closed = True
        segs, self._oneoffs = list(self._oneoffs.values()), {}
        self._blocks = {}
        for seg in segs:
            seg.release_handle()
        self._arena = None  # type: ignore[assignment]
        self._seg.close()

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
