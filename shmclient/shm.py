"""Anonymous shared-memory segments: create (owner) / attach / close / release the handle.

Lowest layer: imports only ``capacity`` (the memory-limit check), ``errors`` and the
standard library; never the ring, tensors, codec, ``waiting``, asyncio, clients or the
engine. It owns the life-cycle rules every segment in shmclient follows: a ``memfd``
with no name, memory reserved after a check against the process's limits, sealed sizes,
a handle checked by inode, and closing. Nothing here blocks. Its contract (those rules
in full): docs/design.md, "Module notes", ``shmclient.shm``.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import mmap
import math
import os
import select
import stat
import threading
import weakref

from .capacity import (  # noqa: F401 - memory_limits & co. re-exported from here too
    DEFAULT_MARGIN,
    MARGIN_ENV,
    capacity_error,
    check_reservation,
    margin_bytes,
    memory_limits,
)
from . import forksafe
from .errors import ShmCapacityError

PAGE = mmap.PAGESIZE
HANDLE_PREFIX = "memfd:"

#: The seals every segment carries once sized: nobody (creator, peer, or a process that
#: opened it through /proc) can shrink it under a peer's mapping (SIGBUS) or grow it.
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_MADV_POPULATE_WRITE = 23  # Linux 5.14; not in Python's mmap module yet


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
    new = -1
    # A signal handler's exception (Ctrl-C's) after the new fd's number is kept closes it.
    # (One that comes as the call returns, before the number is kept, still loses it.)
    try:
        try:  # inherited (pass_fds), or our own: the same kind of file and inode
            link = os.readlink(f"/proc/self/fd/{fd}")
            if os.fstat(fd).st_ino == ino and link.startswith("/memfd:" if kind == "memfd" else "pipe:"):
                if kind == "memfd":
                    new = os.dup(fd)
                    return new
                path = f"/proc/self/fd/{fd}"  # reopened: a pipe end of the kind asked for
        except OSError:
            pass
        if kind == "memfd":
            flags |= os.O_NONBLOCK  # no effect on a memfd; a FIFO's open would wait for a writer
        try:
            new = os.open(path, flags | os.O_CLOEXEC)
        except OSError as e:
            raise FileNotFoundError(
                f"shared memory {handle!r} is gone (its creator exited or released it): {e.strerror}"
            ) from e
        if os.fstat(new).st_ino != ino:
            raise FileNotFoundError(f"shared memory {handle!r} is gone (the fd number was reused)")
        return new
    except BaseException:
        if new >= 0:
            os.close(new)
        raise


def open_peer_memfd(handle: str, peer_pid: int | None) -> int:
    """A read-only fd of the sealed memfd a peer's one-off handle names, checked: the
    handle is a ``memfd:`` one of ``peer_pid`` (any pid when None: an in-process pair),
    the opened file is a memfd (its /proc link reads ``/memfd:``), its inode is the
    handle's and it carries the ``SEALS`` against shrink and grow. Raises ValueError
    naming what is wrong, FileNotFoundError when it is gone. The caller owns the fd."""
    kind, pid, fd, ino = parse_handle(handle)
    if kind != "memfd":
        raise ValueError(f"{handle!r} is not a shared-memory segment handle")
    if peer_pid is not None and pid != peer_pid:
        raise ValueError(f"{handle!r} is not a segment of the peer (pid {peer_pid})")
    if fd < 0 or pid <= 0:
        raise ValueError(f"not a shared-memory handle: {handle!r}")
    try:
        # O_NONBLOCK: the fd may name a FIFO, whose open would wait for a writer
        new = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        raise FileNotFoundError(f"shared memory {handle!r} is gone: {e.strerror}") from e
    try:
        _check_sealed_memfd(new, handle, ino)
    except BaseException:
        os.close(new)
        raise
    return new


def _check_sealed_memfd(fd: int, handle: str, ino: int) -> None:
    """ValueError unless ``fd`` is a memfd (its /proc link reads ``/memfd:``, a regular
    file) sealed against shrinking and growing (a peer that shrank it under our mapping
    would kill us with SIGBUS on the next read); FileNotFoundError if its inode is not
    the handle's."""
    link = os.readlink(f"/proc/self/fd/{fd}")
    st = os.fstat(fd)
    if not link.startswith("/memfd:") or not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{handle!r} does not name a memfd segment")
    if st.st_ino != ino:
        raise FileNotFoundError(f"shared memory {handle!r} is gone (the fd number was reused)")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0
    need = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
    if seals & need != need:
        raise ValueError(f"{handle!r} is not sealed against shrinking and growing")


