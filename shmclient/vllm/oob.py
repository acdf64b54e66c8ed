"""Tensors of vLLM's messages out of band: a shared-memory arena per direction, CUDA IPC.

Middle layer of the plug-in: imports ``shmclient.tensors`` (arena sender and receiver,
CUDA IPC through ``tensors_cuda``), ``dtypes`` (the allowlist of a placeholder's dtype),
``codec_tensor`` (the shape and size checks of a tensor header),
torch and vLLM's ``serial_utils`` interfaces (``OOBTensorConsumer``); never the frontend
or engine modules. ``wire.VllmFraming`` builds these objects on a channel's arenas; the
channel carries the releases back. Its contract (what goes out of band, life cycle of a
block, the threshold): docs/design.md, "Module notes", ``shmclient.vllm.oob``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..codec_tensor import check_shape, nbytes_of
from ..dtypes import torch_dtype
from ..errors import SerializationError
from ..tensors import CUDA_IPC, ShmTensorReceiver, ShmTensorSender

__all__ = ["ArenaProvider", "ArenaTensors", "KEY", "TENSOR_MIN_BYTES"]

#: The placeholder's key: ``{"shmc": handle}``.
KEY = "shmc"
#: CPU tensors from this size travel through the arena; smaller ones as ring frames.
TENSOR_MIN_BYTES = 64 * 1024

try:
    from vllm.v1.serial_utils import OOBTensorConsumer as _Consumer
except ImportError:  # pragma: no cover - vLLM is what loads this module
    _Consumer = object  # type: ignore[misc,assignment]


class ArenaTensors(_Consumer):  # type: ignore[misc,valid-type]
    """vLLM ``OOBTensorConsumer`` placing tensors in ``sender``'s arena (see module doc).
    Called by one encoder at a time (vLLM's encoders are not thread-safe either). Keeps
    the handles of the message being encoded until ``take`` (its sender lists them)."""

    def __init__(self, sender: ShmTensorSender, threshold: int = TENSOR_MIN_BYTES, cuda_ipc: bool = True) -> None:
        self.sender = sender
        self.threshold = threshold
        self.cuda_ipc = cuda_ipc
        self.placed: list = []

    def new_message(self) -> None:
        if self.placed:
            # An encode that placed tensors and then failed (or whose frames nobody
            # sent): its blocks would never be released by the peer.
            stale, self.placed = self.placed, []
            for handle in stale:
                self.sender.cancel(handle)

    def take(self) -> list:
        """The handles of the last encode, once: its message will carry them."""
        placed = self.placed
        if placed:
            self.placed = []
        return placed

    def __call__(self, tensor: torch.Tensor) -> dict | None:
        if tensor.is_cuda:
            if self.cuda_ipc:
                handle = self.sender.put_cuda(tensor)
                if handle is not None:
                    self.placed.append(handle)
                    return {KEY: handle}
            tensor = tensor.detach().to("cpu")  # host copy: always out of band from here
        elif tensor.nbytes < self.threshold:
            return None  # vLLM's own extra frame
        handle = self.sender.put(tensor.detach(), tensor.nbytes, self.placed)  # (listed by put)
        if handle is None:
            return None
        return {KEY: handle}


class ArenaProvider:
    """vLLM ``oob_tensor_provider``: ``(dtype, shape, placeholder) -> tensor``. Placeholders
    that are not ours go to ``fallback`` (vLLM's own, e.g. its multimodal tensor queue).
    Raises ``SerializationError`` for a bad handle, dtype or shape, ValueError for a
    placeholder nobody knows."""

    def __init__(self, receiver: ShmTensorReceiver, fallback: Callable[..., torch.Tensor] | None = None) -> None:
        self.receiver = receiver
        self.fallback = fallback
        #: Handles the current decode asked for (cleared by the decoder before each).
        self.opened: list = []

    def __call__(self, dtype: str, shape: Any, meta: dict) -> torch.Tensor:
        handle = meta.get(KEY) if isinstance(meta, dict) else None
        if handle is None:
            if self.fallback is None:
                raise ValueError(f"shmclient.vllm: an out-of-band tensor placeholder it does not know: {meta!r}")
            return self.fallback(dtype, shape, meta)
        self.opened.append(handle)
        if type(handle) is list and handle and handle[0] == CUDA_IPC:
            return self.receiver.get_cuda(handle)
        dt, size, nbytes = _checked(dtype, shape)
        if nbytes == 0:
            return torch.empty(size, dtype=dt)
        arr = self.receiver.get(handle, nbytes)
        # from_numpy keeps ``arr`` (the watched array) alive exactly as long as the tensor
        return torch.from_numpy(arr).view(dt).view(size)

    def release_unopened(self, handles: list) -> None:
        """After a decode failed: release each of ``handles`` (those its sender listed,
        ``wire.placed``) that the decode did not open, so that the sender gets its blocks
        back (those it opened are released as the tensors it made are dropped). Nothing
        is opened; never raises."""
        opened, self.opened = self.opened, []
        for handle in handles:
            if handle not in opened:
                self.receiver.release_unopened(handle)


def _checked(dtype: Any, shape: Any) -> "tuple[torch.dtype, tuple[int, ...], int]":
    """``(dtype, shape, nbytes)`` of a placeholder from the peer, checked as the native
    codec checks a tensor header (``codec_tensor``): ``SerializationError`` naming a
    dtype off the allowlist, a shape that is not a list of at most 64 ints >= 0, or one
    over 2**48 bytes (an empty one's strides too)."""
    dt = torch_dtype(dtype)
    check_shape(shape, "shmclient.vllm: an out-of-band tensor placeholder")
    return dt, tuple(shape), nbytes_of(dt.itemsize, shape)
