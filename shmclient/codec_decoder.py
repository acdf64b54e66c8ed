"""msgpack decoder for the wire structs: the other half of ``codec.Encoder``.

Serialization layer, beside ``codec`` (which re-exports ``Decoder``): imports msgspec,
``codec_tensor`` (a tensor's wire layout and checks), ``dtypes`` (the allowlist), ``errors``
and the standard library, torch and numpy lazily; never ``codec``, ``tensors``, the
ring, ``waiting``, clients, asyncio or the engine. It owns turning bytes (or zmq frames)
back into a message: every tensor header is checked before anything is allocated or
mapped for it, out-of-band handles are opened through a ``codec.TensorReceiver``, and a
message that fails is ``salvage``-d for what can still be read. Not thread-safe: one
per thread. Nothing here blocks.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import msgspec

from .dtypes import numpy_dtype, torch_dtype
from .errors import SerializationError
from .codec_tensor import (
    EXT_NUMPY,
    EXT_TORCH,
    EXT_TORCH_CUDA,
    TensorReceiver,
    as_torch,
    nbytes_of,
    numpy_module,
    read_header,
)

__all__ = ["Decoder"]

log = logging.getLogger("shmclient")


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
            dtype, shape, where, _extra, _end = read_header(data)
        except Exception:  # no handle can be read
            return None
        if type(where) is not list or where in self._opened:
            return None
        try:
            if code == EXT_TORCH_CUDA:
                self.tensors.get_cuda(where)
            else:
                itemsize = (
                    torch_dtype(dtype).itemsize if code == EXT_TORCH else numpy_dtype(dtype).itemsize
                )
                nbytes = nbytes_of(itemsize, shape)
                self.tensors.get(where, nbytes)  # dropped at once: the block is released
        except Exception:
            # Not opened (a dtype or size refused, a handle that does not open): its
            # block still goes back, by id (a failed open released it already: the
            # sender ignores an id released twice).
            log.debug("could not open a tensor of an undecodable message", exc_info=True)
            release = getattr(self.tensors, "release_unopened", None)
            if release is not None:
                release(where)
        return None

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code not in (EXT_TORCH, EXT_NUMPY, EXT_TORCH_CUDA):
            raise SerializationError(f"unknown msgpack extension type {code}")
        dtype, shape, where, extra, end = read_header(data)
        if code == EXT_TORCH_CUDA:
            if self.tensors is None:
                raise SerializationError(
                    "message carries a CUDA tensor handle but this Decoder has no tensor receiver"
                )
            if type(where) is not list:
                raise SerializationError("malformed CUDA tensor header: no handle")
            self._opened.append(where)
            try:
                return self.tensors.get_cuda(where)
            except Exception:
                raise
            except BaseException:  # (Ctrl-C: maybe not opened; the salvage opens it again)
                self._opened.pop()
                raise
        np = numpy_module()
        if code == EXT_TORCH:
            t_dtype = torch_dtype(dtype)
            itemsize = t_dtype.itemsize
            if extra is not None and type(extra) is not str:
                raise SerializationError("malformed tensor header: bad device")
        else:
            np_dtype = numpy_dtype(dtype)
            itemsize = np_dtype.itemsize
            if extra not in (None, "F", "s") or (extra == "s" and shape):
                raise SerializationError("malformed array header: bad layout flag")
        nbytes = nbytes_of(itemsize, shape)
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
            try:
                buf = self.tensors.get(where, nbytes)
            except Exception:
                raise
            except BaseException:
                # A signal handler's exception in get: maybe not opened, so the salvage
                # opens it (and drops it) again; a block opened twice is released twice,
                # which the sender ignores (ids are never reused).
                self._opened.pop()
                raise
        if code == EXT_NUMPY:
            if nbytes:
                arr = np.frombuffer(buf, np_dtype)
            else:
                arr = np.empty(0, np_dtype)
            if extra == "F":
                return arr.reshape(shape, order="F")
            arr = arr.reshape(shape)
            return arr[()] if extra == "s" else arr
        return as_torch(buf, t_dtype, shape, extra, self.tensors)
