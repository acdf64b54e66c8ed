"""A shared-memory channel's spec and the shared parts it names: two rings, two arenas.

Middle layer, under ``channel``: imports the ring's ends, ``ring_resources`` (its header
size), ``shm`` and ``errors``; never ``channel`` itself, the codec, ``waiting``,
asyncio, clients or the engine. It owns ``ShmChannelSpec`` (what the engine attaches
with, re-exported by ``channel``) and the two ways to get a channel's parts:
``create_parts`` makes them (the frontend, the owner: rings mapped and reserved now,
arenas reserved by their sender on its first tensor) and ``attach_parts`` maps them from
a spec (the engine). Either removes everything it made when it fails part-way. Nothing
here blocks.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import msgspec

from .errors import ShmCapacityError
from .ring import Ring
from .ring_consumer import RingConsumer
from .ring_producer import RingProducer
from .ring_resources import HEADER_BYTES as RING_HEADER_BYTES
from .ring_resources import RingSpec
from .shm import Segment, close_inherited, open_fds

__all__ = ["ChannelParts", "ShmChannelSpec", "attach_parts", "create_parts"]


class ShmChannelSpec(msgspec.Struct, frozen=True):
    """What the engine needs to attach: ring and arena names (engine's point of view)."""

    rx: RingSpec
    tx: RingSpec
    tensor_rx: str
    tensor_tx: str
    spin_us: float
    enable_cuda_ipc: bool = True


class ChannelParts(NamedTuple):
    """One side's rings and arena segments, and what it must unlink once the peer has
    attached (the owner's: all four; the attached side's: none)."""

    tx: Ring
    rx: Ring
    tensor_tx: Segment
    tensor_rx: Segment
    owned: list[Any]


def _remove(made: list[Any]) -> None:
    for m in reversed(made):
        m.unlink()
        m.close()


def create_parts(*, ring_capacity: int, arena_bytes: int, spin_us: float, wake_fd: bool,
                 enable_cuda_ipc: bool = True) -> tuple[ChannelParts, ShmChannelSpec]:
    """Create both rings and both arenas (frontend side): this side's parts and the spec
    the engine attaches with. ``wake_fd``: also make the pipes an event loop waits on
    (for outputs, and for room in the request ring). Raises ShmCapacityError naming the
    bytes the whole channel needs when its memory cannot be reserved; on any failure
    everything created so far is removed again."""
    made: list[Any] = []
    try:
        req = RingProducer.create(ring_capacity, spin_us=spin_us, producer_wake_fd=wake_fd)
        made.append(req)
        out = RingConsumer.create(ring_capacity, spin_us=spin_us, consumer_wake_fd=wake_fd)
        made.append(out)
        # Arenas are sized now and reserved by their sender on its first tensor, so a
        # client that never sends one never holds their memory. No arena (0 bytes):
        # a 1-byte segment holds no block, so every tensor goes as a one-off segment.
        size = max(arena_bytes, 1)
        arena_req = Segment.create(size, prefix="shmc-t", reserve=False)
        made.append(arena_req)
        arena_out = Segment.create(size, prefix="shmc-t", reserve=False)
        made.append(arena_out)
    except ShmCapacityError as e:
        _remove(made)
        raise capacity_error(ring_capacity, arena_bytes, e) from e
    except BaseException:
        _remove(made)
        raise
    spec = ShmChannelSpec(
        rx=req.spec,
        tx=out.spec,
        tensor_rx=arena_req.name,
        tensor_tx=arena_out.name,
        spin_us=spin_us,
        enable_cuda_ipc=enable_cuda_ipc,
    )
    return ChannelParts(req, out, arena_req, arena_out, made), spec


def capacity_error(ring_capacity: int, arena_bytes: int, e: ShmCapacityError) -> ShmCapacityError:
    """The error of a channel whose rings could not be reserved: the bytes it needs."""
    total = 2 * (ring_capacity + RING_HEADER_BYTES)
    return ShmCapacityError(
        f"a shared-memory channel needs {total} bytes ({total / (1 << 20):.0f} MiB: two rings "
        f"of {ring_capacity} bytes; its two tensor arenas of {arena_bytes} bytes are "
        f"reserved later, on their first tensor) and they could not be reserved: {e}")


def attach_parts(spec: ShmChannelSpec) -> ChannelParts:
    """Map the parts of a channel the peer created (engine side), then close the fds this
    process inherited for their handles. Raises as ``Ring.attach`` / ``Segment.attach``;
    on any failure what was mapped is closed again."""
    before = open_fds()
    rx = RingConsumer.attach(spec.rx, spin_us=spec.spin_us)
    try:
        tx = RingProducer.attach(spec.tx, spin_us=spec.spin_us)
        try:
            seg_rx = Segment.attach(spec.tensor_rx)
            try:
                seg_tx = Segment.attach(spec.tensor_tx)
            except BaseException:
                seg_rx.close()
                raise
        except BaseException:
            tx.close()
            raise
    except BaseException:
        rx.close()
        raise
    # Everything is mapped (and the pipes reopened): the fds inherited for the
    # handles are not needed any more.
    close_inherited([spec.rx.segment, spec.rx.wake_pipe, spec.rx.space_pipe,
                     spec.tx.segment, spec.tx.wake_pipe, spec.tx.space_pipe,
                     spec.tensor_rx, spec.tensor_tx], before)
    return ChannelParts(tx, rx, seg_tx, seg_rx, [])
