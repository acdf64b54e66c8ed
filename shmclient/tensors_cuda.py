"""CUDA tensors between processes by IPC handle, on torch's own CUDA IPC reductions.

Transport layer, used only by ``tensors_sender`` and ``tensors_receiver`` (imported on
the first CUDA tensor): imports torch, ``dtypes``, ``errors``, ``gpus`` (the GPU-UUID
device mapping), ``tensors_handles`` and the standard library; never clients, asyncio,
``waiting``, the engine or the codec. It owns the keep-alive table of sent CUDA tensors
and the decision "IPC handle or host copy". Its contract (what torch does, streams, life
cycle, fallbacks): docs/design.md, "Module notes", ``shmclient.tensors_cuda``.
"""

from __future__ import annotations

import logging
import re
import threading
import weakref
from typing import Any

import torch
import torch.multiprocessing.reductions as _reductions

from .dtypes import torch_dtype
from .errors import SerializationError
from .gpus import local_index_for_uuid
from .tensors_handles import CUDA_IPC

log = logging.getLogger("shmclient")


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def ipc_unavailable_reason(
    enabled: bool, uuid: str | None, peer_gpu_uuids: "set[str] | None"
) -> str | None:
    """Why a tensor on GPU ``uuid`` cannot be shared by handle, or None if it can."""
    if not enabled:
        return "CUDA IPC is disabled (enable_cuda_ipc=False)"
    if peer_gpu_uuids is not None and not peer_gpu_uuids:
        return "the receiving process has no CUDA device"
    if uuid is None:
        return "the tensor's GPU has no UUID"
    if peer_gpu_uuids is not None and uuid not in peer_gpu_uuids:
        return f"the receiving process does not see GPU {uuid}"
    return None


class CudaIpcSender:
    """Keeps shared CUDA tensors alive until the receiver releases them."""

    def __init__(self, enabled: bool = True, peer_gpu_uuids: "list[str] | None" = None) -> None:
        self.enabled = enabled
        self.peer = None if peer_gpu_uuids is None else set(peer_gpu_uuids)
        self._live: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()
        self._logged: set[str] = set()
        self._released_since_collect = 0

    def share(self, t: torch.Tensor, bid: int) -> list | None:
        """The handle for ``t`` (kept alive under ``bid``), or None for a host copy."""
        uuid = device_uuid(t.device.index) if self.enabled else None
        reason = ipc_unavailable_reason(self.enabled, uuid, self.peer)
        if reason is None:
            try:
                _, args = _reductions.reduce_tensor(t.detach())
            except Exception as e:  # e.g. expandable segments on an old driver
                reason = f"torch could not export an IPC handle ({e})"
            else:
                why = None if args[7] is None else storage_handle_refusal(args[7])
                if why is not None:  # (the receiving side would refuse it)
                    reason = f"torch exported a handle the receiving side does not take: {why}"
        if reason is not None:
            if reason not in self._logged:
                self._logged.add(reason)
                log.warning("CUDA tensors are sent as host copies: %s", reason)
            return None
        (_cls, size, stride, offset, _scls, dtype, _dev, handle, st_size, st_offset,
         _grad, rc_handle, rc_offset, ev_handle, ev_sync) = args
        with self._lock:
            self._live[bid] = t
        return [CUDA_IPC, bid, uuid, handle, st_size, st_offset, list(size), list(stride),
                offset, str(dtype)[6:], rc_handle, rc_offset, ev_handle, bool(ev_sync)]

    def release(self, bid: int) -> bool:
        """Drop the tensor kept under ``bid``; False if unknown."""
        with self._lock:
            found = self._live.pop(bid, None) is not None
            if found:
                self._released_since_collect += 1
        return found

    def collect(self) -> None:
        """Let torch free blocks whose consumers are gone (its IPC limbo)."""
        if self._released_since_collect:
            self._released_since_collect = 0
            torch.cuda.ipc_collect()

    def in_flight(self) -> int:
        return len(self._live)

    def close(self) -> None:
        with self._lock:
            self._live.clear()
        if torch.cuda.is_initialized():
            torch.cuda.ipc_collect()


