"""The typed result of the tensor transfer sweep (``shmclient_bench.tensors``).

``TensorSweep`` holds, per tensor size in bytes, the timings of every way of moving a
tensor the sweep measures; ``TensorSweep.points()`` gives them as ``TransferPoint``s, one
per (way, size), which the transfer plot draws. It encodes (``msgspec.json``) to the
layout results.json has always had for the section: sizes as string keys, times in µs.
"""

from __future__ import annotations

import msgspec


class Timing(msgspec.Struct, frozen=True):
    """The repeats of one transfer at one size, in µs (warm-up excluded)."""

    median_us: float
    p99_us: float
    min_us: float
    n: int


class Copies(msgspec.Struct, frozen=True):
    """The in-process limit at one size: a memcpy into a preallocated buffer
    (``np.copyto``), ``torch.Tensor.copy_`` and ``clone``."""

    np_copyto: Timing
    torch_copy_: Timing
    torch_clone: Timing


class TensorHost(msgspec.Struct, frozen=True):
    """The machine the sweep ran on, and its load average before and after."""

    python: str
    torch: str
    cpus: int | None
    torch_threads: int
    load_avg_1m: float
    machine: str
    load_avg_1m_after: float


class TransferPoint(msgspec.Struct, frozen=True):
    """One point of the transfer plot: the median time of one way of moving a tensor
    (``series``) at one size."""

    series: str
    size_bytes: int
    median_us: float


class TensorSweep(msgspec.Struct, frozen=True, omit_defaults=True):
    """Every figure of the sweep, by size in bytes. ``cuda_ipc`` only with CUDA."""

    host: TensorHost
    quick: bool
    memcpy: dict[int, Copies]
    shm_view: dict[int, Timing]
    shm_copy: dict[int, Timing]
    zmq: dict[int, Timing]
    cuda_ipc: dict[int, Timing] | None = None

    def points(self) -> list[TransferPoint]:
        """One point per way of moving a tensor and size, way by way (the memcpy
        variants first, then shm view, shm copy, zmq and CUDA IPC), sizes ascending."""
        out = [
            TransferPoint(f"memcpy {name}", size, getattr(copies, name).median_us)
            for name in Copies.__struct_fields__
            for size, copies in sorted(self.memcpy.items())
        ]
        ways = {"shm_view": self.shm_view, "shm_copy": self.shm_copy, "zmq": self.zmq,
                "cuda_ipc": self.cuda_ipc or {}}
        for series, timings in ways.items():
            out += [TransferPoint(series, size, t.median_us) for size, t in sorted(timings.items())]
        return out