def open_fds() -> frozenset[int]:
    """The fd numbers open in this process now (for ``close_inherited``): the listing,
    less the fd the listing itself used (it names it, and has closed it since)."""
    out = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            fcntl.fcntl(int(name), fcntl.F_GETFD)
        except OSError:
            continue
        out.add(int(name))
    return frozenset(out)


def close_inherited(handles, before: "frozenset[int]") -> None:
    """Close the fds this process inherited for ``handles`` (``Popen(pass_fds=...)``, or
    a fork) once it has attached what they name: a handle of another process whose fd
    number was open here already in ``before`` (``open_fds()`` taken before attaching),
    on the same kind of file and inode. Afterwards nothing of the segment is reachable
    through this process's /proc/<pid>/fd. An fd opened since ``before`` is never closed:
    attaching opens the same file again, and in a process that inherited nothing its new
    fd may carry the very number the handle names (the creator's), which must stay open.
    Never raises; does not block."""
    me = os.getpid()
    for handle in handles:
        if not handle:
            continue
        try:
            kind, pid, fd, ino = parse_handle(handle)
            if pid == me or fd not in before:
                continue
            link = os.readlink(f"/proc/self/fd/{fd}")
            if link.startswith("/memfd:" if kind == "memfd" else "pipe:") and os.fstat(fd).st_ino == ino:
                os.close(fd)
        except (OSError, ValueError):
            pass


def drop_inherited(handles=()) -> None:
    """At the entry of a process forked from one that held segments, before it makes or
    attaches any: close every fd of a memfd of this project (its /proc link reads
    ``/memfd:shmc``: ``Segment.create``'s names) and every fd of a pipe one of
    ``handles`` names or ``make_pipe`` made before the fork, either end (both carry the
    pipe's inode). Such a process attaches what it needs through its creator's
    /proc/<pid>/fd; the fds it inherited would keep their memory allocated, and reachable
    through its own /proc/<pid>/fd, for its life, and every process it forks in turn
    would inherit them. Never raises; does not block."""
    pipes = set(_made_pipes)
    for handle in handles:
        try:
            kind, _, _, ino = parse_handle(handle)
        except ValueError:
            continue
        if kind == "pipe":
            pipes.add(f"pipe:[{ino}]")
    for fd, link in _fd_links().items():
        if link.startswith("/memfd:shmc") or link in pipes:
            try:
                os.close(fd)
            except OSError:
                pass


def _fd_links() -> dict[int, str]:
    """This process's open fds and what each is (its /proc link); {} if /proc cannot
    be read."""
    out: dict[int, str] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        try:
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except (OSError, ValueError):
            pass
    return out


def _same_file(fd: int) -> set[int]:
    st = os.fstat(fd)
    out = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            other = os.stat(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if other.st_ino == st.st_ino and other.st_dev == st.st_dev:
            out.add(int(name))
    return out


def _map(fd: int, size: int, flags: int, prot: int = mmap.PROT_READ | mmap.PROT_WRITE) -> mmap.mmap:
    """``mmap.mmap`` without the fd it keeps: Python's mmap object holds a dup of the fd
    for its whole life (before 3.13's ``trackfd=False``), which would keep the segment
    reachable through /proc/<pid>/fd. The dup is pointed at /dev/null instead (the
    object only uses it for ``size()``/``resize()``, which shmclient never calls, and
    closes it with the mapping)."""
    try:
        return mmap.mmap(fd, size, flags=flags, prot=prot, trackfd=False)  # type: ignore[call-arg]
    except TypeError:
        pass
    before = _same_file(fd)
    mm = None
    null = -1
    try:  # (a signal handler's exception once kept closes the mapping and /dev/null: see open_handle)
        mm = mmap.mmap(fd, size, flags=flags, prot=prot)
        extra = _same_file(fd) - before
        if extra:
            null = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
            for dup in extra:
                os.dup2(null, dup, inheritable=False)
        return mm
    except BaseException:
        if mm is not None:
            mm.close()  # (closes its dup of the fd too)
        raise
    finally:
        if null >= 0:
            os.close(null)


def _flags(populate: bool) -> int:
    return mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)


