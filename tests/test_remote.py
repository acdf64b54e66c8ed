"""Remote engines over tcp, on loopback: an engine started apart (``python -m
shmclient_engine --connect tcp://127.0.0.1:PORT``) serves a plain client, or one rank of
a data-parallel group whose other rank runs here over the shared-memory rings.

Each test starts the remote engine itself, as a child process, before building the client
(the engine retries until the frontend listens), so no thread is needed; the autouse
``no_leaks`` fixture checks that no process, thread, /dev/shm or /tmp entry survives.
Liveness across hosts is by heartbeats (0.2 s x 5 by default): the deaths below are
noticed from the silence alone.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import select
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import zmq

from shmclient import (
    AsyncMPClient,
    ConfigError,
    DPLBAsyncMPClient,
    EngineCoreRequest,
    EngineDeadError,
    PeerNotProducingError,
    SamplingParams,
    SyncMPClient,
    make_client,
)
from shmclient.channel import ShmChannel
from shmclient.channel_zmq import ZmqChannel
from shmclient.config import EngineConfig

from .conftest import sigstop
from .fault_engine import FAULT_ENV, MODULE as FAULT_MODULE

ROOT = __file__.rsplit("/tests/", 1)[0]
HOST = "127.0.0.1"


@pytest.fixture(scope="module", autouse=True)
def zmq_gc_thread():
    """A frame of 64 KiB or more (the embeds here) makes pyzmq start its process-wide
    garbage-collector thread (zero-copy sends), which lives until exit: start it here,
    before the per-test thread check, not inside a test."""
    from zmq.utils.garbage import gc

    gc.start()
    yield


@pytest.fixture(autouse=True)
def shared_secret(monkeypatch):
    """Remote start-ups are authenticated (shmclient.auth): the frontend here and every
    engine started by ``start_remote`` (which copies the environment) share a secret."""
    monkeypatch.setenv("SHMCLIENT_SECRET", "test-remote-secret")


def free_port() -> int:
    """A tcp port free on loopback now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def start_remote(address: str, wait_s: float = 60.0, module: str = "shmclient_engine",
                 fault: str | None = None) -> subprocess.Popen:
    """A remote engine, started apart from any client, connecting to ``address``
    (``fault``: a directive of the test engine ``tests.fault_engine``)."""
    env = dict(os.environ)
    if fault is not None:
        env[FAULT_ENV] = fault
    return subprocess.Popen(
        [sys.executable, "-m", module, "--connect", address,
         "--ready-timeout", str(wait_s)], cwd=ROOT, stdin=subprocess.DEVNULL, env=env)


def reap(proc: subprocess.Popen, timeout: float = 10.0) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
        raise


def sync_client_of(engine: subprocess.Popen, port: int) -> SyncMPClient:
    """A plain client of ``engine`` (from ``start_remote``), which is killed if the
    client cannot start."""
    try:
        return SyncMPClient(remote_cfg(port))
    except BaseException:
        engine.kill()
        reap(engine)
        raise


def remote_cfg(port: int, **kw) -> EngineConfig:
    """One remote engine behind a plain client."""
    return EngineConfig(model="mock", max_model_len=512, transport="zmq",
                        data_parallel_size_local=0, data_parallel_address=HOST,
                        data_parallel_rpc_port=port, engine_ready_timeout_s=60.0, **kw)


def group_cfg(port: int, **kw) -> EngineConfig:
    """Rank 0 here over shm, rank 1 remote over tcp."""
    return EngineConfig(model="mock", max_model_len=512, data_parallel_size=2,
                        data_parallel_size_local=1, data_parallel_address=HOST,
                        data_parallel_rpc_port=port, engine_ready_timeout_s=60.0, **kw)


def req(rid: str, max_tokens: int = 4, prompt=(1, 2, 3), rank: int | None = None,
        embeds=None) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=rid, prompt_token_ids=None if embeds is not None else list(prompt),
        prompt_embeds=embeds, data_parallel_rank=rank,
        sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0))


