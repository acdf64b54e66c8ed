"""How much memory this process may still reserve: the limits of its host and of its
memory cgroup, the margin to keep free, and the check every reservation passes first.

Lowest layer, under ``shm``: imports only ``errors`` and the standard library; never
``shm``, the ring, tensors, ``waiting``, asyncio, clients or the engine. A reservation
that does not fit fails here, with a ``ShmCapacityError`` naming the bytes and the limit
(``check_reservation``, ``capacity_error``), instead of with SIGBUS or the OOM killer
later. ``memory_limits`` reads ``/proc/meminfo`` and the cgroup files (v1 or v2) each
time it is called: the limits change while a process runs. Nothing here blocks.
"""

from __future__ import annotations

import os

from .errors import ConfigError, ShmCapacityError

__all__ = ["DEFAULT_MARGIN", "MARGIN_ENV", "capacity_error", "check_reservation", "margin_bytes",
           "memory_limits"]

#: Env variable: bytes a reservation must leave free under the tightest memory limit of
#: this process (cgroup or host), so that a reservation that only just fits does not
#: leave the process to be OOM-killed at its next allocation.
MARGIN_ENV = "SHMCLIENT_MEMORY_MARGIN_BYTES"
DEFAULT_MARGIN = 64 << 20
_UNLIMITED = 1 << 62


def capacity_error(what: str, size: int, err: OSError) -> ShmCapacityError:
    return ShmCapacityError(
        f"cannot reserve {size} bytes of shared memory for {what}: {err.strerror or err}. "
        f"The memory comes from the host's (or the container's) memory limit; free some "
        f"memory or ask for a smaller ring or arena."
    )


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if text == "max":
        return _UNLIMITED
    try:
        return int(text)
    except ValueError:
        return None


def _stat_field(path: str, *names: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 2 and parts[0] in names:
                    return int(parts[1])
    except (OSError, ValueError):
        pass
    return 0


def memory_limits(proc: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> list[tuple[int, str]]:
    """What this process may still use: ``[(bytes, where the limit is), ...]``, one entry
    per limit that applies: the host's ``MemAvailable``, and the memory cgroup of this
    process (v2: ``memory.max - memory.current`` of its cgroup and of every parent with a
    limit; v1: ``memory.limit_in_bytes`` (or the hierarchical limit) minus
    ``memory.usage_in_bytes``), page cache that can be dropped (inactive files) counted
    as free. Files that cannot be read are left out. Does not block."""
    out: list[tuple[int, str]] = []
    avail = _stat_field(f"{proc}/meminfo", "MemAvailable:")
    if avail:
        out.append((avail * 1024, f"MemAvailable of the host ({avail * 1024} bytes)"))
    try:
        with open(f"{proc}/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    for line in lines:
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hid == "0" and controllers == "":  # cgroup v2
            base = f"{cgroup_root}/unified" if os.path.isdir(f"{cgroup_root}/unified") and not \
                os.path.exists(f"{cgroup_root}/cgroup.controllers") else cgroup_root
            parts = [p for p in path.split("/") if p]
            # Down to the mount's root: in a private cgroup namespace (Docker on cgroup
            # v2, Kubernetes) the path reads "/" and the container's limit is the root's.
            for i in range(len(parts), -1, -1):
                d = "/".join([base, *parts[:i]])
                limit = _read_int(f"{d}/memory.max")
                if limit is None or limit >= _UNLIMITED:
                    continue
                used = (_read_int(f"{d}/memory.current") or 0) - _stat_field(
                    f"{d}/memory.stat", "inactive_file")
                out.append((limit - max(used, 0), f"memory.max={limit} of cgroup {d}"))
        elif "memory" in controllers.split(","):  # cgroup v1
            # The hierarchy's mount, by the controller's name or the line's list; a path
            # not found there (a container's: its own cgroup is mounted as the root)
            # means the mount's root.
            candidates = [f"{cgroup_root}/{m}{path}".rstrip("/") for m in ("memory", controllers)]
            candidates += [f"{cgroup_root}/{m}" for m in ("memory", controllers)]
            d = next((c for c in candidates if os.path.isdir(c)), candidates[0])
            limit = _read_int(f"{d}/memory.limit_in_bytes")
            if limit is None:
                continue
            hier = _stat_field(f"{d}/memory.stat", "hierarchical_memory_limit")
            if hier:
                limit = min(limit, hier)
            if limit >= _UNLIMITED:
                continue
            used = (_read_int(f"{d}/memory.usage_in_bytes") or 0) - _stat_field(
                f"{d}/memory.stat", "total_inactive_file")
            out.append((limit - max(used, 0), f"memory.limit_in_bytes={limit} of cgroup {d}"))
    return out


def margin_bytes() -> int:
    raw = os.environ.get(MARGIN_ENV)
    if raw is None:
        return DEFAULT_MARGIN
    try:
        value = int(raw)
        if value < 0:
            raise ValueError
    except ValueError:
        raise ConfigError(f"{MARGIN_ENV} must be a number of bytes >= 0, got {raw!r}") from None
    return value


def check_reservation(size: int, what: str) -> None:
    """Raise ``ShmCapacityError`` unless ``size`` more bytes fit under every memory limit
    of this process with ``SHMCLIENT_MEMORY_MARGIN_BYTES`` to spare: a reservation that
    does not fit would get the process (or, on the host, someone else) OOM-killed
    instead of failing. Does not block."""
    margin = margin_bytes()
    for free, where in memory_limits():
        if size + margin > free:
            raise ShmCapacityError(
                f"cannot reserve {size} bytes of shared memory for {what}: only "
                f"{max(free, 0)} bytes are free under {where}, and {margin} must stay free "
                f"({MARGIN_ENV}). Free some memory or ask for a smaller ring or arena."
            )
