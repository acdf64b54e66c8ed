"""An exception from a signal handler (Ctrl-C's KeyboardInterrupt) while a ring's pipes or
segment are being made or opened leaves no descriptor behind.

``shm.make_pipe``, ``shm.open_handle`` and ``shm._map`` each hold a new descriptor for a
few calls before they hand it over; an exception raised in that window (here: by the
next call, made to raise KeyboardInterrupt) must close it, not leave it open for the
process's life (or for as long as the traceback is kept).
"""

from __future__ import annotations

import mmap
import os

import pytest

from shmclient import shm


def _fds() -> set[int]:
    out = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            os.fstat(int(name))
        except OSError:  # the listing's own descriptor (closed by now)
            continue
        out.add(int(name))
    return out


def _left_open(before: set[int]) -> list[str]:
    return [f"{fd} -> {os.readlink(f'/proc/self/fd/{fd}')}" for fd in sorted(_fds() - before)]


class _Os:
    """``os`` for the module under test, with ``name`` raising KeyboardInterrupt when
    ``when(*args)`` says so."""

    def __init__(self, name: str, when=lambda *a: True) -> None:
        self._name, self._when = name, when
        self.raised = 0

    def __getattr__(self, name):
        real = getattr(os, name)
        if name != self._name:
            return real

        def interrupted(*args, **kw):
            if self._when(*args):
                self.raised += 1
                raise KeyboardInterrupt
            return real(*args, **kw)

        return interrupted


def test_make_pipe_closes_the_pipe_when_interrupted_after_creating_it(monkeypatch):
    fake = _Os("fstat")
    monkeypatch.setattr(shm, "os", fake)
    before = _fds()
    with pytest.raises(KeyboardInterrupt):
        shm.make_pipe()
    assert fake.raised == 1
    assert _left_open(before) == []


def test_make_pipe_closes_the_pipe_when_interrupted_while_pruning(monkeypatch):
    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(shm, "_PRUNE_AT", 0)
    monkeypatch.setattr(shm, "_fd_links", interrupted)
    before = _fds()
    with pytest.raises(KeyboardInterrupt):
        shm.make_pipe()
    assert _left_open(before) == []
    assert not shm._made_pipes_lock.locked()


def test_open_handle_closes_the_new_fd_when_interrupted_before_returning(monkeypatch):
    r, w, handle = shm.make_pipe()
    try:
        fake = _Os("fstat", lambda fd: fd not in (r, w))  # the check of the new fd
        monkeypatch.setattr(shm, "os", fake)
        before = _fds()
        with pytest.raises(KeyboardInterrupt):
            shm.open_handle(handle, os.O_WRONLY | os.O_NONBLOCK)
        assert fake.raised == 1
        assert _left_open(before) == []
        monkeypatch.setattr(shm, "os", os)
        fd = shm.open_handle(handle, os.O_WRONLY | os.O_NONBLOCK)  # and it still opens
        os.close(fd)
    finally:
        os.close(r)
        os.close(w)


def test_map_closes_the_mapping_when_interrupted_after_making_it(monkeypatch):
    fd = os.memfd_create("shmc-test-map", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, mmap.PAGESIZE)
        real = shm._same_file
        calls = []

        def interrupted_second_time(f):
            calls.append(f)
            if len(calls) == 2:  # the listing after the mapping was made
                raise KeyboardInterrupt
            return real(f)

        monkeypatch.setattr(shm, "_same_file", interrupted_second_time)
        try:
            mmap.mmap(fd, mmap.PAGESIZE, trackfd=False)  # type: ignore[call-arg]
            pytest.skip("this Python's mmap keeps no descriptor: _map has no window")
        except TypeError:
            pass
        before = _fds()
        # the traceback (kept here, as a handler or a log may keep it) holds _map's frame
        with pytest.raises(KeyboardInterrupt) as info:
            shm._map(fd, mmap.PAGESIZE, mmap.MAP_SHARED)
        assert len(calls) == 2
        assert _left_open(before) == [], "the mapping's descriptor stayed open with the traceback"
        del info
    finally:
        os.close(fd)
