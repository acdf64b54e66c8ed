"""How vLLM's messages sit in a ``ShmChannel``, and how the engine learns the channel.

Lowest layer of the plug-in: imports ``shmclient.channel`` (its spec), ``oob`` and msgspec;
vLLM's serializers only when a framing is built. A message is what vLLM's
``MsgpackEncoder.encode`` returns: one msgpack frame, then one frame per tensor it keeps
out of line (its raw bytes, referenced by index from the first frame). A message travels
as one ring record (fragmented by the ring when it is larger than one record): its type
is the message's kind (vLLM's request-type byte towards the engine, ``OUTPUTS`` towards
the frontend); a message of one frame is that frame; a message of several has ``MULTI``
or-ed into its type and its frames packed behind a header (``pack`` / ``unpack``: a
count, then each frame's length, every value checked when read). A message whose tensors
the sender placed in the channel's arena (or shared by CUDA IPC) also has ``PLACED``
or-ed in, and one more frame after vLLM's: the list of those handles, from the sender's
own record of what it placed (``oob.ArenaTensors``), so that a message that is never
sent, or never decoded whole, gives back exactly its blocks (``placed`` /
``_Frames.salvage``). Its contract (the
framing, ``GPUS`` and ``HELLO`` records, the spec variables): docs/design.md, "Module
notes", ``shmclient.vllm.wire``.
"""

from __future__ import annotations

import struct
import threading
from typing import Any, Sequence

import msgspec

from ..channel import ShmChannelSpec
from ..codec_decoder import shallow_fields

__all__ = [
    "ENV_FRONTEND_SPEC",
    "ENV_SPEC",
    "FrontendSpec",
    "GPUS",
    "HELLO",
    "MULTI",
    "OUTPUTS",
    "PLACED",
    "EngineSpec",
    "VllmFraming",
    "decode_frontend_specs",
    "decode_spec",
    "decode_specs",
    "encode_specs",
    "too_long",
    "kind_of",
    "message",
    "pack",
    "placed",
    "unpack",
]

ENV_SPEC = "SHMCLIENT_VLLM_SPEC"
ENV_FRONTEND_SPEC = "SHMCLIENT_VLLM_FRONTEND_SPEC"

#: engine → frontend: one EngineCoreOutputs.
OUTPUTS = 0x20
#: engine → frontend, before READY: msgpack list of the GPU UUIDs the engine sees
#: (empty when it has no CUDA context); CUDA tensors towards it go by IPC only to those.
GPUS = 0x22
#: either way, each side's first record: msgpack int, the sender's pid.
HELLO = 0x23
#: The largest pid Linux hands out (``pid_max`` is at most 2**22).
MAX_PID = 1 << 22
#: or-ed into a message's record type when its payload holds several frames (``pack``).
MULTI = 0x80
#: or-ed into a ``MULTI`` message's type when its last frame lists the out-of-band
#: handles its sender placed (msgpack list; not one of vLLM's frames).
PLACED = 0x40
#: The most frames one message may say it has (vLLM sends one per out-of-line tensor).
MAX_FRAMES = 1 << 16

_COUNT = struct.Struct("<I")


class EngineSpec(msgspec.Struct, frozen=True):
    """What the engine core process needs: the channel (its point of view) and the
    plug-in's settings."""

    channel: ShmChannelSpec
    frontend_pid: int
    output_mode: str  # "adaptive", "inline" or "thread", see shmclient.vllm.engine_outputs
    #: handle of the frontend's one-byte "parked" flag (shmclient.vllm.frontend_async), "" for none
    parked: str = ""
    #: whether tensors go through the channel's arenas (else as vLLM's own frames)
    arenas: bool = True
    tensor_min_bytes: int = 64 * 1024
    #: GPU UUIDs the frontend has a CUDA context on (CUDA IPC towards it only for those)
    frontend_gpus: list[str] = []
    #: output mode "inline": batches of more outputs than this go through the output thread
    inline_max_outputs: int = 16
    #: the engine this channel is for (vLLM's engine index, its data-parallel rank)
    engine_index: int = 0
    #: the frontend it serves (vLLM's client index: the API server's index)
    client_index: int = 0
    #: the process that made the channel when it is not the frontend (the ``vllm serve``
    #: parent with several API servers; the frontend's pid then comes in its HELLO), or 0
    launcher_pid: int = 0
    #: handle of the launcher's pipe: a byte there once this side has attached, or ""
    attached_pipe: str = ""