class Segment:
    """A mapped shared-memory segment. ``buf`` is a writable memoryview of all of it;
    ``name`` is the handle a peer attaches with (``Segment.attach(name)``)."""

    __slots__ = ("name", "size", "owner", "fd", "_mmap", "_lingering", "buf", "reserved", "__weakref__")

    def __init__(self, name: str, size: int, owner: bool, mm: mmap.mmap, fd: int) -> None:
        self.name = name
        self.size = size
        self.owner = owner
        self.fd = fd  # the creator's fd behind the handle; -1 once released
        self._mmap: mmap.mmap | None = mm
        #: The mapping a close could not unmap (a view kept it), while it lives.
        self._lingering: weakref.ref | None = None
        self.buf: memoryview = memoryview(mm)
        #: Whether the memory behind it is known to be reserved (``reserve()``).
        self.reserved = True
        forksafe.register(self)

    @classmethod
    def create(
        cls,
        size: int,
        prefix: str = "shmc",
        name: str | None = None,
        *,
        populate: bool = False,
        reserve: bool = True,
    ) -> "Segment":
        """Create, reserve and map a new segment of ``size`` bytes (owner side).

        Raises ``ShmCapacityError`` when the memory cannot be reserved (checked first
        against every memory limit of the process, see ``check_reservation``),
        ``ValueError`` for a size < 1. ``prefix`` starts the memfd's name (``<prefix>.<n>``,
        n its own in this process) for /proc/<pid>/maps readers; ``name`` is accepted
        for compatibility and ignored. ``populate``: map
        every page now (MAP_POPULATE), so that the first touch of each page later costs
        no page fault (a few µs each: the tail of a ring's latency until it has wrapped
        once). ``reserve=False``: size it but reserve nothing yet (no memory is used
        until ``reserve()`` or a write); ``populate`` is then ignored. The segment is
        sealed against shrinking and growing (``SEALS``). Does not block.
        """
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"segment size must be an int >= 1 byte, got {size!r}")
        if reserve:
            check_reservation(size, f"a {prefix!r} segment")
        fd, mm, seg = -1, None, None
        # A name of its own: a signal handler's exception can come as memfd_create
        # returns, before its number is kept; the descriptor is then found by its name.
        label = f"{prefix}.{next(_labels)}"
        try:  # (from the fd's creation on: a signal handler's exception anywhere frees it)
            fd = os.memfd_create(label, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            try:
                os.ftruncate(fd, size)
                if reserve:
                    os.posix_fallocate(fd, 0, size)
            except OSError as e:
                raise capacity_error(f"a {prefix!r} segment", size, e) from e
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            mm = _map(fd, size, _flags(populate and reserve))
            ino = os.fstat(fd).st_ino
            seg = cls(f"{HANDLE_PREFIX}{os.getpid()}:{fd}:{ino}", size, True, mm, fd)
            seg.reserved = reserve
            return seg
        except BaseException:
            if seg is not None:
                seg.close()
                seg.release_handle()
            else:
                if mm is not None:
                    try:
                        mm.close()
                    except BufferError:  # (a view of a half-made Segment: freed with it)
                        pass
                if fd >= 0:
                    os.close(fd)
                else:
                    _close_stray_memfd(label)
            raise

    @classmethod
    def attach(cls, name: str, *, populate: bool = False, size: int | None = None) -> "Segment":
        """Map the segment behind a handle (peer side). ``FileNotFoundError`` if it is gone,
        ValueError if ``name`` is not a handle or names anything but a memfd sealed
        against shrinking and growing (as ``create`` makes), one of another ``size``
        than the one given, or, with ``populate``, one whose memory is not all allocated
        (``create`` allocates it whole: mapping every page of a sparse file would take
        its memory here, from this process's limit). Both are checked before anything is
        mapped. ``populate`` as for ``create``. Does not block."""
        fd = open_handle(name)
        try:
            _check_sealed_memfd(fd, name, parse_handle(name)[3])
            st = os.fstat(fd)
            found = st.st_size
            if found < 1:
                raise FileNotFoundError(f"shared memory {name!r} is empty")
            if size is not None and found != size:
                raise ValueError(f"{name!r} is {found} bytes, not the {size} expected")
            if populate and st.st_blocks * 512 < found:
                raise ValueError(f"{name!r} has only {st.st_blocks * 512} of its {found} bytes allocated: "
                                 "not a segment its creator reserved")
            size = found
            mm = _map(fd, size, _flags(populate))
        finally:
            os.close(fd)
        seg = cls(name, size, False, mm, -1)
        seg.reserved = False  # unknown: ``reserve()`` makes sure before a first write
        return seg

    def reserve(self) -> None:
        """Reserve the memory of a segment created with ``reserve=False`` (either side,
        through its mapping; idempotent). Raises ``ShmCapacityError`` naming the bytes
        and the limit when it does not fit (checked first: a reservation beyond a cgroup
        limit would OOM-kill the process instead of failing). Does not block."""
        if self.reserved:
            return
        if self._mmap is None:
            raise ShmCapacityError("cannot reserve a closed segment")
        check_reservation(self.size, "a tensor arena")
        try:
            self._mmap.madvise(_MADV_POPULATE_WRITE)
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.ENOSYS):
                raise capacity_error("a tensor arena", self.size, e) from e
            # An older kernel: touch one byte of every page (nothing reads it yet).
            buf = self.buf
            for off in range(0, self.size, PAGE):
                buf[off] = buf[off]
        self.reserved = True

    @classmethod
    def attach_private(cls, name: str, peer_pid: int | None = None) -> "Segment":
        """Map a peer's one-off segment for reading (``open_peer_memfd`` checks it):
        copy-on-write, so a write through the mapping changes this process's copy only,
        never the file. ValueError for a handle that is not a sealed memfd of the peer,
        FileNotFoundError if it is gone. Does not block."""
        fd = open_peer_memfd(name, peer_pid)
        try:
            size = os.fstat(fd).st_size
            if size < 1:
                raise FileNotFoundError(f"shared memory {name!r} is empty")
            mm = _map(fd, size, mmap.MAP_PRIVATE)
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
        """Unmap (idempotent; the handle stays valid until ``release_handle``). While a
        view of it is still exported (a received tensor, a ring end a thread still waits
        on) the mapping stays until the last of them is gone (or a later ``close()``
        finds them gone)."""
        mm, self._mmap = self._mmap, None
        if mm is None:
            ref = self._lingering
            mm = ref() if ref is not None else None
            if mm is None:
                return
        # Kept before the try: a close that runs meanwhile (a ring end letting go of its
        # view in another thread) must find it. Weak: the last view's death unmaps.
        self._lingering = weakref.ref(mm)
        try:
            self.buf.release()
            mm.close()
        except BufferError:
            return
        self._lingering = None

    def _forget_after_fork(self) -> None:
        """In a forked child: unmap this process's copy now, or as soon as the views of
        it this child holds are gone (the handle's descriptor is left as it is: a child
        may pass it on, e.g. Popen's pass_fds)."""
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.size} bytes"
        return f"<Segment {self.name} {state}{' owner' if self.owner else ''}>"


