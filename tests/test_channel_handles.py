"""A channel made by a third process (a launcher) for a frontend and an engine it starts:
both attach through the launcher's handles, talk both ways, and after ``release`` nothing
can attach any more."""

from __future__ import annotations

import multiprocessing as mp
import os

import msgspec
import pytest

from shmclient import waiting
from shmclient.channel import REQ_ABORT, ShmChannel, ShmChannelSpec
from shmclient.channel_handles import ChannelHandles
from shmclient.messages import EngineCoreOutputs

from .test_tensors import _resource_tracker  # noqa: F401 - spawning starts it: before the test

CTX = mp.get_context("spawn")


def _engine(spec: bytes, done) -> None:
    """Echo: one ABORT request in, one output batch naming its ids out."""
    channel = ShmChannel.attach(msgspec.msgpack.decode(spec, type=ShmChannelSpec))
    try:
        [(rtype, ids)] = waiting.recv(channel, timeout=30)
        assert rtype == REQ_ABORT
        channel.send_nowait(*_outputs(channel, ids))
        done.wait(30)
    finally:
        channel.close()


def _outputs(channel: ShmChannel, ids: list[str]):
    from shmclient.channel import REC_OUTPUTS

    return REC_OUTPUTS, channel.encode(EngineCoreOutputs(finished_requests=set(ids)))


def _frontend(spec: bytes, result) -> None:
    channel = ShmChannel.attach(msgspec.msgpack.decode(spec, type=ShmChannelSpec))
    try:
        channel.send_nowait(REQ_ABORT, channel.encode(["a", "b"]))
        [(_, outputs)] = waiting.recv(channel, timeout=30)
        result.put(sorted(outputs.finished_requests))
    finally:
        channel.close()


def test_two_children_talk_over_a_channel_the_launcher_made(_resource_tracker):
    handles = ChannelHandles(ring_capacity=1 << 16, arena_bytes=1 << 16, spin_us=0.0)
    result, done = CTX.Queue(), CTX.Event()
    procs = [CTX.Process(target=_engine, args=(msgspec.msgpack.encode(handles.engine_spec), done)),
             CTX.Process(target=_frontend, args=(msgspec.msgpack.encode(handles.frontend_spec), result))]
    try:
        for p in procs:
            p.start()
        assert result.get(timeout=60) == ["a", "b"]
        done.set()
        for p in procs:
            p.join(30)
        assert [p.exitcode for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
        handles.release()
        result.close()
        result.join_thread()


def test_after_release_nothing_attaches_and_no_fd_is_left():
    before = set(os.listdir("/proc/self/fd"))
    handles = ChannelHandles(ring_capacity=1 << 12, arena_bytes=0, spin_us=0.0)
    fds = handles.handle_fds()
    assert len(fds) == 2 + 2 + 2  # two rings (segment and pipe each), two arenas
    handles.release()
    handles.release()  # idempotent
    assert handles.handle_fds() == []
    assert set(os.listdir("/proc/self/fd")) <= before
    # Every handle named a file of this process that is closed now: nothing opens it.
    for spec in (handles.engine_spec, handles.frontend_spec):
        with pytest.raises(FileNotFoundError):
            ShmChannel.attach(spec)


def test_the_two_specs_are_one_channel_seen_from_each_side():
    handles = ChannelHandles(ring_capacity=1 << 12, arena_bytes=1 << 12, spin_us=0.0)
    try:
        e, f = handles.engine_spec, handles.frontend_spec
        assert (e.rx, e.tx, e.tensor_rx, e.tensor_tx) == (f.tx, f.rx, f.tensor_tx, f.tensor_rx)
        assert e.rx.space_pipe and not e.rx.wake_pipe  # requests: the frontend waits for room
        assert e.tx.wake_pipe and not e.tx.space_pipe  # outputs: the frontend waits for data
    finally:
        handles.release()