def requests() -> list[EngineCoreRequest]:
    """Eight token prompts and one 64 KiB prompt_embeds tensor pinned to rank 1 (the
    remote one: it travels inline, as a zmq frame)."""
    emb = torch.Generator().manual_seed(7)
    out = [req(f"r{i}", max_tokens=2 + i, prompt=range(i + 1, i + 6)) for i in range(8)]
    out.append(req("emb", max_tokens=3, rank=1,
                   embeds=torch.randn(256, 64, generator=emb, dtype=torch.float32)))
    return out


def single_request_view(r: EngineCoreRequest) -> EngineCoreRequest:
    """The same request for a one-engine client (no rank)."""
    return EngineCoreRequest(request_id=r.request_id, prompt_token_ids=r.prompt_token_ids,
                             prompt_embeds=r.prompt_embeds, sampling_params=r.sampling_params)


async def collect(client, ids, timeout: float = 30.0) -> dict[str, tuple[list[int], int]]:
    """Run until every id finished: id -> (tokens, engine_index)."""
    want, got, tokens = set(ids), {}, {}
    deadline = time.monotonic() + timeout
    while want - got.keys():
        outs = await asyncio.wait_for(client.get_output_async(), deadline - time.monotonic())
        for o in outs.outputs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                got[o.request_id] = (tokens[o.request_id], outs.engine_index)
    return got


def sync_collect(client, ids, timeout: float = 30.0) -> dict[str, list[int]]:
    want, got, tokens = set(ids), {}, {}
    deadline = time.monotonic() + timeout
    while want - got.keys():
        outs = client.get_output(timeout=deadline - time.monotonic())
        for o in outs.outputs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                got[o.request_id] = tokens[o.request_id]
    return got


async def one_engine_tokens(reqs) -> dict[str, list[int]]:
    single = AsyncMPClient(EngineConfig(model="mock", max_model_len=512))
    try:
        for r in reqs:
            await single.add_request_async(single_request_view(r))
        got = await collect(single, [r.request_id for r in reqs])
    finally:
        single.shutdown()
    return {k: v[0] for k, v in got.items()}


# -- settings ----------------------------------------------------------------------------


def test_remote_settings_are_validated():
    with pytest.raises(ConfigError, match="data_parallel_size_local=1 .*give data_parallel_address"):
        EngineConfig(data_parallel_size=2, data_parallel_size_local=1)
    with pytest.raises(ConfigError, match="data_parallel_size_local=3 .*<= 2"):
        EngineConfig(data_parallel_size=2, data_parallel_size_local=3, data_parallel_address=HOST)
    with pytest.raises(ConfigError, match="transport='shm' .*only 'zmq' reaches another host"):
        EngineConfig(data_parallel_size_local=0, data_parallel_address=HOST)
    with pytest.raises(ConfigError, match="data_parallel_address='tcp://x:1' .*no scheme"):
        EngineConfig(data_parallel_address="tcp://x:1")
    with pytest.raises(ConfigError, match="data_parallel_rpc_port=70000 .*<= 65535"):
        EngineConfig(data_parallel_rpc_port=70000)
    with pytest.raises(ConfigError, match="heartbeat_interval_s=0 .*> 0"):
        EngineConfig(heartbeat_interval_s=0)
    with pytest.raises(ConfigError, match="heartbeat_misses=0"):
        EngineConfig(heartbeat_misses=0)
    c = EngineConfig(data_parallel_size=3, data_parallel_size_local=1, data_parallel_address=HOST)
    assert not c.is_remote  # the group: rank 0 is here
    assert c.replace(data_parallel_rank=2, transport="zmq").is_remote
    assert EngineConfig().heartbeat_timeout_s == pytest.approx(1.0)
    from shmclient.client_dp import engine_config
    from shmclient.launcher import remote_control_port

    assert engine_config(c.replace(device="cuda"), 0).device == "cuda:0"
    r2 = engine_config(c.replace(device="cuda", data_parallel_rpc_port=5000), 2)
    assert (r2.transport, r2.device, remote_control_port(r2)) == ("zmq", "cuda", 5001)