#: The /proc links (``pipe:[inode]``) of the pipes ``make_pipe`` made in this process (or
#: in the one it was forked from) that may still be open: what ``drop_inherited`` closes
#: besides the pipes a spec names. Pruned of pipes no longer open here when it grows.
_made_pipes: set[str] = set()
_made_pipes_lock = threading.Lock()
_PRUNE_AT = 4096


def _new_lock_after_fork() -> None:
    global _made_pipes_lock
    _made_pipes_lock = threading.Lock()  # (another thread may have held it at the fork)


os.register_at_fork(after_in_child=_new_lock_after_fork)


def make_pipe() -> tuple[int, int, str]:
    """A non-blocking pipe and the handle of its write end (``pipe:<pid>:<fd>:<inode>``),
    which a peer opens with ``open_handle(h, os.O_WRONLY | os.O_NONBLOCK)``."""
    r = w = -1
    try:  # (a signal handler's exception once the numbers are kept closes it: see open_handle)
        r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        ino = os.fstat(w).st_ino
        with _made_pipes_lock:
            if len(_made_pipes) >= _PRUNE_AT:
                _made_pipes.intersection_update(_fd_links().values())
            _made_pipes.add(f"pipe:[{ino}]")
        return r, w, f"pipe:{os.getpid()}:{w}:{ino}"
    except BaseException:
        for end in (r, w):
            if end >= 0:
                os.close(end)
        raise


def fd_ready(fd: int, timeout_s: float = 0.0) -> bool:
    """Whether ``fd`` is readable, hung up or not open (POLLIN, POLLHUP, POLLERR,
    POLLNVAL: a pidfd whose process exited, a pipe with data or no writer left), waiting
    up to ``timeout_s`` seconds. poll(2), so any descriptor number: ``select.select``
    raises ValueError for one above 1023, which a process with many files open (an
    engine with its GPU libraries, channels and sockets) reaches."""
    p = select.poll()
    p.register(fd, select.POLLIN)
    return bool(p.poll(math.ceil(max(timeout_s, 0.0) * 1000)))


#: Numbers that make each segment's memfd name its own (``Segment.create``).
_labels = itertools.count(1)


def _close_stray_memfd(label: str) -> None:
    """Close this process's descriptor of the memfd named ``label``, if there is one:
    it was created, but an exception came before its number was kept."""
    target = f"/memfd:{label} (deleted)"
    try:
        entries = os.listdir("/proc/self/fd")
    except OSError:
        return
    for entry in entries:
        try:
            if os.readlink(f"/proc/self/fd/{entry}") == target:
                os.close(int(entry))
        except (OSError, ValueError):
            pass
