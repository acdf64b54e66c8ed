"""What a receive handler (``recv_into``) may do: it must not use its own ring, and a
wait on it is refused too (RuntimeError), as every other call is.
"""

from __future__ import annotations

import threading

import pytest

from shmclient.ring_consumer import RingConsumer
from shmclient.ring_producer import RingProducer


@pytest.fixture
def pair():
    c = RingConsumer.create(4096)
    p = RingProducer.attach(c.spec)
    c.unlink()
    try:
        yield p, c
    finally:
        p.close()
        c.close()


def test_a_handler_may_not_wait_on_its_own_ring(pair):
    p, c = pair
    p.send_nowait(1, b"x")
    refused = []
    done = threading.Event()

    def handler(t, v):
        try:
            c.wait_readable(1.0)
        except RuntimeError as e:
            refused.append(str(e))
        done.set()

    # the producer's wake-up would end the wait early: nothing is sent while it waits, so
    # a wait that is not refused takes its whole timeout (the test's failure, not a hang)
    assert c.recv_into(handler) == 1
    assert done.is_set()
    assert len(refused) == 1 and "re-entrant" in refused[0]
    # outside the handler the wait is allowed again
    p.send_nowait(2, b"y")
    assert c.wait_readable(5.0) is True
    assert c.try_recv() == [(2, b"y")]
