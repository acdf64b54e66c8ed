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
from typing import Any, Callable, Sequence

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
        #: Out-of-band handles the current decode opened or tried to (for ``salvage``),
        #: by ``_handle_key``: a set, so a salvage of many tensors is not quadratic.
        self._opened: set = set()
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
            # Not msgpack the untyped decode takes either (nested deeper than this
            # thread's stack decodes, invalid UTF-8, bytes left over...): its leading
            # fields may still say whom to answer, and the handles of its tensors are
            # released as this walk passes them (a block the failed decode passed goes
            # back twice: the sender ignores the second).
            try:
                return shallow_fields(buf, self._salvage_hook)
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
        if type(where) is not list or _handle_key(where) in self._opened:
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
            key = _handle_key(where)
            self._opened.add(key)
            try:
                return self.tensors.get_cuda(where)
            except Exception:
                raise
            except BaseException:  # (Ctrl-C: maybe not opened; the salvage opens it again)
                self._opened.discard(key)
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
            key = _handle_key(where)
            self._opened.add(key)  # before get: a failed get releases the block itself
            try:
                buf = self.tensors.get(where, nbytes)
            except Exception:
                raise
            except BaseException:
                # A signal handler's exception in get: maybe not opened, so the salvage
                # opens it (and drops it) again; a block opened twice is released twice,
                # which the sender ignores (ids are never reused).
                self._opened.discard(key)
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


def _handle_key(where: list) -> Any:
    """A hashable stand-in for an out-of-band handle (a list of scalars, from the wire)."""
    try:
        key = tuple(where)
        hash(key)
        return key
    except TypeError:  # something unhashable inside: its text stands for it
        return repr(where)


def shallow_fields(buf: Any, on_ext: Callable[[int, memoryview], Any] | None = None) -> list | None:
    """The fields of a msgpack array (a wire struct) read without recursion: each
    scalar (nil, bool, int, float, str) as itself, each array as the list of its
    leading scalars (an id inside a reply), anything else, and whatever follows a
    value that cannot be read, as None. None if ``buf`` is not an array. Every length
    is checked against the buffer; never raises (but what ``on_ext(code, data)``
    raises: it is called for each extension value passed, the rest of the message
    too, while the message can be read). """
    try:
        data = memoryview(buf).cast("B")
    except (TypeError, ValueError):
        return None
    r = _Reader(data, on_ext)
    try:
        n = r.array_len()
        if n is None:
            return None
        out: list = []
        for _ in range(n):
            m = r.array_len()
            if m is None:
                out.append(r.scalar())
                continue
            inner: list = []
            for _ in range(m):
                v = r.scalar()
                if v is _NOT_SCALAR:
                    r.skip(m - len(inner) - 1)  # (that value was skipped)
                    break
                inner.append(v)
            out.append(inner)
        if on_ext is not None:
            r.skip_all()  # the extensions after the fields (their handles)
        return [None if v is _NOT_SCALAR else v for v in out]
    except _Truncated:
        return None


_NOT_SCALAR = object()


class _Truncated(Exception):
    pass


class _Reader:
    """A bounds-checked msgpack reader over ``data`` (no recursion)."""

    __slots__ = ("data", "pos", "on_ext")

    def __init__(self, data: memoryview, on_ext: Callable[[int, memoryview], Any] | None = None) -> None:
        self.data = data
        self.pos = 0
        self.on_ext = on_ext

    def _take(self, n: int) -> memoryview:
        end = self.pos + n
        if end > len(self.data):
            raise _Truncated
        out = self.data[self.pos:end]
        self.pos = end
        return out

    def _uint(self, n: int) -> int:
        return int.from_bytes(self._take(n), "big")

    def array_len(self) -> int | None:
        """The length of the array at the position (consumed), or None (not consumed)."""
        if self.pos >= len(self.data):
            raise _Truncated
        b = self.data[self.pos]
        if 0x90 <= b <= 0x9F:
            self.pos += 1
            return b & 0x0F
        if b in (0xDC, 0xDD):
            self.pos += 1
            return self._uint(2 if b == 0xDC else 4)
        return None

    def scalar(self) -> Any:
        """The scalar at the position, or ``_NOT_SCALAR``: either way the value is
        consumed (skipped)."""
        if self.pos >= len(self.data):
            raise _Truncated
        b = self.data[self.pos]
        if b <= 0x7F:
            self.pos += 1
            return b
        if b >= 0xE0:
            self.pos += 1
            return b - 0x100
        if 0xA0 <= b <= 0xBF or b in (0xD9, 0xDA, 0xDB):
            self.pos += 1
            n = b & 0x1F if b <= 0xBF else self._uint({0xD9: 1, 0xDA: 2, 0xDB: 4}[b])
            try:
                return str(self._take(n), "utf-8")
            except UnicodeDecodeError:
                return _NOT_SCALAR
        if b in (0xC0, 0xC2, 0xC3):
            self.pos += 1
            return {0xC0: None, 0xC2: False, 0xC3: True}[b]
        if 0xCC <= b <= 0xD3:
            self.pos += 1
            size = 1 << ((b - 0xCC) & 3)
            v = self._uint(size)
            if b >= 0xD0 and v >= 1 << (8 * size - 1):
                v -= 1 << (8 * size)
            return v
        if b in (0xCA, 0xCB):
            self.pos += 1
            import struct

            return struct.unpack(">f" if b == 0xCA else ">d", self._take(4 if b == 0xCA else 8))[0]
        self.skip(1)
        return _NOT_SCALAR

    def skip(self, count: int) -> None:
        """Skip ``count`` values, however nested (a count of what is still to skip)."""
        data = self.data
        while count > 0:
            if self.pos >= len(data):
                raise _Truncated
            b = data[self.pos]
            self.pos += 1
            count -= 1
            if b <= 0x7F or b >= 0xE0 or b in (0xC0, 0xC2, 0xC3):
                continue
            if 0x80 <= b <= 0x8F:
                count += 2 * (b & 0x0F)
            elif 0x90 <= b <= 0x9F:
                count += b & 0x0F
            elif 0xA0 <= b <= 0xBF:
                self._take(b & 0x1F)
            elif b in (0xDC, 0xDD):
                count += self._uint(2 if b == 0xDC else 4)
            elif b in (0xDE, 0xDF):
                count += 2 * self._uint(2 if b == 0xDE else 4)
            elif b in (0xC4, 0xC5, 0xC6, 0xD9, 0xDA, 0xDB):
                self._take(self._uint({0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4}[b]))
            elif b in (0xC7, 0xC8, 0xC9):
                self._ext(self._uint({0xC7: 1, 0xC8: 2, 0xC9: 4}[b]))
            elif 0xCA <= b <= 0xD3:
                self._take({0xCA: 4, 0xCB: 8}.get(b) or 1 << ((b - 0xCC) & 3))
            elif 0xD4 <= b <= 0xD8:
                self._ext(1 << (b - 0xD4))
            else:  # 0xC1: never used
                raise _Truncated

    def _ext(self, n: int) -> None:
        """An extension value of ``n`` data bytes (after its type byte): to ``on_ext``."""
        code = self._take(1)[0]
        data = self._take(n)
        if self.on_ext is not None:
            self.on_ext(code if code < 128 else code - 256, data)

    def skip_all(self) -> None:
        """Skip every value left in the buffer."""
        while self.pos < len(self.data):
            self.skip(1)
