"""A ``ShmChannel`` made by a third process for two others: a launcher that starts both
a frontend and an engine (vLLM's ``vllm serve`` parent with several API servers).

Middle layer beside ``channel``: imports ``channel_spec`` (the spec), ``ring_resources``
(``RingHandles``), ``shm`` and ``errors``; no end of any ring, nothing that waits, never
``waiting``, asyncio, clients or the engine. ``ChannelHandles`` creates the two
rings and two tensor arenas of one channel without mapping or owning an end of them, and
gives each side its spec: ``engine_spec`` (what ``ShmChannel.create`` returns for the
engine) and ``frontend_spec`` (the same rings and arenas from the frontend's side, for
``ShmChannel.attach``). Both sides attach through the launcher's /proc/<pid>/fd, so the
launcher keeps the handles open until both have attached (``release``); nothing is
named anywhere, so nothing outlives the processes that hold it, whatever kills them.
"""

from __future__ import annotations

from .channel_spec import ShmChannelSpec, capacity_error
from .errors import ShmCapacityError
from .ring_resources import RingHandles
from .shm import Segment

__all__ = ["ChannelHandles"]


class ChannelHandles:
    """Both sides' specs of one channel this process made for two others.

    ``ring_capacity``, ``arena_bytes``, ``spin_us`` and ``enable_cuda_ipc`` as for
    ``ShmChannel.create``; the frontend side always gets the pipes an event loop waits
    on (``wake_fd``). Raises ShmCapacityError naming the bytes when the rings' memory
    cannot be reserved; on any failure nothing is left."""

    def __init__(self, *, ring_capacity: int, arena_bytes: int, spin_us: float,
                 enable_cuda_ipc: bool = True) -> None:
        made: list = []
        try:
            req = RingHandles(ring_capacity, producer_wake_fd=True)
            made.append(req)
            out = RingHandles(ring_capacity, consumer_wake_fd=True)
            made.append(out)
            size = max(arena_bytes, 1)  # reserved by each sender on its first tensor
            for _ in range(2):
                seg = Segment.create(size, prefix="shmc-t", reserve=False)
                seg.close()  # the handle stays open, the mapping goes
                made.append(seg)
        except ShmCapacityError as e:
            _release(made)
            raise capacity_error(ring_capacity, arena_bytes, e) from e
        except BaseException:
            _release(made)
            raise
        self._made = made
        arena_req, arena_out = made[2].name, made[3].name
        #: The engine's side: reads requests, writes outputs.
        self.engine_spec = ShmChannelSpec(rx=req.spec, tx=out.spec, tensor_rx=arena_req, tensor_tx=arena_out,
                                          spin_us=spin_us, enable_cuda_ipc=enable_cuda_ipc)
        #: The frontend's side: writes requests, reads outputs.
        self.frontend_spec = ShmChannelSpec(rx=out.spec, tx=req.spec, tensor_rx=arena_out, tensor_tx=arena_req,
                                            spin_us=spin_us, enable_cuda_ipc=enable_cuda_ipc)

    def handle_fds(self) -> list[int]:
        """The fds behind the specs while they are open (a forked child closes those it
        inherited and does not use)."""
        fds: list[int] = []
        for m in self._made:
            fds += m.handle_fds() if isinstance(m, RingHandles) else [m.fd] if m.fd >= 0 else []
        return fds

    def release(self) -> None:
        """Close the handles (idempotent; never blocks): nothing can attach any more; the
        channel lives as long as the sides that attached."""
        _release(self._made)


def _release(made: list) -> None:
    for m in made:
        if isinstance(m, RingHandles):
            m.release()
        else:
            m.release_handle()
            m.close()
