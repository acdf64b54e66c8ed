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


def _attach_where_the_new_fd_gets_the_launchers_number(spec: bytes, result) -> None:
    """Attach (as an API server does) in a process that inherited nothing, with every fd
    number below the launcher's number of the output ring's wake pipe taken: the read end
    this attach opens gets that very number. Reports whether it is still open afterwards."""
    from shmclient.shm import parse_handle

    frontend = msgspec.msgpack.decode(spec, type=ShmChannelSpec)
    _, _, number, ino = parse_handle(frontend.rx.wake_pipe)
    try:
        os.fstat(number)
        result.put("taken")  # the number is in use here: the case cannot be made
        return
    except OSError:
        pass
    fillers = []
    null = os.open(os.devnull, os.O_RDONLY)
    for n in range(3, number):
        try:
            os.fstat(n)
        except OSError:
            fillers.append(os.dup2(null, n))
    channel = ShmChannel.attach(frontend)
    try:
        try:
            result.put(os.fstat(number).st_ino == ino)
        except OSError:
            result.put(False)  # closed as if it had been inherited
    finally:
        channel.close()
        for fd in (null, *fillers):
            os.close(fd)


def test_an_attach_keeps_the_fd_it_opened_under_the_launchers_own_number(_resource_tracker):
    """A process spawned by the launcher inherits no handle, so the fd its attach opens for
    a pipe may carry the number the launcher's handle names. That fd is the live end of
    the channel, not an inherited copy: it must stay open (closing it lost the output
    ring's wake-ups: one API server of two never got its first reply)."""
    padding = [os.open(os.devnull, os.O_RDONLY) for _ in range(8)]  # launcher numbers above the child's
    try:
        handles = ChannelHandles(ring_capacity=1 << 12, arena_bytes=0, spin_us=0.0)
    finally:
        for fd in padding:
            os.close(fd)
    result = CTX.Queue()
    proc = CTX.Process(target=_attach_where_the_new_fd_gets_the_launchers_number,
                       args=(msgspec.msgpack.encode(handles.frontend_spec), result))
    try:
        proc.start()
        assert result.get(timeout=60) is True
        proc.join(30)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)
        handles.release()
        result.close()
        result.join_thread()
