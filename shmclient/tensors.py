"""Out-of-band tensor transport: CPU tensors through a shared-memory arena, CUDA by IPC.

Transport layer under the codec: this module is the face of ``tensors_handles`` (the
handle and release formats), ``tensors_sender`` and ``tensors_receiver``, and re-exports
their names; like them it never imports the codec, the ring, ``waiting``, asyncio,
clients or the engine. The transport owns one arena per direction: a ``Segment`` that
the connection's owner created and both sides mapped. The sending side
(``ShmTensorSender``) allocates blocks in it, copies each tensor in once and sends a
handle ``[ARENA, id, offset]`` inside the message; the receiving side
(``ShmTensorReceiver``) turns the handle back into bytes and later hands the ids it is
done with back through ``take_releases()``, which the channel carries to the sender's
``on_release()``. Only then is a block reused, so a block is never rewritten while the
receiver may still read it, and releases may come in any order.

Receive policy (measured; the figures are in docs/measurements.md): blocks of at least
``view_from`` bytes (default 64 KiB) are handed out as zero-copy views whose lifetime
keeps the block allocated; the release is queued by a weakref callback on the block's
ndarray (the base of every numpy view and the buffer owner of every tensor made from it)
when the last of them is dropped: a deque append, safe from any thread and during GC,
never a lock. Smaller blocks are copied out and released at once: the copy costs about
the same as tracking a view and the block returns to the arena immediately. The sender
copies in with numpy (a memcpy; split over short-lived threads from 8 MiB up).

When the arena is full or a tensor is bigger than it, the sender does not wait: it
puts the tensor in a one-off segment of its own (a memfd, see ``shm``) and sends
``[ONE_OFF, id, handle]``. The receiver maps it and releases the id; the sender keeps the
handles of one-offs still in flight open and closes each when its release comes back (or
in ``close()``). Nothing is named, so a one-off whose sender or receiver is killed at any
moment is freed with the last process that maps it. If the memory cannot be reserved,
``put`` declines and the codec sends the bytes inline. Nothing here blocks.
"""

from __future__ import annotations

from .stats import TensorStatistics
from .tensors_handles import ALIGN, ARENA, CUDA_IPC, ONE_OFF
from .tensors_receiver import VIEW_FROM, ShmTensorReceiver
from .tensors_sender import PARALLEL_FROM, ShmTensorSender

__all__ = [
    "ALIGN", "ARENA", "CUDA_IPC", "ONE_OFF", "PARALLEL_FROM", "VIEW_FROM", "ShmTensorReceiver",
    "ShmTensorSender", "TensorStatistics",
]
