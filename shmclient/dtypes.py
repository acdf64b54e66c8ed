"""The dtypes a message may name: an allowlist, so that a name from the wire never reaches
``getattr(torch, name)`` or ``numpy.dtype(name)`` unchecked.

Lowest layer: imports ``errors`` and the standard library; torch and numpy lazily (only
when a message names a dtype). Used by the codec (CPU tensors and arrays) and by
``tensors_cuda`` (CUDA IPC handles). A name outside the allowlist raises
``SerializationError``, which fails that message alone. Nothing here blocks.
"""

from __future__ import annotations

from typing import Any

from .errors import SerializationError

#: Every torch dtype a tensor may cross with (the names ``str(dtype)[6:]`` gives).
#: Quantized dtypes are left out: their tensors cannot cross. A name torch of this
#: version lacks is simply not accepted.
TORCH_DTYPE_NAMES = frozenset(
    [
        "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
        "float16", "bfloat16", "float32", "float64", "complex32", "complex64", "complex128",
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
        "float8_e8m0fnu", "float4_e2m1fn_x2",
        "bits8", "bits16", "bits1x8", "bits2x4", "bits4x2",
        *(f"uint{i}" for i in range(1, 8)),
        *(f"int{i}" for i in range(1, 8)),
    ]
)

#: numpy dtype kinds an array may cross with: bool, ints, floats, complex, datetime,
#: timedelta, fixed-width bytes and unicode (no objects, structured or void dtypes).
NUMPY_KINDS = frozenset("biufcmMSU")

_torch_cache: dict[str, Any] = {}
_numpy_cache: dict[str, Any] = {}


def torch_dtype(name: Any):
    """The torch dtype called ``name``, or ``SerializationError`` if it is not on the
    allowlist (only then is torch asked, and only for a name on the list)."""
    dt = _torch_cache.get(name) if type(name) is str else None
    if dt is not None:
        return dt
    if type(name) is not str or name not in TORCH_DTYPE_NAMES:
        raise SerializationError(f"unknown or unsupported torch dtype {_short(name)} in message")
    import torch

    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise SerializationError(f"unknown or unsupported torch dtype {name!r} in message")
    _torch_cache[name] = dt
    return dt


def numpy_dtype(name: Any):
    """The numpy dtype whose ``dtype.str`` is ``name`` (as the encoder sends it), or
    ``SerializationError`` for anything else (object, structured, string, sub-array
    dtypes, or a spelling the encoder never sends)."""
    dt = _numpy_cache.get(name) if type(name) is str else None
    if dt is not None:
        return dt
    if type(name) is not str or not 2 <= len(name) <= 16 or name[0] not in "<>|=":
        raise SerializationError(f"unknown or unsupported numpy dtype {_short(name)} in message")
    import numpy as np

    try:
        dt = np.dtype(name)
    except (TypeError, ValueError):
        raise SerializationError(f"unknown or unsupported numpy dtype {name!r} in message") from None
    if (
        dt.str != name
        or dt.kind not in NUMPY_KINDS
        or dt.fields is not None
        or dt.subdtype is not None
        or dt.hasobject
        or dt.itemsize == 0  # ("S0", "U0": the encoder never sends one; no shape fits it)
    ):
        raise SerializationError(f"unsupported numpy dtype {name!r} in message")
    if dt.kind in "biufc":
        # A few dozen spellings at most; strings and datetimes have one per length or
        # unit, which a peer could name without end: those are not kept.
        _numpy_cache[name] = dt
    return dt


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
