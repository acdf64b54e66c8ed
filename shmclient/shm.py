"""Anonymous shared-memory segments: create (owner) / attach / close / release the handle.

Lowest layer: imports only ``errors`` and the standard library. It owns the life-cycle
rules every segment in shmclient follows:

* a segment is a ``memfd_create`` file: it has no name in /dev/shm or anywhere else, so
  nothing can outlive the processes that map it, whatever kills them and whenever;
* the backing memory is reserved at creation with ``posix_fallocate``, so a host that
  cannot hold it fails here with a ``ShmCapacityError`` naming the bytes, never with
  SIGBUS later;
* its *handle* is a string ``memfd:<pid>:<fd>:<inode>``: the creator's pid, the fd number
  in the creator and the inode. A peer opens it through ``/proc/<pid>/fd/<fd>`` (or uses
  the same fd if it inherited it, e.g. with ``subprocess.Popen(pass_fds=...)``) and checks
  the inode, so a recycled pid or fd number is refused. The creator keeps the fd open
  until ``release_handle()`` (the equivalent of unlinking a name): after that the handle
  no longer opens, and the memory lives exactly as long as some mapping of it;
* ``close()`` unmaps. Only the creator holds a handle; the peer closes its fd as soon as
  it has mapped the segment.

posix_ipc is no longer used: named segments and semaphores could be left in /dev/shm by a
process killed between creation and unlink, and the semaphores were replaced by the
futex words of the C ring (``shmclient._ring``).

Nothing here blocks.
"""

from __future__ import annotations

import mmap
import os

from .errors import ShmCapacityError

PAGE = mmap.PAGESIZE
HANDLE_PREFIX = "memfd:"


def _capacity_error(what: str, size: int, err: OSError) -> ShmCapacityError:
    return ShmCapacityError(
        f"cannot reserve {size} bytes of shared memory for {what}: {err.strerror or err}. "
        f"The memory comes from the host's (or the container's) memory limit; free some "
        f"memory or ask for a smaller ring or arena."
    )


def parse_handle(handle: str) -> tuple[str, int, int, int]:
    """``(kind, pid, fd, inode)`` of a ``memfd:`` or ``pipe:`` handle; ValueError if it is
    not one."""
    try:
        kind, pid, fd, ino = handle.split(":")
        if kind not in ("memfd", "pipe"):
            raise ValueError
        return kind, int(pid), int(fd), int(ino)
    except (ValueError, AttributeError):
        raise ValueError(f"not a shared-memory handle: {handle!r}") from None


def open_handle(handle: str, flags: int = os.O_RDWR) -> int:
    """A new fd for the file behind ``handle`` (see the module docstring). Raises
    FileNotFoundError when the creator is gone or has released it, ValueError for a
    malformed handle. The caller owns the fd."""
    kind, pid, fd, ino = parse_handle(handle)
    path = f"/proc/{pid}/fd/{fd}"
    try:  # inherited (pass_fds), or our own: the same kind of file and inode
        link = os.readlink(f"/proc/self/fd/{fd}")
        if os.fstat(fd).st_ino == ino and link.startswith("/memfd:" if kind == "memfd" else "pipe:"):
            if kind == "memfd":
                return os.dup(fd)
            path = f"/proc/self/fd/{fd}"  # reopened: a pipe end of the kind asked for
    except OSError:
        pass
    try:
        new = os.open(path, flags | os.O_CLOEXEC)
    except OSError as e:
        raise FileNotFoundError(
            f"shared memory {handle!r} is gone (its creator exited or released it): {e.strerror}"
        ) from e
    if os.fstat(new).st_ino != ino:
        os.close(new)
        raise FileNotFoundError(f"shared memory {handle!r} is gone (the fd number was reused)")
    return new


def _flags(populate: bool) -> int:
    return mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)


class Segment:
    """A mapped shared-memory segment. ``buf`` is a writable memoryview of all of it;
    ``name`` is the handle a peer attaches with (``Segment.attach(name)``)."""

    __slots__ = ("name", "size", "owner", "fd", "_mmap", "buf", "__weakref__")

    def __init__(self, name: str, size: int, owner: bool, mm: mmap.mmap, fd: int) -> None:
        self.name = name
        self.size = size
        self.owner = owner
        self.fd = fd  # the creator's fd behind the handle; -1 once released
        self._mmap: mmap.mmap | None = mm
        self.buf: memoryview = memoryview(mm)

    @classmethod
    def create(
        cls, size: int, prefix: str = "shmc", name: str | None = None, *, populate: bool = False
    ) -> "Segment":
        """Create, reserve and map a new segment of ``size`` bytes (owner side).

        Raises ``ShmCapacityError`` when the memory cannot be reserved, ``ValueError`` for
        a size < 1. ``prefix`` names the memfd for /proc/<pid>/maps readers; ``name`` is
        accepted for compatibility and ignored. ``populate``: map every page now
        (MAP_POPULATE), so that the first touch of each page later costs no page fault
        (a few µs each: the tail of a ring's latency until it has wrapped once). Does
        not block.
        """
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"segment size must be an int >= 1 byte, got {size!r}")
        fd = os.memfd_create(prefix, os.MFD_CLOEXEC)
        try:
            try:
                os.ftruncate(fd, size)
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                raise _capacity_error(f"a {prefix!r} segment", size, e) from e
            mm = mmap.mmap(fd, size, flags=_flags(populate))
            ino = os.fstat(fd).st_ino
        except BaseException:
            os.close(fd)
            raise
        return cls(f"{HANDLE_PREFIX}{os.getpid()}:{fd}:{ino}", size, True, mm, fd)

    @classmethod
    def attach(cls, name: str, *, populate: bool = False) -> "Segment":
        """Map the segment behind a handle (peer side). ``FileNotFoundError`` if it is gone,
        ValueError if ``name`` is not a handle. ``populate`` as for ``create``. Does not
        block."""
        fd = open_handle(name)
        try:
            size = os.fstat(fd).st_size
            if size < 1:
                raise FileNotFoundError(f"shared memory {name!r} is empty")
            mm = mmap.mmap(fd, size, flags=_flags(populate))
        finally:
            os.close(fd)
        return cls(name, size, False, mm, -1)

    @property
    def closed(self) -> bool:
        return self._mmap is None

    def release_handle(self) -> None:
        """Close the creator's fd: the handle stops opening (owner only; idempotent). The
        mapping stays valid. Call it once the peer has attached."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    unlink = release_handle  # the name this step had when segments were named

    def close(self) -> None:
        """Unmap (idempotent; the handle stays valid until ``release_handle``). Views still
        exported keep the memory until they are freed."""
        mm, self._mmap = self._mmap, None
        if mm is None:
            return
        try:
            self.buf.release()
            mm.close()
        except BufferError:
            # Someone still holds a view (e.g. a received tensor); the mapping is freed
            # when the last view goes.
            pass

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.size} bytes"
        return f"<Segment {self.name} {state}{' owner' if self.owner else ''}>"


def make_pipe() -> tuple[int, int, str]:
    """A non-blocking pipe and the handle of its write end (``pipe:<pid>:<fd>:<inode>``),
    which a peer opens with ``open_handle(h, os.O_WRONLY | os.O_NONBLOCK)``."""
    r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    return r, w, f"pipe:{os.getpid()}:{w}:{os.fstat(w).st_ino}"