class FrontendSpec(msgspec.Struct, frozen=True):
    """What an API server started by a launcher needs for one engine: the channel (its
    point of view) and the settings the engine side was given."""

    channel: ShmChannelSpec
    engine_index: int
    client_index: int
    launcher_pid: int
    attached_pipe: str
    output_mode: str
    parked: str = ""
    arenas: bool = True
    tensor_min_bytes: int = 64 * 1024
    inline_max_outputs: int = 16


def encode_specs(specs: Sequence[Any]) -> str:
    """An environment variable's value: a list of ``EngineSpec`` (or ``FrontendSpec``)."""
    return msgspec.msgpack.encode(list(specs)).hex()


#: The longest ``NAME=value`` string Linux passes to a new program (MAX_ARG_STRLEN, 32
#: pages of 4 KiB, its terminating NUL included): a longer one makes the exec fail, and
#: vLLM's spawned processes die at their start without saying why.
ENV_STRING_MAX = 32 * 4096


def too_long(variable: str, value: str) -> "str | None":
    """Why ``variable=value`` cannot be handed to a new process, or None when it can."""
    size = len(variable) + 1 + len(value) + 1
    if size <= ENV_STRING_MAX:
        return None
    return (f"the channel specs of this launch ({variable}, {size} bytes) are longer than the "
            f"{ENV_STRING_MAX} bytes Linux passes in one environment variable")


def _decode(text: str, kind: type, variable: str) -> list:
    try:
        return msgspec.msgpack.decode(bytes.fromhex(text), type=list[kind])
    except (ValueError, msgspec.DecodeError) as e:
        raise ValueError(f"{variable} does not hold channel specs written by shmclient.vllm: {e}") from None


def decode_specs(text: str, engine_index: int) -> list[EngineSpec]:
    """The specs for engine ``engine_index`` in ``SHMCLIENT_VLLM_SPEC``'s value, one per
    frontend, in client-index order; [] when it holds none for that engine (an engine
    not reached over the rings). Raises ValueError naming the variable when the value
    is not one ``encode_specs`` wrote, or holds two for one frontend."""
    specs = sorted((s for s in _decode(text, EngineSpec, ENV_SPEC) if s.engine_index == engine_index),
                   key=lambda s: s.client_index)
    if [s.client_index for s in specs] != list(range(len(specs))):
        raise ValueError(f"{ENV_SPEC} holds channels for frontends {[s.client_index for s in specs]} "
                         f"of engine {engine_index}, not 0..n-1")
    return specs


def decode_spec(text: str, engine_index: int) -> EngineSpec | None:
    """The spec for engine ``engine_index`` when it serves one frontend (see
    ``decode_specs``), None when the value holds none for it."""
    specs = decode_specs(text, engine_index)
    return specs[0] if specs else None


def decode_frontend_specs(text: str, client_index: int) -> list[FrontendSpec]:
    """API server ``client_index``'s channels in ``SHMCLIENT_VLLM_FRONTEND_SPEC``'s
    value, in engine-index order ([] for none). ValueError as ``decode_specs``."""
    specs = sorted((s for s in _decode(text, FrontendSpec, ENV_FRONTEND_SPEC) if s.client_index == client_index),
                   key=lambda s: s.engine_index)
    if len({s.engine_index for s in specs}) != len(specs):
        raise ValueError(f"{ENV_FRONTEND_SPEC} holds two channels to one engine for API server {client_index}")
    return specs


def inherited_handles(text: "str | None", frontends: "str | None") -> list[str]:
    """Every handle the two variables' values name (``SHMCLIENT_VLLM_SPEC``'s and
    ``SHMCLIENT_VLLM_FRONTEND_SPEC``'s; None or "" for one not set): what a process forked
    while they were set may hold inherited fds of. A value that does not decode names
    none."""
    handles: list[str] = []
    for value, kind in ((text, EngineSpec), (frontends, FrontendSpec)):
        if not value:
            continue
        try:
            specs = _decode(value, kind, "")
        except ValueError:
            continue
        for spec in specs:
            c = spec.channel
            handles += [c.rx.segment, c.rx.wake_pipe, c.rx.space_pipe, c.tx.segment, c.tx.wake_pipe,
                        c.tx.space_pipe, c.tensor_rx, c.tensor_tx, spec.parked, spec.attached_pipe]
    return [h for h in handles if h]


def check_pid(obj: Any) -> int:
    """A pid from a peer's HELLO, checked: ValueError unless an int in 1..MAX_PID."""
    if not isinstance(obj, int) or isinstance(obj, bool) or not 1 <= obj <= MAX_PID:
        raise ValueError(f"a HELLO record names pid {obj!r}, not one in 1..{MAX_PID}")
    return obj


def pack(frames: Sequence[Any]) -> bytes:
    """Several frames as one payload: count (u32), each frame's length (u64), frames."""
    views = [f if isinstance(f, (bytes, bytearray)) else memoryview(f).cast("B") for f in frames]
    head = struct.pack(f"<I{len(views)}Q", len(views), *(len(v) for v in views))
    return b"".join([head, *views])


def unpack(view: memoryview) -> list[Any]:
    """``pack``'s frames again, copied out of ``view``: the first as bytes, the others
    as bytearrays (vLLM's decoder makes tensors on them in place). Raises ValueError
    naming what is wrong when the header does not fit the payload."""
    total = view.nbytes
    if total < _COUNT.size:
        raise ValueError(f"a multi-frame vLLM message of {total} bytes has no header")
    (n,) = _COUNT.unpack_from(view, 0)
    if not 2 <= n <= MAX_FRAMES:
        raise ValueError(f"a multi-frame vLLM message says it has {n} frames (2 to {MAX_FRAMES})")
    pos = _COUNT.size + 8 * n
    if pos > total:
        raise ValueError(f"a vLLM message header of {n} frames needs {pos} bytes, the record has {total}")
    sizes = struct.unpack_from(f"<{n}Q", view, _COUNT.size)
    if sum(sizes) != total - pos:
        raise ValueError(f"a vLLM message's frames add up to {sum(sizes)} bytes, the record holds {total - pos}")
    frames: list[Any] = []
    for i, size in enumerate(sizes):
        chunk = view[pos:pos + size]
        frames.append(bytes(chunk) if i == 0 else bytearray(chunk))
        pos += size
    return frames


def message(kind: int, frames: Sequence[Any], handles: Sequence[Any] = ()) -> tuple[int, Any]:
    """The record type and payload of one vLLM message (``kind`` 0..0x3F); ``handles``:
    the out-of-band handles its encode placed (``VllmFraming.take_placed``)."""
    if handles:
        return kind | MULTI | PLACED, pack([*frames, msgspec.msgpack.encode(list(handles))])
    if len(frames) == 1:
        return kind, frames[0]
    return kind | MULTI, pack(frames)


def kind_of(rtype: int) -> int:
    """The message kind of a record type (``MULTI`` and ``PLACED`` cleared)."""
    return rtype & ~(MULTI | PLACED)


def placed(rtype: int, payload: Any) -> list:
    """The handles a ``PLACED`` message's sender listed ([] for another), each a list
    whose second item is an int (a block id); ValueError (or msgspec's DecodeError) when
    the payload is not one ``message`` made."""
    if not rtype & PLACED:
        return []
    frames = unpack(memoryview(payload).cast("B"))
    handles = msgspec.msgpack.decode(frames[-1])
    if type(handles) is not list or len(handles) > MAX_FRAMES:
        raise ValueError("a vLLM message's list of placed tensors is not a list of at most "
                         f"{MAX_FRAMES} handles")
    return [h for h in handles if type(h) is list and len(h) > 1 and type(h[1]) is int]


class _Frames:
    """One record type's decoder: vLLM's ``MsgpackDecoder`` over the record's frames
    (copied out of the ring: vLLM keeps views of what it decodes); ``rtype``'s flags say
    whether there are several, and a list of placed handles after them."""

    __slots__ = ("dec", "multi", "placed", "provider", "rtype")

    def __init__(self, dec: Any, rtype: int, provider: Any = None) -> None:
        self.dec = dec
        self.rtype = rtype
        self.multi = bool(rtype & MULTI)
        self.placed = bool(rtype & PLACED)
        self.provider = provider  # the arena's (oob.ArenaProvider), or None

    def decode(self, view: memoryview) -> Any:
        if self.provider is not None:
            self.provider.opened.clear()
        if not self.multi:
            return self.dec.decode(bytes(view))
        frames = unpack(view)
        if self.placed:
            frames.pop()  # the sender's list of handles: for ``salvage`` only
        return self.dec.decode(frames)

    def salvage(self, view: memoryview) -> Any:
        """After ``decode`` raised: the first frame as plain msgpack (None when unreadable);
        the blocks of the handles the sender listed that the decode did not open are
        released (those it opened go back as the tensors it made are dropped)."""
        if self.placed and self.provider is not None:
            try:
                handles = placed(self.rtype, view)
            except Exception:  # noqa: BLE001 - an unreadable list: nothing we can free
                handles = []
            self.provider.release_unopened(handles)
        try:
            first = unpack(view)[0] if self.multi else view
            return msgspec.msgpack.decode(first)
        except RecursionError:  # nested too deep to decode here: its leading fields
            return shallow_fields(first)
        except Exception:
            return None


