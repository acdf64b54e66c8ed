"""What a receive handler (``recv_into``) may keep and do.

The view a handler gets is valid during its call, and an export of it made then (a
memoryview slice, ``numpy.frombuffer``) pins its record while it lives. The view's
exporter (``view.obj``, a ``RecordBytes``) is not such an export: once the call is over
and no export lives, or once the end is closed, a new export of it raises ValueError,
rather than reading the producer's newer bytes in the reused space. And a handler must
not use its own ring: a wait on it is refused too (RuntimeError), as every other call is.
"""

from __future__ import annotations

import threading

import pytest

from shmclient.errors import ClientClosedError
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


def test_a_kept_exporter_is_released_after_the_call(pair):
    p, c = pair
    p.send_nowait(1, b"A" * 1000)
    kept, during = [], []

    def handler(t, v):
        kept.append(v.obj)
        during.append(bytes(memoryview(v.obj)[:4]))  # valid during the call

    assert c.recv_into(handler) == 1
    assert during == [b"AAAA"]
    assert c.pinned == 0
    with pytest.raises(ValueError, match="record released"):
        memoryview(kept[0])
    for i in range(8):  # the space it read is reused meanwhile
        p.send_nowait(2, bytes([66 + i]) * 1000)
        assert c.try_recv() == [(2, bytes([66 + i]) * 1000)]
    with pytest.raises(ValueError, match="record released"):
        memoryview(kept[0])


def test_a_kept_export_pins_until_dropped_then_the_exporter_is_released(pair):
    p, c = pair
    p.send_nowait(1, b"A" * 1000)
    kept = []
    c.recv_into(lambda t, v: kept.append((v.obj, v[:8])))
    obj, export = kept[0]
    assert c.pinned == 1
    assert bytes(memoryview(obj)[:4]) == b"AAAA"  # an export lives: still its bytes
    assert bytes(export) == b"A" * 8
    export.release()
    del kept, export
    with pytest.raises(ValueError, match="record released"):
        memoryview(obj)
    p.send_nowait(2, b"B" * 1000)
    assert c.try_recv() == [(2, b"B" * 1000)]
    assert c.pinned == 0


def test_a_pinned_exporter_is_released_when_the_end_closes(pair):
    p, c = pair
    p.send_nowait(1, b"A" * 100)
    kept = []
    c.recv_into(lambda t, v: kept.append((v.obj, v[:8])))
    obj, export = kept[0]
    assert c.pinned == 1
    c.close()
    assert bytes(export) == b"A" * 8  # the live export still reads its record
    with pytest.raises(ValueError, match="record released"):
        memoryview(obj)
    export.release()


def test_a_handler_that_closes_its_end_releases_its_record(pair):
    p, c = pair
    p.send_nowait(1, b"A" * 100)
    kept = []

    def handler(t, v):
        kept.append((v.obj, v[:8]))
        c.close()

    with pytest.raises(ClientClosedError):  # the handler closed this end
        c.recv_into(handler)
    obj, export = kept[0]
    assert bytes(export) == b"A" * 8
    with pytest.raises(ValueError, match="record released"):
        memoryview(obj)
    export.release()


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
