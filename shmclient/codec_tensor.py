"""The msgpack extension that carries a tensor: its layout, its checks and its bytes.

Serialization layer, under ``codec`` and ``codec_decoder``: imports msgspec, ``errors``
and the standard library (torch and numpy lazily, once a message holds a tensor or an
array); never ``tensors``, the ring, ``waiting``, asyncio, clients or the engine. A
tensor is an ``Ext`` whose data is ``<u16 header length><msgpack header>[raw bytes]``,
the header being ``[dtype, shape, where, extra]``; ``where`` is ``None`` (raw bytes
follow, "inline"), an ``int`` (index of an out-of-band zmq frame) or a list (a handle
made by a ``TensorSender``). This module owns the codes (never renumbered), the
``TensorSender`` / ``TensorReceiver`` protocols through which the codec reaches an
out-of-band transport without importing it, the header's reading with every bound
checked before anything is allocated, what a tensor must be to cross
(``check_torch``), its values as C-ordered bytes, and a received tensor rebuilt over
its buffer. Nothing here blocks.
"""

from __future__ import annotations

import reprlib
import struct
import sys
import warnings
from typing import Any, Protocol

import msgspec

from .errors import SerializationError

#: Ext type codes. Never renumber; append.
EXT_TORCH = 1
EXT_NUMPY = 2
EXT_TORCH_CUDA = 3

HLEN = struct.Struct("<H")
#: Inline tensors up to this size take the cheap copy path.
SMALL = 64 * 1024
hdr_encode = msgspec.msgpack.Encoder().encode
hdr_decode = msgspec.msgpack.Decoder().decode


class TensorSender(Protocol):
    """Where an ``Encoder`` puts large tensors (implemented by ``tensors.ShmTensorSender``)."""

    def put(self, src: Any, nbytes: int, placed: list) -> list | None:
        """Copy ``src`` (CPU torch.Tensor or ndarray) in C order; append its handle to
        ``placed`` (the message's list, which the encoder cancels if the encode fails and
        a discarded message's sender frees) and return it, or return None to decline
        (the encoder then sends the bytes inline). Whatever exception it raises, a
        signal handler's included, it leaves nothing taken that ``placed`` does not
        name. Must not block."""

    def put_cuda(self, tensor: Any) -> list | None:
        """Share a CUDA tensor; return a handle, or None to make the encoder send a host copy."""

    def cancel(self, handle: list) -> None:
        """Free a handle whose message will never be sent (the encode failed)."""


class TensorReceiver(Protocol):
    """Opens handles made by the peer's ``TensorSender``."""

    def get(self, handle: list, nbytes: int) -> Any:
        """A 1-D uint8 ndarray of the bytes; it keeps them valid for as long as it lives."""

    def get_cuda(self, handle: list) -> Any:
        """The CUDA tensor a ``put_cuda`` handle describes."""


def torch_module():
    """torch, imported on first use."""
    import torch

    return torch


def numpy_module():
    """numpy, imported on first use."""
    import numpy

    return numpy


DTYPE_NAMES: dict[Any, str] = {}


_QUANTIZED = frozenset({"qint8", "quint8", "qint32", "quint4x2", "quint2x4"})


def dtype_name(dtype) -> str:
    name = str(dtype)[6:]  # "torch.bfloat16" -> "bfloat16"
    if name in _QUANTIZED:
        raise SerializationError(f"cannot serialize a tensor of quantized dtype {dtype}")
    DTYPE_NAMES[dtype] = name
    return name


#: Most dimensions a tensor header may give, and most bytes it may describe (a header is
#: checked before anything is allocated or mapped for it).
MAX_NDIM = 64
MAX_TENSOR_BYTES = 1 << 48


def read_header(data: memoryview) -> tuple[Any, list, Any, Any, int]:
    """``(dtype name, shape, where, extra, header end)`` of a tensor ``Ext``, checked for
    form (not yet the dtype): raises ``SerializationError`` for a malformed header."""
    try:
        (n,) = HLEN.unpack_from(data, 0)
        header = hdr_decode(data[2 : 2 + n])
    except (struct.error, msgspec.DecodeError) as e:
        raise SerializationError(f"malformed tensor header: {e}") from None
    if type(header) is not list or len(header) != 4 or len(data) < 2 + n:
        raise SerializationError("malformed tensor header: expected [dtype, shape, where, extra]")
    dtype, shape, where, extra = header
    check_shape(shape, "malformed tensor header")
    if where is not None and type(where) is not int and type(where) is not list:
        raise SerializationError("malformed tensor header: bad location of the tensor's bytes")
    return dtype, shape, where, extra, 2 + n