#: torch's ref-counter files hold this many int64 counters (``CUDA_IPC_REF_COUNTER_FILE_SIZE``
#: in torch/csrc/CudaIPCTypes.h); a counter offset outside them is refused.
REF_COUNTER_FILE_SIZE = 10000
#: torch's name of a ref-counter file (``at::NewProcessWideShmHandle``): /torch_<pid>_<n>_...
_REF_COUNTER_NAME = re.compile(rb"/torch_([0-9]+)_[0-9]+(?:_[0-9]+)*")
_MAX_NDIM = 64
_U64 = 1 << 64
#: ``sizeof(cudaIpcMemHandle_t)`` and ``sizeof(cudaIpcEventHandle_t)``.
IPC_HANDLE_BYTES = 64


def storage_handle_refusal(h: Any) -> str | None:
    """Why a storage handle is not one this side opens, or None. Taken: a plain
    ``cudaMalloc`` block's handle, as torch writes it: the 64 bytes of a
    ``cudaIpcMemHandle_t`` (older torch), or a version byte (2 up to torch 2.12, 3 from
    2.13, the payload alike), ``'c'`` and those 64 bytes. Not taken: an expandable
    segment's (``'e'``, torch under ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``),
    whose header names a process and descriptors torch opens by ``pidfd_getfd`` and a
    segment size it divides by: from the wire, none of that is checked here, so its
    sender sends a host copy instead. Pure Python."""
    if type(h) is not bytes:
        return "the storage handle is not bytes"
    if len(h) == IPC_HANDLE_BYTES:
        return None
    if len(h) == IPC_HANDLE_BYTES + 2 and 1 <= h[0] <= 16 and h[1:2] == b"c":
        return None
    if len(h) > 1 and h[1:2] == b"e":
        return "an expandable segment's handle (PYTORCH_CUDA_ALLOC_CONF=expandable_segments) is not taken"
    return f"a storage handle of {len(h)} bytes is not a CUDA IPC memory handle"


def check_handle(handle: Any, peer_pid: int | None = None) -> tuple:
    """The fields of a ``[CUDA_IPC, ...]`` handle from the wire, checked, or
    ``SerializationError`` naming what is wrong (nothing opened, nothing queued for
    release). Checks: 14 fields; the block id a u64 > 0; the dtype on the allowlist
    (``dtypes``); sizes and strides ints >= 0 of the same length, the view (offset,
    sizes, strides) inside the storage's bytes; the storage offset and size ints >= 0;
    the ref-counter file one of torch's names (of ``peer_pid`` when given) and its
    counter offset inside that file; the handles bytes. Pure Python: needs no GPU."""
    if type(handle) is not list or len(handle) != 14:
        raise SerializationError("malformed CUDA IPC handle: expected 14 fields")
    (kind, bid, uuid, h, st_size, st_offset, size, stride, offset, dtype_name,
     rc_handle, rc_offset, ev_handle, ev_sync) = handle
    if kind != CUDA_IPC:
        raise SerializationError(f"malformed CUDA IPC handle: kind {kind!r}")
    if type(bid) is not int or not 0 < bid < _U64:
        raise SerializationError(f"malformed CUDA IPC handle: block id {bid!r} is not a u64 > 0")
    if type(uuid) is not str or len(uuid) > 64:
        raise SerializationError("malformed CUDA IPC handle: GPU UUID")
    dtype = torch_dtype(dtype_name)
    if h is not None:
        why = storage_handle_refusal(h)
        if why is not None:
            raise SerializationError(f"CUDA IPC handle refused: {why}")
    for name, v in (("storage size", st_size), ("storage offset", st_offset), ("offset", offset)):
        if type(v) is not int or not 0 <= v < 1 << 62:
            raise SerializationError(f"malformed CUDA IPC handle: {name} {v!r}")
    if (type(size) is not list or type(stride) is not list or len(size) != len(stride)
            or len(size) > _MAX_NDIM
            or any(type(d) is not int or not 0 <= d < 1 << 62 for d in size + stride)):
        raise SerializationError("malformed CUDA IPC handle: sizes and strides")
    if all(size):
        last = offset
        for d, st in zip(size, stride):
            last += (d - 1) * st
        if (last + 1) * dtype.itemsize > st_size:
            raise SerializationError(
                f"malformed CUDA IPC handle: a view of {size} / strides {stride} at offset "
                f"{offset} needs {(last + 1) * dtype.itemsize} bytes, the storage has {st_size}")
    if rc_handle is not None or rc_offset is not None:
        name = rc_handle.encode() if type(rc_handle) is str else rc_handle
        m = _REF_COUNTER_NAME.fullmatch(name) if type(name) is bytes else None
        if m is None:
            raise SerializationError("malformed CUDA IPC handle: not a torch ref-counter file name")
        if peer_pid is not None and int(m.group(1)) != peer_pid:
            raise SerializationError("CUDA IPC handle refused: its ref-counter file is not the peer's")
        if type(rc_offset) is not int or not 0 <= rc_offset < REF_COUNTER_FILE_SIZE:
            raise SerializationError(
                f"malformed CUDA IPC handle: ref-counter offset {rc_offset!r} is outside "
                f"[0, {REF_COUNTER_FILE_SIZE})")
    if ev_handle is not None and (type(ev_handle) is not bytes or len(ev_handle) != IPC_HANDLE_BYTES):
        # (torch reads a cudaIpcEventHandle_t from these bytes, whatever their length)
        raise SerializationError("malformed CUDA IPC handle: the event handle is not 64 bytes")
    if type(ev_sync) is not bool:
        raise SerializationError("malformed CUDA IPC handle: event flag")
    return (bid, uuid, h, st_size, st_offset, size, stride, offset, dtype, rc_handle,
            rc_offset, ev_handle, ev_sync)


