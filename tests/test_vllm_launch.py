"""The ``vllm serve`` parent's channels for several API servers (no vLLM needed): each
engine and each API server finds its own, both sides of every channel attach, and the
launcher releases every handle once all have attached."""

from __future__ import annotations

import json
import os

import pytest

from shmclient.channel import ShmChannel
from shmclient.shm import parse_handle
from shmclient.vllm import wire
from shmclient.vllm.launch import _coordinator_entry, _Rings
from shmclient.vllm.link import notify_attached

from .forked import in_child


@pytest.fixture
def rings(monkeypatch):
    monkeypatch.setenv("SHMCLIENT_VLLM_RING_BYTES", str(1 << 16))
    made = _Rings(api_servers=2, engines=[0, 1])
    yield made
    made.release()


def test_every_engine_gets_one_channel_per_api_server_and_every_api_server_one_per_engine(rings):
    with rings.in_environment():
        engines = {e: wire.decode_specs(os.environ[wire.ENV_SPEC], e) for e in (0, 1)}
        servers = {c: wire.decode_frontend_specs(os.environ[wire.ENV_FRONTEND_SPEC], c) for c in (0, 1)}
    assert wire.ENV_SPEC not in os.environ and wire.ENV_FRONTEND_SPEC not in os.environ
    for e, specs in engines.items():
        assert [(s.engine_index, s.client_index) for s in specs] == [(e, 0), (e, 1)]
        assert all(s.launcher_pid == os.getpid() and s.frontend_pid == 0 for s in specs)
    for c, specs in servers.items():
        assert [(s.engine_index, s.client_index) for s in specs] == [(0, c), (1, c)]
        for s in specs:  # the same channel as the engine's, from the other side
            mine = engines[s.engine_index][c].channel
            assert (s.channel.rx, s.channel.tx) == (mine.tx, mine.rx)
    pairs = {(s.engine_index, s.client_index) for specs in engines.values() for s in specs}
    assert len(pairs) == 4 and len({s.channel.rx.segment for specs in engines.values() for s in specs}) == 4


def test_the_handles_are_released_once_both_sides_of_every_channel_attached(rings):
    engine_specs, frontend_specs = rings.engine_specs, rings.frontend_specs
    thread = rings.release_when_attached()
    attached = []
    try:
        for spec in engine_specs + frontend_specs[:-1]:
            attached.append(ShmChannel.attach(spec.channel))
            notify_attached(spec.attached_pipe)
        thread.join(0.3)
        assert thread.is_alive()  # one side of one channel has not attached yet
        last = frontend_specs[-1]
        attached.append(ShmChannel.attach(last.channel))
        notify_attached(last.attached_pipe)
        thread.join(30)
        assert not thread.is_alive()
        with pytest.raises(FileNotFoundError):
            ShmChannel.attach(engine_specs[0].channel)
        # The channels live on between the sides that attached.
        from shmclient.channel import REQ_ABORT

        frontend, engine = attached[len(engine_specs)], attached[0]
        assert frontend_specs[0].engine_index == engine_specs[0].engine_index == 0
        assert frontend_specs[0].client_index == engine_specs[0].client_index == 0
        frontend.send_nowait(REQ_ABORT, frontend.encode(["r1"]))
        assert engine.recv_nowait() == [(REQ_ABORT, ["r1"])]
    finally:
        for channel in attached:
            channel.close()


def test_release_stops_the_waiting_thread_and_is_idempotent(rings):
    thread = rings.release_when_attached()
    rings.release()
    rings.release()
    thread.join(5)
    assert not thread.is_alive()
    with pytest.raises(FileNotFoundError):
        ShmChannel.attach(rings.engine_specs[0].channel)


def test_notify_attached_writes_one_byte_and_never_raises_for_a_launcher_that_is_gone():
    r, w = os.pipe()
    handle = f"pipe:{os.getpid()}:{w}:{os.fstat(w).st_ino}"
    try:
        notify_attached(handle)
        assert os.read(r, 16) == b"\x01"
    finally:
        os.close(r)
        os.close(w)
    notify_attached(handle)  # gone: nothing to tell
    notify_attached("")


def _still_open(handles: "list[str]") -> "list[str]":
    """The handles whose fd (the number they name) is open here on the file they name."""
    out = []
    for handle in handles:
        _, _, fd, ino = parse_handle(handle)
        try:
            if os.fstat(fd).st_ino == ino:
                out.append(handle)
        except OSError:
            pass
    return out


def test_a_coordinator_forked_during_the_launch_drops_the_channels_it_inherited(rings):
    """vLLM's DP coordinator is forked inside the launch and never attaches: its entry
    closes the inherited fds of every channel, arena and parked page the specs name (and
    nothing else), then runs vLLM's entry with its arguments."""
    env = rings.environment
    handles = wire.inherited_handles(env[wire.ENV_SPEC], env[wire.ENV_FRONTEND_SPEC])
    # 2 API servers x 2 engines: two rings and two tensor arenas a channel (parked pages too
    # by default)
    assert sum(h.startswith("memfd:") for h in handles) >= 4 * 4
    own_r, own_w = os.pipe()  # the launcher's own fd: the coordinator keeps it

    def stock(*args, **kwargs):
        return json.dumps({"args": args, "kwargs": kwargs, "open": _still_open(handles),
                           "env": [v for v in (wire.ENV_SPEC, wire.ENV_FRONTEND_SPEC) if v in os.environ],
                           "own": _still_open([f"pipe:0:{own_w}:{os.fstat(own_w).st_ino}"]) != []})

    entry = _coordinator_entry(stock)
    assert _coordinator_entry(entry) is entry and entry.__qualname__ == stock.__qualname__
    try:
        with rings.in_environment():
            inherited = json.loads(in_child(lambda: json.dumps(_still_open(handles))))
            report = json.loads(in_child(lambda: entry(2, "addr", zmq_addr_pipe=None)))
    finally:
        os.close(own_r)
        os.close(own_w)
    assert sorted(inherited) == sorted(handles)  # what a plain fork holds
    assert report == {"args": [2, "addr"], "kwargs": {"zmq_addr_pipe": None}, "open": [], "env": [], "own": True}


def test_inherited_handles_names_none_for_no_or_foreign_values():
    assert wire.inherited_handles(None, "") == []
    assert wire.inherited_handles("not hex", "00") == []
