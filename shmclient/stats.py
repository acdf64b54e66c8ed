"""The transport's statistics as frozen records: a ring's, a tensor sender's, a channel's.

Lowest layer: imports only msgspec; never the ring, tensors or channel modules that fill
these records, nor ``waiting``, asyncio, clients or the engine. ``Ring.statistics()``,
``ShmTensorSender.statistics()`` and ``ShmChannel.statistics()`` /
``ZmqChannel.statistics()`` each return a snapshot that never changes afterwards (a
frozen ``msgspec.Struct``: compare, hash, ``msgspec.structs.asdict`` or
``msgspec.json.encode`` it). Counters are hints read without a lock from shared memory
or under the sender's lock; they never decide anything. Nothing here blocks.
"""

from __future__ import annotations

import msgspec

__all__ = ["ChannelStatistics", "RingStatistics", "TensorStatistics"]


class RingStatistics(msgspec.Struct, frozen=True):
    """Counters of both sides of one ring, read from its shared header (the names the C
    end ``shmclient._ring.stats`` gives them). Positions and counts only grow."""

    #: Data bytes of the ring.
    capacity: int
    #: Bytes the producer has published (its position).
    head: int
    #: Bytes the consumer has released (its position).
    tail: int
    #: Messages and payload bytes the producer published (a message sent in fragments
    #: counts once, when its last fragment is written).
    tx_records: int
    tx_bytes: int
    #: Publications (a batch of records is published once).
    tx_batches: int
    #: Producer waits for room that ended ready while spinning / after sleeping.
    tx_spins: int
    tx_blocks: int
    #: Times the producer went round the end of the data area.
    wraps: int
    #: Waits for room the producer began (counted once per wait, on its first slice).
    waits_on_full: int
    #: Fragments written of messages longer than one record.
    fragments: int
    #: Messages and payload bytes the consumer read and released.
    rx_records: int
    rx_bytes: int
    #: Reads (one read takes every record published when it looked).
    rx_batches: int
    #: Consumer waits for data that ended ready while spinning / after sleeping.
    rx_spins: int
    rx_blocks: int


class TensorStatistics(msgspec.Struct, frozen=True):
    """What one ``ShmTensorSender`` holds and has sent (a snapshot under its lock)."""

    #: Size of its arena segment (1 when the channel has no arena).
    arena_bytes: int
    #: Arena bytes in blocks the receiver has not released yet, now and at most so far.
    used_bytes: int
    peak_used_bytes: int
    #: Handles sent and not yet released: arena blocks, one-off segments, CUDA tensors.
    blocks_in_flight: int
    one_offs_in_flight: int
    cuda_in_flight: int
    #: Free extents of the arena (fragmentation: 1 is one free run).
    free_extents: int
    #: Tensors sent through the arena, as one-off segments, by CUDA IPC, and tensors
    #: declined for lack of memory (the codec then sent their bytes inline).
    sent_arena: int
    sent_one_off: int
    sent_cuda: int
    sent_inline_fallback: int
    #: Handles the receiver released (or a failed encode cancelled).
    released: int


class ChannelStatistics(msgspec.Struct, frozen=True):
    """One side of a channel: its two rings' counters and its tensor sender's. A field is
    None where the channel has no such thing (a ZMQ channel has neither rings nor an
    arena)."""

    #: The ring this side writes (requests, for a frontend).
    tx: RingStatistics | None = None
    #: The ring this side reads (outputs, for a frontend).
    rx: RingStatistics | None = None
    #: This side's tensor sender.
    tensors: TensorStatistics | None = None
