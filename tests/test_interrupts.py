"""A KeyboardInterrupt (Ctrl-C) that lands as a lock's non-blocking acquire returns must not
leave the lock held: the read lead of the sync and async readers, and the channel's send
lock in ``flush_releases``.

CPython runs a Python signal handler at the eval-breaker check right after a call
returns, so with ``if lock.acquire(False): try: ... finally: lock.release()`` the
exception can come after acquire() took the lock and before the try. These tests land it
deterministically at the first moment the lock is held: a profile hook raises
KeyboardInterrupt at the first call or return event (C ones included) of the function
under test, or of what it calls, at which the lock is held. With the gap that is the
return of ``acquire`` itself; without it, an event inside the block that releases.
"""

from __future__ import annotations

import threading

import pytest

from shmclient._ring import try_hold


def test_try_hold_releases_only_what_it_took():
    lock = threading.Lock()
    with try_hold(lock) as held:
        assert held is True and lock.locked()
        with try_hold(lock, 0.01) as again:
            assert again is False
        assert lock.locked()  # the inner guard took nothing, so it released nothing
    assert not lock.locked()
    with pytest.raises(ValueError), try_hold(lock) as held:
        assert held
        raise ValueError("the body's exception goes through, the lock is released")
    assert not lock.locked()
    with pytest.raises(TypeError, match="timeout must be a number"):
        try_hold(lock, "1")
