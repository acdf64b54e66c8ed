"""msgpack encoder/decoder for the wire structs, with tensors carried by extension types.

Serialization layer: imports msgspec, ``errors`` and the standard library; torch and numpy
are imported lazily (only once a message actually holds a tensor or an array), and the
out-of-band transport is reached only through the small ``TensorSender`` /
``TensorReceiver`` protocols below, so this module never imports ``tensors``, clients,
asyncio or the engine. It owns the wire layout of a tensor: an msgpack ``Ext`` whose data
is ``<u16 header length><msgpack header>[raw bytes]``, the header being
``[dtype, shape, where, extra]``; ``where`` is ``None`` (raw bytes follow, "inline"), an
``int`` (index of an out-of-band zmq frame) or a list (a handle made by a
``TensorSender``). torch tensors and numpy arrays may sit anywhere in a message (struct
fields typed ``Any``, lists, tuples, dicts). Values are copied in C order (bit-exact,
whatever the strides); Fortran-ordered arrays keep their order; bfloat16 and every other
dtype travel as raw bytes. Encoders and decoders are not thread-safe: one per thread.
Nothing here blocks.
"""

from __future__ import annotations

import ctypes
import logging
import struct
import sys
import warnings
from typing import Any, Protocol, Sequence

import msgspec

from .dtypes import numpy_dtype, torch_dtype
from .errors import SerializationError

__all__ = [
    "Decoder",
    "Encoder",
    "TensorReceiver",
    "TensorSender",
    "EXT_TORCH",
    "EXT_NUMPY",
    "EXT_TORCH_CUDA",
]

log = logging.getLogger("shmclient")

#: Ext type codes. Never renumber; append.
EXT_TORCH = 1
EXT_NUMPY = 2
EXT_TORCH_CUDA = 3

_HLEN = struct.Struct("<H")
_SMALL = 64 * 1024  # inline tensors up to this size take the cheap copy path
_hdr_encode = msgspec.msgpack.Encoder().encode
_hdr_decode = msgspec.msgpack.Decoder().decode


class TensorSender(Protocol):
    """Where an ``Encoder`` puts large tensors (implemented by ``tensors.ShmTensorSender``)."""

    def put(self, src: Any, nbytes: int) -> list | None:
        """Copy ``src`` (CPU torch.Tensor or ndarray) in C order; return a handle or None
        to decline (the encoder then sends the bytes inline). Must not block."""

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


def _torch():
    import torch

    return torch


_DTYPE_NAMES: dict[Any, str] = {}


_QUANTIZED = frozenset({"qint8", "quint8", "qint32", "quint4x2", "quint2x4"})


def _dtype_name(dtype) -> str:
    name = str(dtype)[6:]  # "torch.bfloat16" -> "bfloat16"
    if name in _QUANTIZED:
        raise SerializationError(f"cannot serialize a tensor of quantized dtype {dtype}")
    _DTYPE_NAMES[dtype] = name
    return name


def _torch_dtype(name: str):
    return torch_dtype(name)  # the allowlist: a wire name never reaches getattr unchecked


#: Most dimensions a tensor header may give, and most bytes it may describe (a header is
#: checked before anything is allocated or mapped for it).
MAX_NDIM = 64
MAX_TENSOR_BYTES = 1 << 48


def _read_header(data: memoryview) -> tuple[Any, list, Any, Any, int]:
    """``(dtype name, shape, where, extra, header end)`` of a tensor ``Ext``, checked for
    form (not yet the dtype): raises ``SerializationError`` for a malformed header."""
    try:
        (n,) = _HLEN.unpack_from(data, 0)
        header = _hdr_decode(data[2 : 2 + n])
    except (struct.error, msgspec.DecodeError) as e:
        raise SerializationError(f"malformed tensor header: {e}") from None
    if type(header) is not list or len(header) != 4 or len(data) < 2 + n:
        raise SerializationError("malformed tensor header: expected [dtype, shape, where, extra]")
    dtype, shape, where, extra = header
    if type(shape) is not list or len(shape) > MAX_NDIM or any(
        type(d) is not int or d < 0 for d in shape
    ):
        raise SerializationError(
            f"malformed tensor header: shape must be a list of at most {MAX_NDIM} ints >= 0"
        )
    if where is not None and type(where) is not int and type(where) is not list:
        raise SerializationError("malformed tensor header: bad location of the tensor's bytes")
    return dtype, shape, where, extra, 2 + n


def _nbytes(itemsize: int, shape: list) -> int:
    nbytes = itemsize
    for d in shape:
        nbytes *= d
        if nbytes > MAX_TENSOR_BYTES:
            break
    if nbytes > MAX_TENSOR_BYTES:
        raise SerializationError(
            f"tensor of shape {shape[:8]}{'...' if len(shape) > 8 else ''} is over "
            f"{MAX_TENSOR_BYTES} bytes"
        )
    return nbytes


def _check_torch(t) -> None:
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


class Encoder:
    """Encodes any wire struct (or plain msgpack value) holding tensors.

    ``tensors``: where tensors of ``inline_threshold`` bytes or more go out of band; without
    it they are inline in the message (``encode``) or separate frames (``encode_frames``).
    """

    def __init__(self, tensors: TensorSender | None = None, inline_threshold: int = 256) -> None:
        self.tensors = tensors
        self.inline_threshold = inline_threshold
        self._enc = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._frames: list | None = None
        self._placed: list = []
        self._warned_cuda = False

    # -- public -----------------------------------------------------------------------

    def encode(self, obj: Any) -> bytes:
        """One msgpack buffer (a fresh ``bytes``, never reused). Does not block.

        Raises ``SerializationError`` for a value that cannot cross (naming its type or
        the tensor's problem); tensors already placed out of band are then freed.
        """
        self._frames = None
        return self._run(self._enc.encode, obj)

    def encode_into(self, obj: Any, buf: bytearray, offset: int = 0) -> None:
        """Like ``encode`` but into ``buf`` at ``offset`` (``buf`` grows or shrinks to end
        exactly at the message). The caller owns ``buf`` and decides when to reuse it."""
        self._frames = None
        self._run(self._enc.encode_into, obj, buf, offset)

    def encode_frames(self, obj: Any) -> list:
        """``[msgpack, buffer, buffer, ...]`` for a zmq multipart send (``copy=False``).

        Large tensors go to ``tensors`` when one was given, else each becomes its own frame
        that shares the tensor's memory (zero-copy: do not modify the tensor until sent).
        """
        frames: list = [None]
        self._frames = frames
        try:
            frames[0] = self._run(self._enc.encode, obj)
        finally:
            self._frames = None
        return frames

    # -- internals ----------------------------------------------------------------------

    def _run(self, fn, *args):
        placed = self._placed
        try:
            out = fn(*args)
        except BaseException as e:
            handles, self._placed = placed, []
            for h in handles:
                try:
                    self.tensors.cancel(h)  # type: ignore[union-attr]
                except Exception:  # pragma: no cover - best effort rollback
                    log.exception("could not free an out-of-band tensor after a failed encode")
            if isinstance(e, (SerializationError, KeyboardInterrupt, SystemExit, MemoryError)):
                raise
            if isinstance(e, (TypeError, ValueError, OverflowError)):
                raise SerializationError(str(e)) from e
            if isinstance(e, RecursionError):
                raise SerializationError(
                    f"cannot serialize a value nested this deep ({e}); flatten it"
                ) from e
            raise
        if placed:
            placed.clear()
        return out

    def _enc_hook(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor):
            return self._encode_torch(obj, torch)
        np = sys.modules.get("numpy")
        if np is not None:
            if isinstance(obj, np.ndarray):
                return self._encode_numpy(obj, np, scalar=False)
            if isinstance(obj, np.generic):
                return self._encode_numpy(np.asarray(obj), np, scalar=True)
        raise SerializationError(
            f"cannot serialize object of type {type(obj).__module__}.{type(obj).__qualname__}"
        )

    def _encode_torch(self, t, torch) -> msgspec.msgpack.Ext:
        if (
            type(t) is not torch.Tensor
            or t.requires_grad
            or t.layout is not torch.strided
            or t.is_quantized
            or t.is_nested
            or not (t.is_cpu or t.is_cuda)
        ):
            _check_torch(t)  # raises, naming the problem (a Parameter without grad passes)
        dtype = _DTYPE_NAMES.get(t.dtype) or _dtype_name(t.dtype)
        shape = list(t.shape)
        extra = None
        if t.is_conj():
            t = t.resolve_conj()
        if t.is_neg():
            t = t.resolve_neg()
        if t.is_cuda:
            handle = self.tensors.put_cuda(t) if self.tensors is not None else None
            if handle is not None:
                self._placed.append(handle)
                return self._ext(EXT_TORCH_CUDA, [dtype, shape, handle, None], None)
            if self.tensors is None and not self._warned_cuda:
                self._warned_cuda = True
                log.info("CUDA tensors are sent as host copies: no tensor transport configured")
            extra = _device_uuid(t.device)
            t = t.detach().to("cpu")
        return self._place(EXT_TORCH, dtype, shape, extra, t, t.nbytes, torch_src=True)

    def _encode_numpy(self, a, np, scalar: bool) -> msgspec.msgpack.Ext:
        dt = a.dtype
        if dt.hasobject or dt.fields is not None or dt.kind == "V":
            raise SerializationError(
                f"cannot serialize a numpy array of dtype {dt!r} (object/structured dtypes "
                "do not cross)"
            )
        extra = "s" if scalar else None
        if a.ndim > 1 and a.flags.f_contiguous and not a.flags.c_contiguous:
            extra = "F"
            src = a.T  # C-contiguous; its bytes are ``a`` in Fortran order
        else:
            src = a
        return self._place(EXT_NUMPY, dt.str, list(a.shape), extra, src, a.nbytes, torch_src=False)

    def _place(self, code, dtype, shape, extra, src, nbytes, torch_src):
        if nbytes >= self.inline_threshold:
            if self.tensors is not None:
                handle = self.tensors.put(src, nbytes)
                if handle is not None:
                    self._placed.append(handle)
                    return self._ext(code, [dtype, shape, handle, extra], None)
            elif self._frames is not None:
                self._frames.append(_contiguous_bytes(src, torch_src))
                return self._ext(code, [dtype, shape, len(self._frames) - 1, extra], None)
        if torch_src and 0 < nbytes <= _SMALL:
            # Small: one ctypes read of the (contiguous) tensor, then a bytes concat. ~3x
            # cheaper than going through a numpy view; ``src`` is alive throughout.
            src = contiguous(src)
            hdr = _hdr_encode([dtype, shape, None, extra])
            raw = ctypes.string_at(src.data_ptr(), nbytes)
            return msgspec.msgpack.Ext(code, _HLEN.pack(len(hdr)) + hdr + raw)
        return self._ext(code, [dtype, shape, None, extra], _contiguous_bytes(src, torch_src))

    @staticmethod
    def _ext(code: int, header: list, raw) -> msgspec.msgpack.Ext:
        hdr = _hdr_encode(header)
        n = len(hdr)
        if raw is None:
            return msgspec.msgpack.Ext(code, _HLEN.pack(n) + hdr)
        data = bytearray(2 + n + raw.nbytes)
        _HLEN.pack_into(data, 0, n)
        data[2 : 2 + n] = hdr
        data[2 + n :] = raw
        return msgspec.msgpack.Ext(code, data)


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


def _contiguous_bytes(src, torch_src: bool) -> memoryview:
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


def _device_uuid(device) -> str | None:
    try:
        return str(_torch().cuda.get_device_properties(device).uuid)
    except Exception:  # pragma: no cover - needs CUDA
        return None


class Decoder:
    """Decodes what an ``Encoder`` made. ``type_``: the expected struct (None: any value).

    ``tensors``: opens out-of-band handles; without it a message carrying one raises
    ``SerializationError``.
    """

    def __init__(self, type_: type | None = None, tensors: TensorReceiver | None = None) -> None:
        self.tensors = tensors
        if type_ is None:
            self._dec = msgspec.msgpack.Decoder(ext_hook=self._ext_hook)
        else:
            self._dec = msgspec.msgpack.Decoder(type_, ext_hook=self._ext_hook)
        self._frames: Sequence | None = None
        #: Out-of-band handles the current decode opened or tried to (for ``salvage``).
        self._opened: list = []
        self._any = msgspec.msgpack.Decoder(ext_hook=self._salvage_hook)

    def decode(self, buf: Any) -> Any:
        """Decode one msgpack buffer (bytes, bytearray or memoryview). Does not block.

        Inline tensor bytes are copied out, so ``buf`` may be reused as soon as this
        returns. Raises ``SerializationError`` or ``msgspec.ValidationError`` /
        ``msgspec.DecodeError`` on a malformed message.
        """
        self._frames = None
        if self._opened:
            self._opened.clear()
        return self._dec.decode(buf)

    def decode_frames(self, frames: Sequence) -> Any:
        """Decode ``encode_frames`` output (bytes, memoryviews or zmq.Frame objects).

        Tensors carried as frames share the frame memory (zero-copy).
        """
        self._frames = frames
        if self._opened:
            self._opened.clear()
        try:
            return self._dec.decode(frames[0])
        finally:
            self._frames = None

    def salvage(self, buf: Any) -> Any:
        """After ``decode`` / ``decode_frames`` of ``buf`` raised: decode it again without
        the expected type, for whatever can still be read (a list, for a wire struct), or
        None if even that fails. Tensors come back as None. Out-of-band blocks that the
        failed decode did not open are opened and dropped here, so that their memory goes
        back to the sender instead of staying taken. Never raises; does not block."""
        try:
            return self._any.decode(buf)
        except Exception:
            return None
        finally:
            self._opened.clear()

    def _salvage_hook(self, code: int, data: memoryview) -> None:
        if code not in (EXT_TORCH, EXT_NUMPY, EXT_TORCH_CUDA) or self.tensors is None:
            return None
        try:
            dtype, shape, where, _extra, _end = _read_header(data)
            if type(where) is not list or where in self._opened:
                return None
            if code == EXT_TORCH_CUDA:
                self.tensors.get_cuda(where)
            else:
                itemsize = (
                    _torch_dtype(dtype).itemsize if code == EXT_TORCH else numpy_dtype(dtype).itemsize
                )
                nbytes = _nbytes(itemsize, shape)
                self.tensors.get(where, nbytes)  # dropped at once: the block is released
        except Exception:  # best effort: a handle we cannot open is not ours to free
            log.debug("could not open a tensor of an undecodable message", exc_info=True)
        return None

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code not in (EXT_TORCH, EXT_NUMPY, EXT_TORCH_CUDA):
            raise SerializationError(f"unknown msgpack extension type {code}")
        dtype, shape, where, extra, end = _read_header(data)
        if code == EXT_TORCH_CUDA:
            if self.tensors is None:
                raise SerializationError(
                    "message carries a CUDA tensor handle but this Decoder has no tensor receiver"
                )
            if type(where) is not list:
                raise SerializationError("malformed CUDA tensor header: no handle")
            self._opened.append(where)
            return self.tensors.get_cuda(where)
        np = _numpy()
        if code == EXT_TORCH:
            torch_dtype = _torch_dtype(dtype)
            itemsize = torch_dtype.itemsize
            if extra is not None and type(extra) is not str:
                raise SerializationError("malformed tensor header: bad device")
        else:
            np_dtype = numpy_dtype(dtype)
            itemsize = np_dtype.itemsize
            if extra not in (None, "F", "s") or (extra == "s" and shape):
                raise SerializationError("malformed array header: bad layout flag")
        nbytes = _nbytes(itemsize, shape)
        if where is None:
            raw = data[end:]
            if raw.nbytes != nbytes:
                raise SerializationError(
                    f"tensor of shape {shape} and dtype {dtype} needs {nbytes} bytes, "
                    f"message has {raw.nbytes}"
                )
            buf = bytearray(raw)  # copy out: ``data`` may be reused once decode returns
        elif type(where) is int:
            if self._frames is None or not 0 < where < len(self._frames):
                raise SerializationError(f"tensor refers to missing out-of-band frame {where}")
            buf = np.frombuffer(self._frames[where], np.uint8)
            if buf.nbytes != nbytes:
                raise SerializationError(f"frame {where} has {buf.nbytes} bytes, expected {nbytes}")
        else:
            if self.tensors is None:
                raise SerializationError(
                    "message carries an out-of-band tensor but this Decoder has no tensor receiver"
                )
            self._opened.append(where)  # before get: a failed get releases the block itself
            buf = self.tensors.get(where, nbytes)
        if code == EXT_NUMPY:
            if nbytes:
                arr = np.frombuffer(buf, np_dtype)
            else:
                arr = np.empty(0, np_dtype)
            if extra == "F":
                return arr.reshape(shape, order="F")
            arr = arr.reshape(shape)
            return arr[()] if extra == "s" else arr
        return _as_torch(buf, torch_dtype, shape, extra, self.tensors)


def _numpy():
    import numpy

    return numpy


def _as_torch(buf, dtype, shape, device_uuid, tensors):
    """A tensor over ``buf`` (kept alive by the tensor), or a fresh one when empty."""
    torch = _torch()
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
    if device_uuid is not None and tensors is not None:
        # A CUDA tensor sent as a host copy: put it back on the same GPU if we see it.
        index_for_uuid = getattr(tensors, "cuda_index_for_uuid", None)
        index = index_for_uuid(device_uuid) if index_for_uuid is not None else None
        if index is not None:
            t = t.to(f"cuda:{index}")
    return t
