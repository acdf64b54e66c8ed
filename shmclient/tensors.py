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
receiver may still read it, and releases may come in any order. Its contract (receive
policy, threads, one-off segments, life cycle): docs/design.md, "Module notes",
``shmclient.tensors``.
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