def test_no_engine_connecting_times_out_naming_the_address_and_the_command():
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(PeerNotProducingError) as ei:
        SyncMPClient(remote_cfg(port).replace(engine_ready_timeout_s=0.5))
    assert time.monotonic() - t0 < 5
    text = str(ei.value)
    assert f"tcp://{HOST}:{port}" in text and "--connect" in text


@pytest.mark.parametrize("host", ["0.0.0.0", "*"])
def test_the_command_for_a_wildcard_bind_address_names_this_host(host, caplog):
    """``data_parallel_address`` "0.0.0.0" or "*" (every interface) cannot be connected to
    from another host: the logged command and the timeout's name this host instead."""
    want = f"--connect tcp://{socket.gethostname()}:"
    with caplog.at_level(logging.WARNING, logger="shmclient"), pytest.raises(PeerNotProducingError) as ei:
        SyncMPClient(remote_cfg(0).replace(data_parallel_address=host, engine_ready_timeout_s=0.5))
    logged = [r for r in caplog.records if hasattr(r, "shmclient_control_address")]
    assert len(logged) == 1
    for text in (str(ei.value), logged[0].getMessage()):
        assert want in text and "--connect tcp://0.0.0.0" not in text and "every interface" in text
    assert logged[0].shmclient_control_address.startswith(f"tcp://{socket.gethostname()}:")
    from shmclient.handshake import connect_address

    assert connect_address("tcp://[::]:5") == f"tcp://{socket.gethostname()}:5"
    assert connect_address(f"tcp://{HOST}:5") == f"tcp://{HOST}:5"


def test_a_remote_engine_without_a_frontend_gives_up_after_its_ready_timeout():
    proc = start_remote(f"tcp://{HOST}:{free_port()}", wait_s=0.5)
    assert reap(proc, 20) == 1


def test_ctrl_c_stops_a_remote_engine_waiting_for_its_frontend():
    """A remote engine is started by hand, in a terminal with no frontend in its process
    group: Ctrl-C (SIGINT) stops it as SIGTERM does, with status 130, not after its
    ready timeout (60 s here). A local engine ignores it: its frontend decides."""
    from shmclient import control

    port = free_port()
    ctx = zmq.Context()
    front = ctx.socket(zmq.PAIR)
    front.bind(f"tcp://{HOST}:{port}")
    engine = start_remote(f"tcp://{HOST}:{port}")
    try:
        # its Hello: its signal handlers are in place, it waits for Start
        assert isinstance(control.recv(front, 60), control.Hello)
        engine.send_signal(signal.SIGINT)
        assert reap(engine, 10) == 130
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait(5)
        front.close(linger=0)
        ctx.term()


def test_wildcard_data_addresses_are_reached_at_the_host_of_connect():
    from shmclient.control_sockets import reachable

    via = "tcp://10.1.2.3:5000"
    assert reachable("tcp://0.0.0.0:41000", via) == "tcp://10.1.2.3:41000"
    assert reachable("tcp://*:41000", via) == "tcp://10.1.2.3:41000"
    assert reachable("tcp://192.168.0.9:41000", via) == "tcp://192.168.0.9:41000"
    assert reachable("ipc://@x-in", via) == "ipc://@x-in"
    # a local engine: its control socket is ipc, the data is reached on loopback
    assert reachable("tcp://0.0.0.0:41000", "ipc:///tmp/d/ctl") == "tcp://127.0.0.1:41000"
    assert reachable("tcp://[::]:41000", "ipc:///tmp/d/ctl") == "tcp://[::1]:41000"


def test_a_remote_engine_dying_while_it_starts_fails_the_client_at_once():
    """No pid to watch: the missing heartbeats, not the 60 s ready timeout, say it."""
    port = free_port()
    engine = start_remote(f"tcp://{HOST}:{port}", module=FAULT_MODULE,
                          fault="exit_before_ready:3")
    t0 = time.monotonic()
    try:
        with pytest.raises(EngineDeadError, match="sent nothing for .* while starting"):
            SyncMPClient(remote_cfg(port))
    finally:
        assert reap(engine) == 3
    assert time.monotonic() - t0 < 10


