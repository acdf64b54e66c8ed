"""The machine a run measured on: CPU, memory, OS, Python, package versions, GPU and date.

``machine_facts`` is what goes into results.json under ``machine``; ``cpu_model`` also
names the CPU in the footers of plots.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from importlib import metadata
from typing import Any

#: Packages whose versions go into the JSON (distribution names).
PACKAGES = ("torch", "numpy", "msgspec", "pyzmq", "psutil", "matplotlib", "shmclient")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(dist: str) -> str | None:
    for name in (dist, dist.replace("_", "-"), dist.replace("-", "_")):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    # Not installed as a distribution (e.g. run from a checkout): ask the module.
    module = {"pyzmq": "zmq"}.get(dist, dist)
    try:
        mod = __import__(module)
    except Exception:
        return None
    return str(getattr(mod, "__version__", getattr(mod, "VERSION", None)) or "") or None


def _git_commit() -> str | None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        out = subprocess.run(
            ["git", "-C", root, "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def machine_facts() -> dict[str, Any]:
    """CPU, memory, OS, Python, package versions, GPU (if torch sees one) and the date."""
    facts: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpu_model": cpu_model(),
        "cpu_count_logical": os.cpu_count(),
        "machine": platform.machine(),
        "os": platform.platform(),
        "python": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
        "packages": {p: _version(p) for p in PACKAGES},
        "git_commit": _git_commit(),
    }
    try:
        import psutil

        facts["cpu_count_physical"] = psutil.cpu_count(logical=False)
        facts["memory_total_bytes"] = psutil.virtual_memory().total
        facts["load_average"] = list(os.getloadavg())
    except Exception:
        pass
    try:
        import zmq

        facts["libzmq"] = zmq.zmq_version()
    except Exception:
        pass
    gpu: dict[str, Any] | None = None
    try:
        import torch

        facts["torch_cuda_build"] = torch.version.cuda
        if torch.cuda.is_available():
            gpu = {
                "count": torch.cuda.device_count(),
                "name": torch.cuda.get_device_name(0),
                "capability": list(torch.cuda.get_device_capability(0)),
                "memory_total_bytes": torch.cuda.get_device_properties(0).total_memory,
            }
    except Exception as e:  # torch missing or broken: say so, do not fail the run
        facts["torch_error"] = f"{type(e).__name__}: {e}"
    facts["gpu"] = gpu
    return facts
