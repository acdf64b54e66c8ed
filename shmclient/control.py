"""The control plane's messages between a frontend and its engine process: a tagged union
of msgspec structs (``Hello``, ``Auth``, ``Start``, ``Ready``, ``EngineCoreDead``,
``Shutdown``, ``Heartbeat``; each one zmq frame, a msgpack map whose ``type`` is its
kind), the one ``encode`` / ``decode`` pair, ``send`` / ``recv`` on a socket and the
heartbeat clock. Middle layer: imports zmq, msgspec, ``auth`` (its sizes), ``errors``,
``messages`` (the protocol version) and ``control_sockets``; never channels, clients,
``waiting`` or an engine. Every field is checked as it is decoded (types and bounds);
anything that is not one of these messages raises ``ControlMessageError`` naming what
is wrong. Only data-free, rare traffic travels here (~80 µs a message does not matter):
requests, outputs and utility calls go over the channel, in the ring's order. Who sends
what, and when: docs/design.md, "The control plane".
"""

from __future__ import annotations

import time
from typing import Annotated, Literal, Union

import msgspec
import zmq
from msgspec import Meta

from . import auth
from .control_sockets import MAX_MESSAGE_BYTES
from .errors import AuthenticationError, ConfigError, ProtocolError, ShmClientError
from .messages import PROTOCOL_VERSION

__all__ = [
    "Auth", "ControlMessageError", "ERROR_TYPES", "EngineCoreDead", "Hello", "Heartbeat",
    "HeartbeatClock", "Message", "Ready", "Shutdown", "Start", "decode", "encode", "recv",
    "send",
]

#: The longest error text an ``EngineCoreDead`` carries (the engine cuts a longer one).
MAX_ERROR_CHARS = 64 * 1024

Pid = Annotated[int, Meta(ge=1, le=2**31 - 1)]
Count = Annotated[int, Meta(ge=0, le=2**62)]
Positive = Annotated[int, Meta(ge=1, le=2**62)]
Nonce = Annotated[bytes, Meta(max_length=auth.NONCE_BYTES)]
Proof = Annotated[bytes, Meta(min_length=auth.PROOF_BYTES, max_length=auth.PROOF_BYTES)]
GpuUuids = Annotated[list[Annotated[str, Meta(max_length=128)]], Meta(max_length=1024)]

#: The start-up errors an engine may name in ``EngineCoreDead.error_type``, and the class
#: the frontend raises for each; any other error travels as text only.
ERROR_TYPES: dict[str, type[ShmClientError]] = {
    "ConfigError": ConfigError,
    "AuthenticationError": AuthenticationError,
}
ErrorType = Literal["ConfigError", "AuthenticationError"]


class ControlMessageError(ProtocolError):
    """A control message that does not decode, is of a kind nobody sends, has a field
    out of its bounds, or comes where the protocol has no place for it; the message says
    which. Raised by ``decode`` / ``recv`` and by the two ends' handshakes."""

    @classmethod
    def unexpected(cls, msg: Message, where: str) -> ControlMessageError:
        return cls(f"unexpected {type(msg).__name__} control message {where}")


class Hello(msgspec.Struct, frozen=True, tag=True):
    """engine → frontend, first: the engine process is up. ``nonce``: a remote engine's
    challenge (``auth``), empty otherwise."""

    pid: Pid
    protocol_version: Count
    nonce: Nonce = b""


class Auth(msgspec.Struct, frozen=True, tag=True):
    """Remote start-up only, both ways before ``Start``: the frontend's ``nonce`` and
    proof, then the engine's proof (``nonce`` empty)."""

    proof: Proof
    nonce: Nonce = b""


class Start(msgspec.Struct, frozen=True, tag=True):
    """frontend → engine: what to build and where the channel is. ``config`` (an
    ``EngineConfig``) and ``channel`` (the spec of ``transport``) stay msgpack here: the
    engine decodes them, typed, only after the frontend has authenticated."""

    config: msgspec.Raw
    transport: Literal["shm", "zmq"]
    channel: msgspec.Raw
    #: GPUs the frontend sees (UUIDs), so the engine knows where CUDA IPC can go.
    gpu_uuids: GpuUuids = []


class Ready(msgspec.Struct, frozen=True, tag=True):
    """engine → frontend: channel attached, core built; its real capacity and its pid."""

    pid: Pid
    num_gpu_blocks: Count
    block_size: Positive
    max_model_len: Positive
    #: GPUs the engine sees (UUIDs), so the frontend knows where CUDA IPC can go.
    gpu_uuids: GpuUuids = []


class EngineCoreDead(msgspec.Struct, frozen=True, tag=True):
    """engine → frontend, flushed before it exits: a fatal error. ``error_type`` names an
    ``ERROR_TYPES`` class for an error the frontend raises typed (``message`` is then
    that error's own text); None for any other (``message`` starts with its type)."""

    message: Annotated[str, Meta(max_length=MAX_ERROR_CHARS)]
    error_type: ErrorType | None = None

    @classmethod
    def of(cls, e: BaseException) -> EngineCoreDead:
        """The report of ``e``: typed when ``e`` is one of ``ERROR_TYPES``. Always
        encodable: a text that is not valid UTF-8 (a lone surrogate from a file name)
        has it escaped, and an error whose ``str()`` fails is named by its type."""
        try:
            text = str(e)
        except Exception:  # noqa: BLE001 - the report must go out whatever the error is
            text = f"<{type(e).__name__} whose str() failed>"
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
        for name, kind in ERROR_TYPES.items():
            if isinstance(e, kind):
                return cls(message=text[:MAX_ERROR_CHARS], error_type=name)  # type: ignore[arg-type]
        return cls(message=f"{type(e).__name__}: {text}"[:MAX_ERROR_CHARS])

    def text(self) -> str:
        """``<type>: <message>``, as the engine would print the error."""
        return f"{self.error_type}: {self.message}" if self.error_type else self.message


