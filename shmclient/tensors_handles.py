"""A tensor handle and a release record: what a tensor sender and its receiver agree on.

Transport layer under the codec: imports ``errors`` and the standard library; never
``shm``, the senders or receivers that use it, the codec, ``waiting``, asyncio, clients
or the engine. A handle is the list a message carries in a tensor's place:
``[ARENA, id, offset]`` (a block of the sender's arena), ``[ONE_OFF, id, segment
handle]`` (a one-off memfd segment of the sender) or a CUDA IPC handle (``CUDA_IPC``,
checked by ``tensors_cuda.check_handle``). Ids are u64 > 0; a release record (the
payload of ``take_releases()``) is the ids the receiver is done with, each a
little-endian u64 (``RELEASE_ID``). Blocks are ``ALIGN``-aligned. ``check_handle``
checks a handle from the wire before anything is opened for it. Nothing here blocks.
"""

from __future__ import annotations

import struct
from typing import Any

from .errors import SerializationError

__all__ = ["ALIGN", "ARENA", "CUDA_IPC", "ONE_OFF", "RELEASE_ID", "check_handle", "round_block"]

#: Handle kinds (first element of a handle).
ARENA, ONE_OFF, CUDA_IPC = 0, 1, 2
#: Block alignment in the arena: a cache line multiple, and enough for any dtype view.
ALIGN = 256
#: One id of a release record.
RELEASE_ID = struct.Struct("<Q")

_U64 = 1 << 64


def check_handle(handle: Any, nbytes: Any) -> tuple[int, int, Any]:
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


def round_block(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN
