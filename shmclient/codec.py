"""msgpack encoder for the wire structs, with tensors carried by extension types.

Serialization layer: imports msgspec, ``codec_tensor`` (a tensor's wire layout),
``codec_decoder`` (the ``Decoder``, re-exported here), ``errors`` and the standard
library; torch and numpy are imported lazily (only once a message actually holds a
tensor or an array), and the out-of-band transport is reached only through the small
``TensorSender`` / ``TensorReceiver`` protocols (``codec_tensor``, re-exported here), so
this module never imports ``tensors``, the ring, ``waiting``, clients, asyncio or the
engine. It owns the ``Encoder``. torch tensors and numpy arrays may sit
anywhere in a message (struct fields typed ``Any``, lists, tuples, dicts). Values are
copied in C order (bit-exact, whatever the strides); Fortran-ordered arrays keep their
order; bfloat16 and every other dtype travel as raw bytes. Encoders and decoders are not
thread-safe: one per thread. Nothing here blocks.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import threading
from typing import Any

import msgspec

from .codec_decoder import Decoder
from .errors import SerializationError
from .codec_tensor import (
    DTYPE_NAMES,
    EXT_NUMPY,
    EXT_TORCH,
    EXT_TORCH_CUDA,
    HLEN,
    MAX_NDIM,
    MAX_TENSOR_BYTES,
    SMALL,
    TensorReceiver,
    TensorSender,
    check_torch,
    contiguous,
    contiguous_bytes,
    device_uuid,
    dtype_name,
    hdr_decode,
    hdr_encode,
)

from .dtypes import numpy_dtype

__all__ = [
    "Decoder",
    "Encoder",
    "TensorReceiver",
    "TensorSender",
    "EXT_TORCH",
    "EXT_NUMPY",
    "EXT_TORCH_CUDA",
    "MAX_NDIM",
    "MAX_TENSOR_BYTES",
]

log = logging.getLogger("shmclient")


def placed_handles(payload: Any) -> list:
    """The out-of-band handles (arena blocks, one-off segments, CUDA IPC) an ``Encoder``
    put in ``payload``: for freeing the blocks of a message that will never be sent. Reads
    the payload as untyped msgpack; only this process's own encodings are given to it."""
    found: list = []

    def ext_hook(code: int, data: memoryview) -> None:
        if code in (EXT_TORCH, EXT_NUMPY, EXT_TORCH_CUDA):
            (n,) = HLEN.unpack_from(data, 0)
            header = hdr_decode(data[2 : 2 + n])
            if type(header) is list and len(header) > 2 and type(header[2]) is list:
                found.append(header[2])
        return None

    msgspec.msgpack.Decoder(ext_hook=ext_hook).decode(payload)
    return found


class _Call(threading.local):
    """One thread's running encode (see ``Encoder._call``)."""

    placed: list | None = None
    frames: list | None = None


class Encoder:
    """Encodes any wire struct (or plain msgpack value) holding tensors.

    ``tensors``: where tensors of ``inline_threshold`` bytes or more go out of band; without
    it they are inline in the message (``encode``) or separate frames (``encode_frames``).
    """

    def __init__(self, tensors: TensorSender | None = None, inline_threshold: int = 256) -> None:
        self.tensors = tensors
        self.inline_threshold = inline_threshold
        self._enc = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        #: The running encode's own state, per thread (clients encode from any number of
        #: threads at once): ``placed``, the handles it put out of band (freed if it
        #: fails), and ``frames``, the list of an ``encode_frames`` (else None).
        self._call = _Call()
        self._warned_cuda = False

    # -- public -----------------------------------------------------------------------

    def encode(self, obj: Any) -> bytes:
        """One msgpack buffer (a fresh ``bytes``, never reused). Does not block.

        Raises ``SerializationError`` for a value that cannot cross (naming its type or
        the tensor's problem); tensors already placed out of band are then freed.
        """
        return self._run(None, self._enc.encode, obj)

    def encode_into(self, obj: Any, buf: bytearray, offset: int = 0) -> None:
        """Like ``encode`` but into ``buf`` at ``offset`` (``buf`` grows or shrinks to end
        exactly at the message). The caller owns ``buf`` and decides when to reuse it."""
        self._run(None, self._enc.encode_into, obj, buf, offset)

    def encode_frames(self, obj: Any) -> list:
        """``[msgpack, buffer, buffer, ...]`` for a zmq multipart send (``copy=False``).

        Large tensors go to ``tensors`` when one was given, else each becomes its own frame
        that shares the tensor's memory (zero-copy: do not modify the tensor until sent).
        """
        frames: list = [None]
        frames[0] = self._run(frames, self._enc.encode, obj)
        return frames

    # -- internals ----------------------------------------------------------------------

    def _run(self, frames: list | None, fn, *args):
        call = self._call
        call.placed = placed = []
        if frames is not None:
            call.frames = frames
        try:
            out = fn(*args)
        except BaseException as e:
            for h in placed:
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
        finally:
            if frames is not None:
                call.frames = None  # (they share the tensors' memory)
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
            check_torch(t)  # raises, naming the problem (a Parameter without grad passes)
        dtype = DTYPE_NAMES.get(t.dtype) or dtype_name(t.dtype)
        shape = list(t.shape)
        extra = None
        if t.is_conj():
            t = t.resolve_conj()
        if t.is_neg():
            t = t.resolve_neg()
        if t.is_cuda:
            handle = self.tensors.put_cuda(t) if self.tensors is not None else None
            if handle is not None:
                self._call.placed.append(handle)
                return self._ext(EXT_TORCH_CUDA, [dtype, shape, handle, None], None)
            if self.tensors is None and not self._warned_cuda:
                self._warned_cuda = True
                log.info("CUDA tensors are sent as host copies: no tensor transport configured")
            extra = device_uuid(t.device)
            t = t.detach().to("cpu")
        return self._place(EXT_TORCH, dtype, shape, extra, t, t.nbytes, torch_src=True)

    def _encode_numpy(self, a, np, scalar: bool) -> msgspec.msgpack.Ext:
        dt = a.dtype
        if dt.hasobject or dt.fields is not None or dt.kind == "V":
            raise SerializationError(
                f"cannot serialize a numpy array of dtype {dt!r} (object/structured dtypes "
                "do not cross)"
            )
        try:
            numpy_dtype(dt.str)  # what the receiving side takes, exactly
        except SerializationError:
            raise SerializationError(
                f"cannot serialize a numpy array of dtype {dt!r}: the receiving side does not "
                f"take the dtype {dt.str!r}") from None
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
                handle = self.tensors.put(src, nbytes, self._call.placed)  # (listed by put)
                if handle is not None:
                    return self._ext(code, [dtype, shape, handle, extra], None)
            else:
                frames = self._call.frames
                if frames is not None:
                    frames.append(contiguous_bytes(src, torch_src))
                    return self._ext(code, [dtype, shape, len(frames) - 1, extra], None)
        if torch_src and 0 < nbytes <= SMALL:
            # Small: one ctypes read of the (contiguous) tensor, then a bytes concat. ~3x
            # cheaper than going through a numpy view; ``src`` is alive throughout.
            src = contiguous(src)
            hdr = hdr_encode([dtype, shape, None, extra])
            raw = ctypes.string_at(src.data_ptr(), nbytes)
            return msgspec.msgpack.Ext(code, HLEN.pack(len(hdr)) + hdr + raw)
        return self._ext(code, [dtype, shape, None, extra], contiguous_bytes(src, torch_src))

    @staticmethod
    def _ext(code: int, header: list, raw) -> msgspec.msgpack.Ext:
        hdr = hdr_encode(header)
        n = len(hdr)
        if raw is None:
            return msgspec.msgpack.Ext(code, HLEN.pack(n) + hdr)
        data = bytearray(2 + n + raw.nbytes)
        HLEN.pack_into(data, 0, n)
        data[2 : 2 + n] = hdr
        data[2 + n :] = raw
        return msgspec.msgpack.Ext(code, data)