class Shutdown(msgspec.Struct, frozen=True, tag=True):
    """frontend → engine: stop now."""


class Heartbeat(msgspec.Struct, frozen=True, tag=True):
    """Both ways, remote engines only, from ``Start`` on: still here."""


Message = Union[Hello, Auth, Start, Ready, EngineCoreDead, Shutdown, Heartbeat]
_KINDS = tuple(t.__name__ for t in Message.__args__)  # type: ignore[attr-defined]
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(frames: list[bytes]) -> Message:
    """One received control message (its zmq frames). Raises ``ControlMessageError``
    naming what is wrong with anything else."""
    if len(frames) != 1:
        raise ControlMessageError(
            f"a control message of {len(frames)} frames (expected 1): the peer does not "
            f"speak control protocol {PROTOCOL_VERSION} (another shmclient version?)")
    frame = frames[0]
    if len(frame) > MAX_MESSAGE_BYTES:
        raise ControlMessageError(
            f"a control message of {len(frame)} bytes (at most {MAX_MESSAGE_BYTES})")
    try:
        return _decoder.decode(frame)
    except msgspec.DecodeError as e:
        raise ControlMessageError(_what_is_wrong(frame, e)) from None
    except RecursionError:  # nested deeper than this thread's stack allows
        raise ControlMessageError(_TOO_DEEP) from None


_TOO_DEEP = "a control message nested too deeply to decode"


def _what_is_wrong(frame: bytes, error: msgspec.DecodeError) -> str:
    try:
        obj = msgspec.msgpack.decode(frame)
    except msgspec.DecodeError:
        return (f"a control message that is not msgpack ({error}): the peer does not speak "
                f"control protocol {PROTOCOL_VERSION} (another shmclient version?)")
    except RecursionError:
        return _TOO_DEEP
    if not isinstance(obj, dict):
        return f"a control message that is a msgpack {type(obj).__name__}, not a map"
    kind = obj.get("type")
    if kind not in _KINDS:
        return (f"a control message of unknown kind {str(kind)[:64]!r} (known: "
                f"{', '.join(_KINDS)})")
    return f"a {kind} control message with an invalid field: {error}"


def send(sock: zmq.Socket, msg: Message, flags: int = 0) -> None:
    """Send one message (``flags``: ``zmq.NOBLOCK`` to raise ``zmq.Again`` rather than
    wait when the socket cannot take it)."""
    sock.send(_encoder.encode(msg), flags)


def recv(sock: zmq.Socket, timeout_s: float) -> Message | None:
    """One control message, or None if none arrives within ``timeout_s`` (blocks up to
    that). Raises ``ControlMessageError`` for one that arrived but is not a message
    (it has been taken off the socket)."""
    if sock.poll(max(0, int(timeout_s * 1000)), zmq.POLLIN):
        return decode(sock.recv_multipart())
    return None


_HEARTBEAT = encode(Heartbeat())


def load_torch_before_heartbeats() -> None:
    """Import torch now, before this process's heartbeats start: imported later, with the
    first tensor, its loading holds the GIL for up to ~0.4 s at a time (a 2-vCPU VM,
    2026-12-06), longer on a busy host, which could keep this process's beats from going
    out for longer than the peer waits (``heartbeat_timeout_s``, 1 s by default)."""
    import torch  # noqa: F401


class HeartbeatClock:
    """The clock of one side's heartbeats: when to send the next, and whether the peer
    has been silent too long. Not thread-safe (the one thread that owns the control
    socket uses it); never blocks."""

    def __init__(self, interval_s: float, timeout_s: float) -> None:
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        now = time.monotonic()
        self._last_rx = now
        self._next_tx = now

    def heard(self) -> None:
        """A message came from the peer (any message: a bad one too)."""
        self._last_rx = time.monotonic()

    def silence_s(self) -> float:
        return time.monotonic() - self._last_rx

    def expired(self) -> bool:
        """The peer has been silent for longer than the timeout."""
        return self.silence_s() > self.timeout_s

    def beat(self, sock: zmq.Socket) -> None:
        """Send ``Heartbeat`` if one is due (never blocks: dropped when the socket cannot
        take it, e.g. no peer connected)."""
        now = time.monotonic()
        if now < self._next_tx:
            return
        self._next_tx = now + self.interval_s
        try:
            sock.send(_HEARTBEAT, zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def poll_s(self) -> float:
        """How long the owner may wait before the next beat is due or the peer's
        silence runs out, whichever comes first."""
        now = time.monotonic()
        return max(0.0, min(self._next_tx - now, self._last_rx + self.timeout_s - now,
                            self.interval_s))
