"""Helpers of the tests that fork: run a function in a forked child and read its report,
and count this process's mappings of one segment."""

from __future__ import annotations

import os
from typing import Callable


def mapped(handle: str) -> int:
    """This process's mappings of the memfd behind ``handle`` (its inode ends it)."""
    ino = handle.rsplit(":", 1)[1]
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if "/memfd:" in line and line.split()[4] == ino)


def in_child(report: Callable[[], str]) -> str:
    """Fork; the child writes what ``report()`` returns and leaves at once (``os._exit``:
    nothing of the parent's is cleaned up there). Returns the report, or "status N" for a
    child that failed."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            os.write(w, report().encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    chunks = []
    try:
        while chunk := os.read(r, 1 << 16):
            chunks.append(chunk)
    finally:
        os.close(r)
        _, status = os.waitpid(pid, 0)
    return b"".join(chunks).decode() if status == 0 else f"status {status}"