def check_shape(shape: Any, what: str) -> None:
    """Raise ``SerializationError`` (``what``, then the problem) unless ``shape``, from the
    peer, is a list (or tuple) of at most ``MAX_NDIM`` ints >= 0 (a bool is no int)."""
    if type(shape) is not list and type(shape) is not tuple or len(shape) > MAX_NDIM:
        raise SerializationError(f"{what}: shape must be a list of at most {MAX_NDIM} ints >= 0, "
                                 f"got {reprlib.repr(shape)}")
    for d in shape:
        if type(d) is not int or d < 0:
            raise SerializationError(f"{what}: shape must be a list of at most {MAX_NDIM} ints >= 0, "
                                     f"{reprlib.repr(shape)} has dimension {reprlib.repr(d)}")


def nbytes_of(itemsize: int, shape: list) -> int:
    """Bytes of a tensor of ``shape`` (checked by ``check_shape``): 0 when a dimension is
    0. Raises ``SerializationError`` when its non-zero dimensions times ``itemsize`` come
    to over ``MAX_TENSOR_BYTES``, an empty tensor's too (its strides would overflow)."""
    nbytes = itemsize
    empty = False
    for d in shape:
        if d == 0:
            empty = True
            continue
        nbytes *= d
        if nbytes > MAX_TENSOR_BYTES:
            raise SerializationError(
                f"tensor of shape {reprlib.repr(shape)} is over 2**{MAX_TENSOR_BYTES.bit_length() - 1} bytes"
            )
    return 0 if empty else nbytes


def check_torch(t) -> None:
    """Raise SerializationError unless ``t`` is plain strided memory we can move."""
    torch = sys.modules["torch"]
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
        raise SerializationError(
            f"cannot serialize tensor subclass {type(t).__qualname__}; send a plain torch.Tensor"
        )
    if t.requires_grad:
        raise SerializationError(
            "cannot serialize a tensor with requires_grad=True (autograd does not cross "
            "processes); send tensor.detach()"
        )
    if t.is_nested:
        raise SerializationError("cannot serialize a nested tensor")
    if t.layout is not torch.strided:
        raise SerializationError(
            f"cannot serialize a {t.layout} (sparse) tensor; send tensor.to_dense()"
        )
    if t.is_quantized:
        raise SerializationError("cannot serialize a quantized tensor; send tensor.dequantize()")
    if t.device.type not in ("cpu", "cuda"):
        raise SerializationError(
            f"cannot serialize a tensor on device {t.device.type!r}; only CPU and CUDA "
            "tensors with real storage can cross"
        )


def contiguous(t):
    """``t`` as a dense C-ordered tensor; also for dtypes torch cannot copy (uint1...int7,
    float8 variants on some builds), which are copied as same-sized integers."""
    if t.is_contiguous():
        return t
    try:
        return t.contiguous()
    except (NotImplementedError, RuntimeError):
        import torch

        as_int = _SAME_SIZE_INT[t.dtype.itemsize]
        return t.view(getattr(torch, as_int)).contiguous().view(t.dtype)


_SAME_SIZE_INT = {1: "uint8", 2: "int16", 4: "int32", 8: "int64", 16: "complex128"}


def contiguous_bytes(src, torch_src: bool) -> memoryview:
    """A flat byte view of ``src``'s values in C order (copies only if not contiguous).

    The view keeps the memory it shows alive, so it may outlive ``src`` (zmq frames).
    """
    if torch_src:
        n = src.numel()
        if n == 0:
            return memoryview(b"")
        import torch

        flat = contiguous(src).view(-1)
        if flat.stride(0) != 1:  # dense, but a size-1 dim kept an odd stride
            flat = flat.as_strided((n,), (1,))
        return memoryview(flat.view(torch.uint8).numpy())
    import numpy as np

    a = np.ascontiguousarray(src)
    return memoryview(a.reshape(-1).view(np.uint8)) if a.size else memoryview(b"")


def device_uuid(device) -> str | None:
    try:
        return str(torch_module().cuda.get_device_properties(device).uuid)
    except Exception:  # pragma: no cover - needs CUDA
        return None


def as_torch(buf, dtype, shape, uuid, tensors):
    """A tensor over ``buf`` (kept alive by the tensor), or a fresh one when empty."""
    torch = torch_module()
    if len(buf) == 0:
        t = torch.empty(shape, dtype=dtype)
    else:
        if getattr(buf, "flags", None) is not None and not buf.flags.writeable:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                t = torch.frombuffer(buf, dtype=dtype)
        else:
            t = torch.frombuffer(buf, dtype=dtype)
        if len(shape) != 1:
            t = t.view(*shape) if shape else t.view(())
    if uuid is not None and tensors is not None:
        # A CUDA tensor sent as a host copy: put it back on the same GPU if we see it.
        index_for_uuid = getattr(tensors, "cuda_index_for_uuid", None)
        index = index_for_uuid(uuid) if index_for_uuid is not None else None
        if index is not None:
            t = t.to(f"cuda:{index}")
    return t
