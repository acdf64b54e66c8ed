"""Named POSIX shared-memory segments: create (owner) / attach / close / unlink.

Lowest layer: imports only ``errors``, posix_ipc and the standard library. It owns the
lifecycle rules every segment in shmclient follows, in the manner of CPython's
``multiprocessing.shared_memory`` but without its resource tracker:

* names are unguessable and collision-free (prefix, pid, 64 random bits) and created
  exclusively (``O_CREAT | O_EXCL``) with mode 0600; a clash fails loudly;
* the backing memory is reserved at creation with ``posix_fallocate``, so a full /dev/shm
  fails here with a ``ShmCapacityError`` naming the bytes needed, never as SIGBUS later;
* ``close()`` unmaps; only the creator ``unlink()``\\ s, and it does so as soon as the peer
  has attached, so that a later SIGKILL of both sides leaves nothing in /dev/shm.

Nothing here blocks.
"""

from __future__ import annotations

import mmap
import os
import secrets

import posix_ipc

from .errors import ShmCapacityError

SHM_DIR = "/dev/shm"
PAGE = mmap.PAGESIZE


def make_name(prefix: str = "shmc") -> str:
    """A fresh POSIX IPC name: ``/<prefix>-<pid>-<16 hex digits>``."""
    return f"/{prefix}-{os.getpid()}-{secrets.token_hex(8)}"


def shm_free_bytes() -> int:
    """Bytes free in /dev/shm right now (what an unprivileged process may use)."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def _capacity_error(name: str, size: int, free: int) -> ShmCapacityError:
    return ShmCapacityError(
        f"cannot reserve {size} bytes of shared memory for {name!r}: only {free} bytes are "
        f"free in {SHM_DIR}. Free some space or make /dev/shm larger "
        f"(Docker: --shm-size, e.g. --shm-size=1g), or ask for a smaller size."
    )


class Segment:
    """A mapped shared-memory segment. ``buf`` is a writable memoryview of all of it."""

    __slots__ = ("name", "size", "owner", "_mmap", "buf", "_unlinked", "__weakref__")

    def __init__(self, name: str, size: int, owner: bool, mm: mmap.mmap) -> None:
        self.name = name
        self.size = size
        self.owner = owner
        self._mmap: mmap.mmap | None = mm
        self.buf: memoryview = memoryview(mm)
        self._unlinked = not owner

    @classmethod
    def create(cls, size: int, prefix: str = "shmc", name: str | None = None) -> "Segment":
        """Create, reserve and map a new segment of ``size`` bytes (owner side).

        Raises ``ShmCapacityError`` when /dev/shm cannot hold it, ``FileExistsError`` when
        ``name`` is taken, ``ValueError`` for a size < 1. Does not block.
        """
        if size < 1:
            raise ValueError(f"segment size must be >= 1 byte, got {size}")
        name = name or make_name(prefix)
        free = shm_free_bytes()
        if size > free:
            raise _capacity_error(name, size, free)
        try:
            shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=0)
        except posix_ipc.ExistentialError as e:
            raise FileExistsError(f"shared memory segment {name!r} already exists") from e
        try:
            try:
                os.ftruncate(shm.fd, size)
                os.posix_fallocate(shm.fd, 0, size)
            except OSError as e:
                raise _capacity_error(name, size, shm_free_bytes()) from e
            mm = mmap.mmap(shm.fd, size)
        except BaseException:
            shm.close_fd()
            posix_ipc.unlink_shared_memory(name)
            raise
        shm.close_fd()
        return cls(name, size, True, mm)

    @classmethod
    def attach(cls, name: str) -> "Segment":
        """Map an existing segment (peer side). ``FileNotFoundError`` if it is gone."""
        try:
            shm = posix_ipc.SharedMemory(name)
        except posix_ipc.ExistentialError as e:
            raise FileNotFoundError(f"shared memory segment {name!r} does not exist") from e
        try:
            mm = mmap.mmap(shm.fd, shm.size)
            size = shm.size
        finally:
            shm.close_fd()
        return cls(name, size, False, mm)

    @property
    def closed(self) -> bool:
        return self._mmap is None

    def unlink(self) -> None:
        """Remove the name (owner only; idempotent). The mapping stays valid."""
        if self._unlinked:
            return
        self._unlinked = True
        try:
            posix_ipc.unlink_shared_memory(self.name)
        except posix_ipc.ExistentialError:
            pass

    def close(self) -> None:
        """Unmap (idempotent). Views still exported keep the memory until they are freed."""
        mm, self._mmap = self._mmap, None
        if mm is None:
            return
        self.buf.release()
        try:
            mm.close()
        except BufferError:
            # Someone still holds a view (e.g. a received tensor); the mapping is freed
            # when the last view goes.
            pass

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.size} bytes"
        return f"<Segment {self.name} {state}{' owner' if self.owner else ''}>"
