"""How vLLM's messages sit in the rings, and how the engine learns the rings' names.

Lowest layer of the plug-in: imports only ``shmclient.ring`` and msgspec, never vLLM. A
message is what vLLM's ``MsgpackEncoder.encode`` returns: one msgpack frame, then one
frame per large tensor (its raw bytes, referenced by index from the first frame). Each
frame is one ring record, all frames of a message written with one ``send_batch`` (so they
are contiguous: one producer per ring end, the end's lock held for the batch). The record
type is the message's kind (vLLM's request-type byte towards the engine, ``OUTPUTS``
towards the frontend) on the first frame and ``AUX`` on the others; ``MORE`` is or-ed in
on every frame but the last.

The frontend creates both rings and hands their specs to the engine core process it is
about to start in the environment variable ``SHMCLIENT_VLLM_SPEC`` (hex of a msgpack
``EngineSpec``); vLLM starts its engine with ``multiprocessing`` (spawn or fork), and both
pass the environment as it is at ``Process.start()``. ``RingSpec`` is kept opaque: each
one travels as its own msgspec encoding.

Besides vLLM's messages: ``RELEASES`` records (either way) carry tensor-block releases
back to the side that wrote the blocks, and one ``GPUS`` record (engine → frontend,
before READY) says which GPUs the engine sees; see ``shmclient.vllm.oob``.
"""

from __future__ import annotations

import os
from typing import Iterator, Sequence

import msgspec

from ..ring import Ring, RingSpec

__all__ = [
    "AUX",
    "GPUS",
    "RELEASES",
    "ENV_SPEC",
    "MORE",
    "OUTPUTS",
    "EngineSpec",
    "decode_spec",
    "encode_spec",
    "frames_to_records",
    "split_messages",
]

ENV_SPEC = "SHMCLIENT_VLLM_SPEC"

#: engine → frontend: one EngineCoreOutputs.
OUTPUTS = 0x20
#: either way: ids of tensor blocks the sender of this record is done with (packed u64s,
#: ``ShmTensorReceiver.take_releases``), for the peer's ``ShmTensorSender.on_release``.
RELEASES = 0x21
#: engine → frontend, before READY: msgpack list of the GPU UUIDs the engine sees
#: (empty when it has no CUDA context); CUDA tensors towards it go by IPC only to those.
GPUS = 0x22
#: a further frame (tensor bytes) of the message before it.
AUX = 0x3F
#: or-ed into the type of every frame of a message but its last.
MORE = 0x80


class EngineSpec(msgspec.Struct, frozen=True):
    """What the engine core process needs to attach: both rings, as encoded RingSpecs."""

    requests: bytes  # frontend → engine; the engine is its consumer
    outputs: bytes  # engine → frontend; the engine is its producer
    frontend_pid: int
    spin_us: float
    output_mode: str  # "thread" or "inline", see shmclient.vllm.engine
    #: handle of the frontend's one-byte "parked" flag (shmclient.vllm.frontend), "" for none
    parked: str = ""
    #: tensor arenas (segment handles; "" for none): requests' (frontend writes) and outputs'
    request_arena: str = ""
    output_arena: str = ""
    tensor_min_bytes: int = 64 * 1024
    cuda_ipc: bool = True
    #: GPU UUIDs the frontend has a CUDA context on (CUDA IPC towards it only for those)
    frontend_gpus: list = []


def encode_spec(requests: Ring, outputs: Ring, spin_us: float, output_mode: str, parked: str = "", **tensors) -> str:
    """``tensors``: the EngineSpec fields of the tensor arenas (request_arena, ...)."""
    spec = EngineSpec(
        msgspec.msgpack.encode(requests.spec),
        msgspec.msgpack.encode(outputs.spec),
        os.getpid(),
        float(spin_us),
        output_mode,
        parked,
        **tensors,
    )
    return msgspec.msgpack.encode(spec).hex()


def decode_spec(text: str) -> tuple[EngineSpec, RingSpec, RingSpec]:
    """Parse the environment variable's value. Raises ValueError naming the variable."""
    try:
        spec = msgspec.msgpack.decode(bytes.fromhex(text), type=EngineSpec)
        return (
            spec,
            msgspec.msgpack.decode(spec.requests, type=RingSpec),
            msgspec.msgpack.decode(spec.outputs, type=RingSpec),
        )
    except (ValueError, msgspec.DecodeError) as e:
        raise ValueError(f"{ENV_SPEC} does not hold a ring spec written by shmclient.vllm: {e}") from None


def frames_to_records(kind: int, frames: Sequence) -> list[tuple[int, object]]:
    """The ring records of one message (``kind`` 0..0x7F)."""
    last = len(frames) - 1
    return [(((kind if i == 0 else AUX) | (MORE if i < last else 0)), f) for i, f in enumerate(frames)]


def split_messages(records: list[tuple[int, bytes]], partial: list) -> Iterator[tuple[int, list]]:
    """Regroup received records into ``(kind, frames)`` messages. ``partial`` carries the
    frames of a message whose last frame has not arrived yet between calls (a message
    larger than the ring may be split across receive calls)."""
    for rtype, payload in records:
        if not partial:
            if rtype & ~MORE == AUX:
                raise RuntimeError("shmclient.vllm: a tensor frame arrived without its message")
            partial.append(rtype & ~MORE)
        partial.append(payload)
        if not rtype & MORE:
            kind, *frames = partial
            partial.clear()
            yield kind, frames