def test_a_frontend_held_up_by_its_gpu_query_does_not_take_its_live_engine_for_dead(monkeypatch):
    """The GPU query that fills ``Start`` held the frontend's start-up thread past the
    heartbeat timeout (1 s here; where it initialises CUDA it can take seconds). The
    engine beats only from ``Start`` on: its silence counts from there (the start-up
    failed with "sent nothing for 1.5 s while starting")."""
    from shmclient import handshake

    def slow_uuids(*, ask_torch=False):
        time.sleep(1.5)  # a slow call stood in for, not a wait for anything
        return []
    monkeypatch.setattr(handshake, "local_gpu_uuids", slow_uuids)
    port = free_port()
    engine = start_remote(f"tcp://{HOST}:{port}")
    c = sync_client_of(engine, port)
    try:
        assert c.echo("x") == "x"
    finally:
        c.shutdown()
    assert reap(engine) == 0


def test_the_start_up_judges_the_engines_silence_only_with_nothing_unread():
    """The frontend's start-up thread held up (the GIL, a slow call) while the engine's
    heartbeats wait unread: the engine is not silent, whatever the clock says."""
    from shmclient import control
    from shmclient.handshake import Handshake

    ctx = zmq.Context()
    ours, engines = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        ours.bind("inproc://start-up")
        engines.connect("inproc://start-up")
        clock = control.HeartbeatClock(interval_s=1.0, timeout_s=0.0)  # silent at once
        hs = Handshake(ours, EngineConfig(model="mock"), None, address="tcp://engine",
                       proc=None, secret=None, clock=clock)
        with pytest.raises(EngineDeadError, match="sent nothing for"):
            hs._check_silence()
        control.send(engines, control.Heartbeat())
        assert ours.poll(10_000, zmq.POLLIN)
        hs._check_silence()  # a heartbeat waits: not silent
    finally:
        ours.close(0)
        engines.close(0)
        ctx.term()


def test_the_wait_for_the_data_connection_after_ready_keeps_the_start_ups_bounds():
    """An engine that said Ready but never connects its data sockets (a remote engine
    that cannot reach the frontend's data ports): the frontend then waited a second full
    ready timeout, and another rank's failure (``abandon``) did not end the wait. Now it
    waits what is left of the start-up's timeout, and stops within a slice once the
    start is abandoned."""
    from shmclient.handshake import Handshake

    ctx = zmq.Context()
    ours = ctx.socket(zmq.PAIR)
    try:
        ours.bind("inproc://ready-then-silent")
        hs = Handshake(ours, EngineConfig(model="mock"), None, address="tcp://engine",
                       proc=None, secret=None, clock=None)
        hs._deadline = time.monotonic() + 0.3  # (as run() leaves it, 0.3 s to go)
        assert 0.0 < hs.remaining() <= 0.3
        never = lambda slice_s: ours.poll(int(slice_s * 1000)) and False  # noqa: E731
        abandon = threading.Event()
        abandon.set()
        t0 = time.monotonic()
        with pytest.raises(PeerNotProducingError, match="rank 0 was abandoned"):
            hs.watch_until(never, 60.0, "not connected", abandon)
        assert time.monotonic() - t0 < 5.0  # (a slice: 0.1 s)
        with pytest.raises(PeerNotProducingError, match="not connected"):
            hs.watch_until(never, hs.remaining(), "not connected", threading.Event())
        assert hs.remaining() == 0.0
    finally:
        ours.close(0)
        ctx.term()


def test_a_local_start_up_failure_in_a_mixed_group_is_reported_at_once(monkeypatch):
    """Rank 0 (here) fails to start while rank 1 (remote) is awaited: the failure came
    only once rank 1's ready timeout had passed (600 s by default), as the group waited
    for every start. The remote rank's wait now gives up as soon as rank 0 failed."""
    from .fault_engine import inject

    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="exit code 3"):
        make_client(True, True, group_cfg(port, **inject(monkeypatch, "exit_before_ready:3")))
    assert time.monotonic() - t0 < 30  # far below the ready timeout (60 s here)


