"""A close from another thread against the calls that use a ring's pipe descriptors.

``Ring.close()`` closes the pipes under the ring's lock, after which their numbers may
be another file's (a socket, a log). ``drain_wake_fd`` and ``poke`` use a pipe's number,
so they must hold that lock from their closed check to their I/O: a close that comes in
between then waits for them, rather than closing the pipe under them. Each test forces
the close into that window (a thread that calls ``close()`` is started from inside the
I/O call) and checks that the close had to wait and that the descriptor used was still
the ring's pipe.
"""

from __future__ import annotations

import os
import threading

import pytest

import shmclient.ring_consumer as ring_consumer
import shmclient.ring_producer as ring_producer
from shmclient.errors import ClientClosedError
from shmclient.ring_consumer import RingConsumer
from shmclient.ring_producer import RingProducer

TIMEOUT = 10.0


class _WatchedLock:
    """The ring's lock, telling whether ``closer``'s acquire had to wait for it."""

    def __init__(self, lock) -> None:
        self._lock = lock
        self.closer: threading.Thread | None = None
        self.tried = threading.Event()
        self.waited = False

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if threading.current_thread() is self.closer and not self.tried.is_set():
            got = self._lock.acquire(False)
            self.waited = not got
            self.tried.set()
            if got:
                return True
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _close_meanwhile(ring, watched: _WatchedLock) -> None:
    """Start a thread that closes ``ring`` and return once its close asked for the lock;
    when the lock was free, once the close is complete (the pipes are closed)."""
    closer = threading.Thread(target=ring.close, name="closer")
    watched.closer = closer
    closer.start()
    assert watched.tried.wait(TIMEOUT), "the close never asked for the ring's lock"
    if not watched.waited:
        closer.join(TIMEOUT)


def _pipe_ino(fd: int) -> int:
    return os.fstat(fd).st_ino


def test_drain_wake_fd_holds_the_lock_against_a_close(monkeypatch):
    c = RingConsumer.create(4096, consumer_wake_fd=True)
    p = RingProducer.attach(c.spec)
    c.unlink()
    try:
        ino = _pipe_ino(c.fileno())
        watched = c._lock = _WatchedLock(c._lock)
        seen = []
        real_drain = ring_consumer.drain_pipe

        def drain_with_a_close_meanwhile(fd: int) -> None:
            _close_meanwhile(c, watched)
            try:
                seen.append(_pipe_ino(fd))
            except OSError as e:
                seen.append(e)
            real_drain(fd)

        monkeypatch.setattr(ring_consumer, "drain_pipe", drain_with_a_close_meanwhile)
        with pytest.raises(ClientClosedError):  # (the close came during the call)
            c.drain_wake_fd()
        watched.closer.join(TIMEOUT)
        assert not watched.closer.is_alive()
        assert watched.waited, "close() closed the wake pipe while drain_wake_fd was using it"
        assert seen == [ino]
        assert c.closed
        with pytest.raises(ClientClosedError):
            c.drain_wake_fd()
    finally:
        p.close()
        c.close()


def test_poke_holds_the_lock_against_a_close(monkeypatch):
    c = RingConsumer.create(4096, consumer_wake_fd=True)
    p = RingProducer.attach(c.spec)
    c.unlink()
    try:
        ino = _pipe_ino(c.fileno())
        watched = p._lock = _WatchedLock(p._lock)
        seen = []

        class _Os:
            def __getattr__(self, name):
                return getattr(os, name)

            def write(self, fd: int, data: bytes) -> int:
                _close_meanwhile(p, watched)
                try:
                    seen.append(_pipe_ino(fd))
                except OSError as e:
                    seen.append(e)
                return os.write(fd, data)

        monkeypatch.setattr(ring_producer, "os", _Os())
        p.poke()
        watched.closer.join(TIMEOUT)
        assert not watched.closer.is_alive()
        assert watched.waited, "close() closed the wake pipe while poke was writing to it"
        assert seen == [ino]
        assert p.closed
        p.poke()  # closed: a no-op
        assert seen == [ino]
        assert c.has_data() is False  # the consumer end is still open and sound
    finally:
        p.close()
        c.close()