class _Msgpack:
    """A plain msgpack record (the GPUS list, a HELLO's pid)."""

    __slots__ = ("type",)

    def __init__(self, typ: Any = list[str]) -> None:
        self.type = typ

    def decode(self, view: memoryview) -> Any:
        return msgspec.msgpack.decode(view, type=self.type)

    def salvage(self, view: memoryview) -> Any:
        return None


class VllmFraming:
    """The channel's framing for vLLM's messages (see module doc).

    ``side`` is ``"frontend"`` (encodes requests, decodes ``OUTPUTS`` and ``GPUS``) or
    ``"engine"`` (decodes vLLM's request kinds, encodes outputs). CPU tensors of at least
    ``tensor_min_bytes`` and CUDA tensors go out of band through the channel's arenas
    (``oob``); ``provider`` is whoever opens placeholders that are not the arena's
    (vLLM's own tensor IPC receiver on the engine side; settable later). Called by one
    encoder at a time (vLLM's encoder is not thread-safe either; ``encode_placed``
    serializes a frontend's threads)."""

    def __init__(self, tensor_tx: Any, tensor_rx: Any, *, side: str, tensor_min_bytes: int = 64 * 1024,
                 cuda_ipc: bool = True, arenas: bool = True) -> None:
        from vllm.v1.engine import EngineCoreOutputs, EngineCoreRequest, EngineCoreRequestType
        from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

        from .oob import ArenaProvider, ArenaTensors

        self.provider = ArenaProvider(tensor_rx) if arenas else None
        self.consumer = ArenaTensors(tensor_tx, tensor_min_bytes, cuda_ipc) if arenas else None
        self.encoder = MsgpackEncoder(oob_tensor_consumer=self.consumer)
        provider = self.provider or self._fallback
        if side == "frontend":
            typed = {OUTPUTS: MsgpackDecoder(EngineCoreOutputs, oob_tensor_provider=provider)}
        elif side == "engine":
            generic = MsgpackDecoder(oob_tensor_provider=provider)
            typed = {t.value[0]: generic for t in EngineCoreRequestType}
            typed[EngineCoreRequestType.ADD.value[0]] = MsgpackDecoder(EngineCoreRequest,
                                                                       oob_tensor_provider=provider)
        else:
            raise ValueError(f"side must be 'frontend' or 'engine', got {side!r}")
        self.decoders: dict[int, Any] = {}
        for kind, dec in typed.items():
            for rtype in (kind, kind | MULTI, kind | MULTI | PLACED):
                self.decoders[rtype] = _Frames(dec, rtype, self.provider)
        if side == "frontend":
            self.decoders[GPUS] = _Msgpack()
        self.decoders[HELLO] = _Msgpack(int)
        add = EngineCoreRequest.__struct_fields__
        adds = EngineCoreRequestType.ADD.value[0]
        self.fields = {k: {name: i for i, name in enumerate(add)} for k in (adds, adds | MULTI, adds | MULTI | PLACED)}
        self._fallback_provider: Any = None
        self._encode_lock = threading.Lock()

    def set_fallback(self, provider: Any) -> None:
        """Who opens out-of-band placeholders that are not the arena's (vLLM's own)."""
        if self.provider is not None:
            self.provider.fallback = provider
        self._fallback_provider = provider

    def _fallback(self, dtype: str, shape: Any, meta: Any) -> Any:
        if self._fallback_provider is None:
            raise ValueError(f"shmclient.vllm: an out-of-band tensor placeholder nobody opens: {meta!r}")
        return self._fallback_provider(dtype, shape, meta)

    def encode(self, obj: Any) -> list:
        """vLLM's frames of ``obj`` (large tensors placed in the arena); ``message``
        makes them a record, with ``take_placed()``."""
        return self.encoder.encode(obj)

    def encode_placed(self, obj: Any) -> "tuple[list, list]":
        """``encode(obj)`` and ``take_placed()`` as one step, for a frontend whose
        threads share this framing (a utility call from one thread while another adds
        requests): the encoder and its list of placed handles are not thread-safe, and
        one message listing another's handles would have them freed under the engine
        when it is discarded."""
        with self._encode_lock:
            return self.encoder.encode(obj), self.take_placed()

    def take_placed(self) -> list:
        """The handles the last encode by ``encoder`` placed out of band, once ([] after
        that, and for none): the sender of that message lists them (``message``)."""
        return self.consumer.take() if self.consumer is not None else []

    @staticmethod
    def handles(rtype: int, payload: Any) -> list:
        """The handles a record of this framing lists as placed (see ``placed``): the
        channel frees them when the record is discarded unsent. Exact: the sender's own
        list, never read from vLLM's frames (which carry user data)."""
        return placed(rtype, payload)