def test_ctrl_c_while_a_group_awaits_a_remote_rank_returns_at_once(monkeypatch):
    """Ctrl-C while a group's start waits for its remote rank (nobody connects): the
    interrupted start waited for the starts under way, so for the remote rank's whole
    ready timeout (600 s by default) before the KeyboardInterrupt came out."""
    from shmclient import dp_engines

    from .drivers import ctrl_c_when

    rank0_up = threading.Event()

    def start(config, **kw):
        client = AsyncMPClient(config, **kw)
        if config.data_parallel_rank == 0:
            rank0_up.set()
        return client

    monkeypatch.setattr(dp_engines, "_async_client_class", lambda: start)
    port = free_port()
    t0 = time.monotonic()
    with ctrl_c_when(rank0_up, timeout=60), pytest.raises(KeyboardInterrupt):
        make_client(True, True, group_cfg(port))
    assert time.monotonic() - t0 < 30  # far below the ready timeout (60 s here)


def test_a_fatal_error_in_a_remote_engine_reaches_the_client():
    port = free_port()
    engine = start_remote(f"tcp://{HOST}:{port}", module=FAULT_MODULE, fault="raise_in_step:1")
    c = sync_client_of(engine, port)
    try:
        c.add_request(req("a"))
        with pytest.raises(EngineDeadError, match="injected fault in step 1"):
            sync_collect(c, ["a"], timeout=10)
    finally:
        c.shutdown()
    assert reap(engine) == 1


