"""The GPUs this process sees, by UUID: what the handshake tells the peer for CUDA IPC.

Transport layer, beside ``tensors_cuda``: imports the standard library, and torch only on
a host where a GPU driver could answer (one of its device nodes exists), where torch is
already loaded, or when the caller asks for it (a CUDA engine's frontend); never clients,
asyncio, ``waiting``, the engine or the codec. Every client and engine process asks at
its handshake, so on a host without a GPU this keeps torch (about a second to import) out
of the start-up of a process that sends no tensor. An answer given without torch is not
kept: once torch is loaded the next call asks it. Nothing here blocks.
"""

from __future__ import annotations

import os
import sys
import threading

__all__ = ["gpu_driver_present", "local_gpu_uuids", "local_index_for_uuid"]

#: Device nodes of the drivers torch's CUDA API can reach a GPU through: NVIDIA's control
#: node, the integrated GPU of NVIDIA's Jetson boards (nvgpu), AMD's ROCm (HIP builds of
#: torch answer ``torch.cuda``), WSL2's GPU paravirtual device. Without any of them
#: ``torch.cuda.is_available()`` is False.
DRIVER_NODES = ("/dev/nvidiactl", "/dev/nvhost-ctrl-gpu", "/dev/nvgpu", "/dev/kfd", "/dev/dxg")

_uuid_to_index: dict[str, int] | None = None
_uuid_lock = threading.Lock()


def gpu_driver_present() -> bool:
    """Whether one of ``DRIVER_NODES`` exists (a GPU may be visible to torch)."""
    return any(os.path.exists(p) for p in DRIVER_NODES)


def local_gpu_uuids(*, ask_torch: bool = False) -> list[str]:
    """UUIDs of the GPUs this process sees, in index order (empty without CUDA).

    Meant for the handshake: the receiver reports them, the sender passes them as
    ``peer_gpu_uuids``. ``ask_torch``: import torch and ask it whatever the device nodes
    say (for a peer known to send CUDA tensors).
    """
    return list(_uuid_map(ask_torch))


def local_index_for_uuid(uuid: str) -> int | None:
    """This process's device index of the GPU ``uuid``, or None if it does not see it."""
    return _uuid_map().get(uuid)


def _uuid_map(ask_torch: bool = False) -> dict[str, int]:
    global _uuid_to_index
    m = _uuid_to_index
    if m is not None:
        return m
    if not (ask_torch or "torch" in sys.modules or gpu_driver_present()):
        return {}  # not kept: asked again once torch is loaded
    with _uuid_lock:
        if _uuid_to_index is None:
            import torch

            m = {}
            if torch.cuda.is_available():
                for i in range(torch.cuda.device_count()):
                    m[str(torch.cuda.get_device_properties(i).uuid)] = i
            _uuid_to_index = m
        return _uuid_to_index
