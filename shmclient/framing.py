"""How a channel's messages become records and back: record types, framings, BadMessage.

Middle layer, under ``channel`` and ``channel_zmq``: imports ``codec``, ``messages`` and
msgspec (``tensors`` only for type names); never the ring, ``shm``, ``waiting``, asyncio,
clients or the engine. It owns the record types of shmclient's protocol (``REQ_*``
requests, ``REC_OUTPUTS``, ``REC_RELEASE``) and the struct each one carries, the
``Framing`` a ``ShmChannel`` takes as a parameter and ``NativeFraming`` (shmclient's
own), the typed decoders per record type, and ``BadMessage``: a message that arrived
intact but did not decode, handed up in its place so that it fails alone. Nothing here
blocks. Its contract (which failures are isolated, which are fatal): docs/design.md,
"Module notes", ``shmclient.framing``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol

import msgspec

from .codec import Decoder, Encoder, placed_handles
from .messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    UtilityRequest,
)

if TYPE_CHECKING:
    from .tensors import ShmTensorReceiver, ShmTensorSender

__all__ = [
    "REC_OUTPUTS", "REC_RELEASE", "REQ_ABORT", "REQ_ADD", "REQ_UTILITY", "BadMessage", "Framing",
    "FramingFactory", "NativeFraming", "decoders", "describe",
]

REQ_ADD = EngineCoreRequestType.ADD.code
REQ_ABORT = EngineCoreRequestType.ABORT.code
REQ_UTILITY = EngineCoreRequestType.UTILITY.code
#: engine → frontend: one EngineCoreOutputs batch.
REC_OUTPUTS = 0x20
#: either way: tensor blocks the receiver is done with (payload from take_releases()).
REC_RELEASE = 0x10

_PAYLOAD_TYPES: dict[int, Any] = {
    REQ_ADD: EngineCoreRequest,
    REQ_ABORT: list[str],
    REQ_UTILITY: UtilityRequest,
    REC_OUTPUTS: EngineCoreOutputs,
}


def decoders(tensors: ShmTensorReceiver | None) -> dict[int, Decoder]:
    return {t: Decoder(typ, tensors=tensors) for t, typ in _PAYLOAD_TYPES.items()}


class Framing(Protocol):
    """How a channel's messages become ring records and back: a parameter of
    ``ShmChannel``, built from the channel's tensor sender and receiver (so that
    tensors can travel out of band). ``encode(obj)`` gives one record's payload;
    ``decoders`` maps each record type a peer may send to an object whose
    ``decode(view)`` returns the message (the view is valid only during the call) and
    whose ``salvage(view)`` returns what an untyped read still sees (for ``BadMessage``);
    ``fields`` gives, per record type, the wire position of each field a reader may
    want from a message that did not decode. A framing may also have
    ``handles(rtype, payload)``: the out-of-band handles an encoded payload references,
    exactly (the channel frees their blocks when that message will not be sent); one
    whose messages carry user data that could pass for a handle has none."""

    decoders: Mapping[int, Any]
    fields: Mapping[int, Mapping[str, int]]

    def encode(self, obj: Any) -> Any: ...


class NativeFraming:
    """shmclient's own protocol: one record per message, the record type naming its
    struct (``REQ_*``, ``REC_OUTPUTS``), encoded by ``codec`` with tensors out of band."""

    def __init__(self, tensor_tx: ShmTensorSender | None, tensor_rx: ShmTensorReceiver | None) -> None:
        self.encode = Encoder(tensors=tensor_tx).encode
        self.decoders = decoders(tensor_rx)
        self.fields = _FIELD_POS

    @staticmethod
    def handles(rtype: int, payload: Any) -> list:
        """Exact: a tensor is an extension type of the codec's own, which no other value
        encodes to."""
        return placed_handles(payload)


#: Wire position of each field, per record type whose payload is a struct.
_FIELD_POS: dict[int, dict[str, int]] = {
    t: {name: i for i, name in enumerate(typ.__struct_fields__)}
    for t, typ in _PAYLOAD_TYPES.items()
    if hasattr(typ, "__struct_fields__")
}


class BadMessage:
    """A message that arrived intact but could not be decoded; stands in its place.

    ``rtype``: its record type; ``error``: the decoder's message (msgspec's, e.g.
    ``Expected `str`, got `int` - at `$[0]```); ``raw``: what an untyped decode could
    still read (a list for a struct), or None. ``field(name)`` reads one field of the
    expected struct from ``raw`` (None when absent), so that the reader can still tell
    whose message it was (``request_id``, ``call_id``, ``client_index``).
    """

    __slots__ = ("rtype", "error", "raw", "fields")

    def __init__(self, rtype: int, error: str, raw: Any,
                 fields: Mapping[int, Mapping[str, int]] | None = None) -> None:
        self.rtype = rtype
        self.error = error
        self.raw = raw
        self.fields = _FIELD_POS if fields is None else fields

    def field(self, name: str) -> Any:
        pos = self.fields.get(self.rtype, {}).get(name)
        raw = self.raw
        if pos is None or type(raw) is not list or pos >= len(raw):
            return None
        return raw[pos]

    def __repr__(self) -> str:
        return f"BadMessage(0x{self.rtype:02x}, {self.error!r})"


def describe(e: BaseException) -> str:
    if isinstance(e, msgspec.ValidationError):
        return str(e)
    return f"{type(e).__name__}: {e}"


#: Builds a channel's framing from its tensor sender and receiver.
FramingFactory = Callable[["ShmTensorSender", "ShmTensorReceiver"], Framing]