class CudaIpcReceiver:
    """Opens CUDA handles on the local device with the same UUID."""

    def __init__(self, peer_pid: int | None = None) -> None:
        self.opened = 0  # handles actually opened (cache misses)
        self._live: dict[int, Any] = {}
        #: The sender's pid: its ref-counter files carry it (None: not checked).
        self.peer_pid = peer_pid

    def open(self, handle: list, released) -> torch.Tensor:
        """The tensor for ``handle``; its id is appended to ``released`` when the returned
        tensor object is garbage (torch's own ref-count keeps the producer's block out of
        reuse for as long as any view of the storage lives)."""
        (bid, uuid, h, st_size, st_offset, size, stride, offset, dtype, rc_handle,
         rc_offset, ev_handle, ev_sync) = check_handle(handle, self.peer_pid)
        index = local_index_for_uuid(uuid)
        if index is None:
            released.append(bid)
            raise SerializationError(
                f"received a CUDA IPC handle for GPU {uuid}, which this process does not see; "
                "the sender must be given peer_gpu_uuids=local_gpu_uuids() from this side"
            )
        try:
            if h is not None and _reductions.storage_from_cache(None, (h, st_offset)) is None:
                self.opened += 1
            # TypedStorage, as reduce_tensor sends: the class whose methods torch expects here.
            t = _reductions.rebuild_cuda_tensor(
                torch.Tensor, torch.Size(size), tuple(stride), offset, torch.storage.TypedStorage,
                dtype, index, h, st_size, st_offset, False, rc_handle, rc_offset, ev_handle,
                ev_sync,
            )
        except Exception as e:  # the handle or its event did not open, out of memory, ...
            released.append(bid)  # the sender may drop its reference: nothing here holds it
            raise SerializationError(f"CUDA IPC handle of block {bid} could not be opened: "
                                     f"{type(e).__name__}: {e}") from e
        live = self._live

        def dropped(_ref, bid=bid):
            released.append(bid)
            live.pop(bid, None)

        live[bid] = weakref.ref(t, dropped)
        return t

    def close(self) -> None:
        self._live.clear()