def test_a_port_that_is_taken_is_a_config_error():
    with socket.socket() as s:
        s.bind((HOST, 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ConfigError, match=f"data_parallel_rpc_port={port}.*cannot listen"):
            SyncMPClient(remote_cfg(port))


# -- plain clients -----------------------------------------------------------------------


def test_sync_client_of_a_remote_engine_gives_one_engines_tokens_and_stops_it():
    reqs = [single_request_view(r) for r in requests()]
    want = asyncio.run(one_engine_tokens(reqs))
    port = free_port()
    engine = start_remote(f"tcp://{HOST}:{port}")
    c = sync_client_of(engine, port)
    try:
        assert c.engine_pid == engine.pid
        assert isinstance(c.channel, ZmqChannel)
        for r in reqs:
            c.add_request(r)
        got = sync_collect(c, [r.request_id for r in reqs])
        assert c.echo("x") == "x"
    finally:
        c.shutdown()
    assert got == want
    # SHUTDOWN over the control socket only: the engine exits cleanly on its own.
    assert reap(engine) == 0


async def test_async_client_of_a_remote_engine_on_a_port_the_os_picked():
    """Port 0: the frontend logs the address to give ``--connect`` (and puts it on the
    record); here the handler starts the engine from that record."""
    engines: list[subprocess.Popen] = []

    class StartEngine(logging.Handler):
        def emit(self, record):
            addr = getattr(record, "shmclient_control_address", None)
            if addr is not None:
                engines.append(start_remote(addr))

    handler = StartEngine()
    logging.getLogger("shmclient").addHandler(handler)
    try:
        c = await AsyncMPClient.create(remote_cfg(0))
    finally:
        logging.getLogger("shmclient").removeHandler(handler)
        if not engines:
            pytest.fail("the frontend logged no control address")
    try:
        assert c.engine_pid == engines[0].pid
        await c.add_request_async(req("a", max_tokens=5))
        got = await collect(c, ["a"])
        assert len(got["a"][0]) == 5
    finally:
        await c.shutdown_async()
    assert reap(engines[0]) == 0


def test_a_remote_engine_and_its_frontend_load_torch_before_their_heartbeats():
    # Loaded with the first tensor instead, torch's import holds the GIL for up to ~0.4 s
    # at a time, which could keep heartbeats (1 s of silence is death) from going out: a
    # remote link loads it before its beats start, on both sides. A fresh interpreter,
    # as this one has torch loaded already.
    port = free_port()
    code = textwrap.dedent(
        f"""
        import json, subprocess, sys
        from shmclient import EngineConfig, SyncMPClient
        engine = subprocess.Popen([sys.executable, "-m", "shmclient_engine", "--connect",
                                   "tcp://{HOST}:{port}", "--ready-timeout", "60",
                                   "--allow-module", "tests.user_utilities"],
                                  stdin=subprocess.DEVNULL)
        try:
            c = SyncMPClient(EngineConfig(
                model="mock", max_model_len=64, transport="zmq", data_parallel_size_local=0,
                data_parallel_address="{HOST}", data_parallel_rpc_port={port},
                engine_ready_timeout_s=60.0, utility_modules=("tests.user_utilities",)))
            try:
                got = ["torch" in sys.modules, c.call_utility("torch_threads")]
            finally:
                c.shutdown()
        finally:
            try:
                engine.wait(10)
            except subprocess.TimeoutExpired:
                engine.kill()
                engine.wait(5)
        print(json.dumps(got))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout) == [True, 1]


def test_a_local_zmq_engine_binds_on_tcp_when_an_address_is_given():
    """Spawned here, watched by its pid as usual, its data reached over tcp; its control
    socket (the config crosses it, unauthenticated for a local engine) stays in the
    private ipc folder: a process that connected to it over tcp first got the config
    and the requests in the engine's place."""
    c = SyncMPClient(EngineConfig(model="mock", max_model_len=512, transport="zmq",
                                  data_parallel_address=HOST))
    try:
        assert c.resources.control_address.startswith("ipc://")
        assert c.channel._tx.getsockopt_string(zmq.LAST_ENDPOINT).startswith(f"tcp://{HOST}:")
        c.add_request(req("a", max_tokens=3))
        assert len(sync_collect(c, ["a"])["a"]) == 3
        os.kill(c.engine_pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="died unexpectedly"):
            c.get_output(timeout=5)
    finally:
        c.shutdown()


def test_a_process_on_the_data_port_before_the_engine_gets_no_request(monkeypatch):
    """The request socket routes to the identity given in the engine's Start: a process
    that connected to the tcp port first and registered (under the identity every
    engine used before, or any other) is sent nothing, and the engine is served."""
    ctx = zmq.Context()
    rogues: list[zmq.Socket] = []
    create = ZmqChannel.create

    def create_then_connect_rogues(*args, **kw):
        channel, spec = create(*args, **kw)
        for identity in (b"\x00\x00", b"rogue"):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IDENTITY, identity)
            sock.connect(spec.input_address)
            sock.send(b"")  # registers first: the engine is not even spawned yet
            rogues.append(sock)
        assert all(s.poll(0, zmq.POLLOUT) for s in rogues)
        return channel, spec

    monkeypatch.setattr(ZmqChannel, "create", create_then_connect_rogues)
    try:
        c = SyncMPClient(EngineConfig(model="mock", max_model_len=512, transport="zmq",
                                      data_parallel_address=HOST))
        try:
            c.add_request(req("a", max_tokens=3))
            assert len(sync_collect(c, ["a"], timeout=10)["a"]) == 3
        finally:
            c.shutdown()
        assert [s.poll(0, zmq.POLLIN) for s in rogues] == [0, 0]
    finally:
        for sock in rogues:
            sock.close(0)
        ctx.term()


# -- a data-parallel group over two transports ----------------------------------------------


async def test_group_of_a_local_shm_rank_and_a_remote_tcp_rank_gives_one_engines_tokens():
    reqs = requests()
    want = await one_engine_tokens(reqs)
    port = free_port()
    engine = start_remote(f"tcp://{HOST}:{port}")
    try:
        c = await DPLBAsyncMPClient.create(group_cfg(port))
    except BaseException:
        engine.kill()
        reap(engine)
        raise
    try:
        local, remote = c.engines
        assert isinstance(local.channel, ShmChannel) and isinstance(remote.channel, ZmqChannel)
        assert c.engine_pids[1] == engine.pid
        for r in reqs:
            await c.add_request_async(r)
        got = await collect(c, [r.request_id for r in reqs])
        assert await c.call_utility_all_async("echo", 3) == [3, 3]
    finally:
        await c.shutdown_async()
    assert {k: v[0] for k, v in got.items()} == want
    assert {v[1] for v in got.values()} == {0, 1}
    assert got["emb"][1] == 1  # the tensor went to the remote rank
    assert reap(engine) == 0


async def test_remote_engine_killed_fails_the_group_within_two_seconds():
    port = free_port()
    engine = start_remote(f"tcp://{HOST}:{port}")
    try:
        c = await DPLBAsyncMPClient.create(group_cfg(port, step_delay_s=0.01))
    except BaseException:
        engine.kill()
        reap(engine)
        raise
    try:
        # A long request on each engine: outputs keep coming from both until the kill.
        await c.add_request_async(req("long0", max_tokens=400, rank=0))
        await c.add_request_async(req("long1", max_tokens=400, rank=1))
        await c.get_output_async(timeout=10)
        t0 = time.monotonic()
        os.kill(engine.pid, signal.SIGKILL)
        reap(engine)
        with pytest.raises(EngineDeadError, match="engine 1 .*rank 1 .*sent no heartbeat"):
            while True:
                await c.get_output_async(timeout=5)
        took = time.monotonic() - t0
        assert took < 2.0, took
        with pytest.raises(EngineDeadError):
            await c.call_utility_async("echo", 1)
    finally:
        await c.shutdown_async()


async def test_remote_engine_that_hangs_is_declared_dead_by_its_missing_heartbeats():
    """SIGSTOP: the process and its sockets stay, only the heartbeats stop."""
    port = free_port()
    engine = start_remote(f"tcp://{HOST}:{port}")
    try:
        c = await AsyncMPClient.create(remote_cfg(port, heartbeat_interval_s=0.1))
    except BaseException:
        engine.kill()
        reap(engine)
        raise
    try:
        # (t0 before the stop: the beats end once the heartbeat thread has stopped,
        # which on a busy host can be a while before sigstop sees the last thread stop)
        t0 = time.monotonic()
        sigstop(engine.pid)
        with pytest.raises(EngineDeadError, match="sent no heartbeat") as dead:
            await asyncio.wait_for(c.get_output_async(), 5)
        assert time.monotonic() - t0 < 3.0
        silence = float(re.search(r"sent no heartbeat for ([0-9.]+) s", str(dead.value)).group(1))
        assert silence >= 0.5  # 0.1 s x 5 missed beats
    finally:
        engine.kill()
        reap(engine)
        await c.shutdown_async()


FRONTEND = textwrap.dedent(
    """
    import sys
    from shmclient import SyncMPClient
    from shmclient.config import EngineConfig
    c = SyncMPClient(EngineConfig(model="mock", max_model_len=64, transport="zmq",
                                  data_parallel_size_local=0, data_parallel_address="127.0.0.1",
                                  data_parallel_rpc_port=int(sys.argv[1]),
                                  engine_ready_timeout_s=60.0))
    assert c.echo(1) == 1
    print("ready", flush=True)
    sys.stdin.read()  # until killed
    """
)


def test_frontend_killed_makes_the_remote_engine_exit_within_two_seconds():
    port = free_port()
    engine = start_remote(f"tcp://{HOST}:{port}")
    front = subprocess.Popen([sys.executable, "-c", FRONTEND, str(port)], cwd=ROOT,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        ready, _, _ = select.select([front.stdout], [], [], 60)
        assert ready and front.stdout.readline() == b"ready\n"
        t0 = time.monotonic()
        front.kill()
        front.wait(5)
        assert reap(engine, 5) == 0
        took = time.monotonic() - t0
        assert took < 2.5, took  # 1 s of silence, one 0.2 s beat, the engine's exit
    finally:
        for p in (front, engine):
            if p.poll() is None:
                p.kill()
                p.wait(5)
        front.stdin.close()
        front.stdout.close()
