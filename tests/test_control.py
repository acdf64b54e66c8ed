"""The control plane's messages (``shmclient.control``): every kind round-trips; anything
else (the old multipart frames, bytes that are not msgpack, an unknown kind, a field out
of its bounds) raises ``ControlMessageError`` naming what is wrong; and each end handles
one as it should: a start-up fails at once and typed (never after the ready timeout),
after the start-up it is logged and dropped. A start-up failure the engine reports is
raised typed from ``EngineCoreDead.error_type``, never from its text.

The frontend's side is driven by a fake engine in a thread of this process, over tcp on
loopback (a remote start-up, without authentication: ``shmclient.auth`` has its own
tests in test_security.py); the engine's side by a fake frontend socket.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import msgspec
import pytest
import zmq

from shmclient import control
from shmclient.channel_zmq import ZmqChannel, ZmqChannelSpec
from shmclient.config import EngineConfig, UnknownFieldError
from shmclient.control import ControlMessageError
from shmclient.control_sockets import MAX_MESSAGE_BYTES, IpcDir
from shmclient.errors import ConfigError, EngineDeadError, PeerDeadError, ProtocolError
from shmclient.messages import PROTOCOL_VERSION

from .test_remote import free_port

HOST = "127.0.0.1"
ROOT = __file__.rsplit("/tests/", 1)[0]

ALL = [
    control.Hello(pid=12, protocol_version=PROTOCOL_VERSION, nonce=b"n" * 32),
    control.Auth(proof=b"p" * 32, nonce=b"n" * 32),
    control.Start(config=msgspec.Raw(msgspec.msgpack.encode(EngineConfig())), transport="zmq",
                  channel=msgspec.Raw(msgspec.msgpack.encode(ZmqChannelSpec("a", "b", b"Eid"))),
                  gpu_uuids=["GPU-1"]),
    control.Ready(pid=12, num_gpu_blocks=3, block_size=16, max_model_len=64, gpu_uuids=[]),
    control.EngineCoreDead(message="boom", error_type="ConfigError"),
    control.Shutdown(),
    control.Heartbeat(),
]


def test_every_kind_round_trips_as_one_frame_naming_its_kind():
    for msg in ALL:
        frame = control.encode(msg)
        assert msgspec.msgpack.decode(frame)["type"] == type(msg).__name__
        got = control.decode([frame])
        assert type(got) is type(msg)
        assert control.encode(got) == frame


def _map(**fields) -> bytes:
    return msgspec.msgpack.encode(fields)


def _nested(depth: int) -> bytes:
    """A Start whose config is ``depth`` one-element arrays deep (2 bytes a level fit
    far below the size limit, far beyond what a thread's stack decodes)."""
    return (b"\x84" + msgspec.msgpack.encode("type") + msgspec.msgpack.encode("Start")
            + msgspec.msgpack.encode("config") + b"\x91" * depth + b"\xc0"
            + _map(transport="shm")[1:] + msgspec.msgpack.encode("channel") + b"\xc4\x00")


BAD = [
    ("old multipart HELLO", [b"HELLO", b"4242"], "2 frames"),
    ("old one-frame SHUTDOWN", [b"SHUTDOWN"], "not msgpack"),
    ("not a map", [msgspec.msgpack.encode([1, 2])], "a msgpack list, not a map"),
    ("no kind", [_map(pid=1)], "unknown kind 'None'"),
    ("unknown kind", [_map(type="Bogus")], "unknown kind 'Bogus'"),
    ("pid a string", [_map(type="Hello", pid="1", protocol_version=2)], "`$.pid`"),
    ("pid negative", [_map(type="Hello", pid=-1, protocol_version=2)], "`$.pid`"),
    ("nonce too long", [_map(type="Hello", pid=1, protocol_version=2, nonce=b"n" * 33)],
     "`$.nonce`"),
    ("proof short", [_map(type="Auth", proof=b"p" * 31)], "`$.proof`"),
    ("transport", [_map(type="Start", config={}, transport="tcp", channel={})], "`$.transport`"),
    ("too many GPUs", [_map(type="Start", config={}, transport="shm", channel={},
                            gpu_uuids=["g"] * 1025)], "`$.gpu_uuids`"),
    ("block_size 0", [_map(type="Ready", pid=1, num_gpu_blocks=1, block_size=0,
                           max_model_len=1)], "`$.block_size`"),
    ("error type not allowed", [_map(type="EngineCoreDead", message="x", error_type="OSError")],
     "`$.error_type`"),
    ("message too long", [_map(type="EngineCoreDead", message="x" * (control.MAX_ERROR_CHARS + 1))],
     "`$.message`"),
    ("too big", [b"\x00" * (MAX_MESSAGE_BYTES + 1)], "bytes (at most"),
    ("nested too deeply", [_nested(100_000)], "nested too deeply"),
    ("not msgpack, nested too deeply", [_nested(100_000) + b"\xc1"], "nested too deeply"),
]


@pytest.mark.parametrize("name,frames,words", BAD, ids=[b[0] for b in BAD])
def test_anything_else_raises_a_typed_error_naming_it(name, frames, words):
    with pytest.raises(ControlMessageError) as ei:
        control.decode(frames)
    assert words in str(ei.value), str(ei.value)
    assert isinstance(ei.value, ProtocolError)


def test_engine_core_dead_names_only_allowlisted_kinds():
    typed = control.EngineCoreDead.of(ConfigError("EngineConfig.x=1 is invalid"))
    assert (typed.error_type, typed.message) == ("ConfigError", "EngineConfig.x=1 is invalid")
    # a subclass travels as the class the frontend knows
    assert control.EngineCoreDead.of(UnknownFieldError("no field y")).error_type == "ConfigError"
    other = control.EngineCoreDead.of(ValueError("ConfigError: looks typed"))
    assert other.error_type is None and other.message == "ValueError: ConfigError: looks typed"
    long = control.EngineCoreDead.of(RuntimeError("x" * (2 * control.MAX_ERROR_CHARS)))
    assert control.decode([control.encode(long)]).message == long.message  # still decodes
    assert set(control.ERROR_TYPES) == set(control.ErrorType.__args__)


# ------------------------------------------------------------ the frontend's handshake

@pytest.fixture
def insecure(monkeypatch):
    for name in ("SHMCLIENT_SECRET", "SHMCLIENT_SECRET_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SHMCLIENT_ALLOW_UNAUTHENTICATED", "1")


def remote_config(port: int, **kw) -> EngineConfig:
    return EngineConfig(model="mock", max_model_len=64, transport="zmq",
                        data_parallel_size_local=0, data_parallel_address=HOST,
                        data_parallel_rpc_port=port, engine_ready_timeout_s=30.0, **kw)


class FakeEngine:
    """An engine in a thread: connects to the frontend's control socket, runs
    ``script(self)``, then reads until ``Shutdown`` (or 20 s) unless ``until_shutdown``
    is False; what it read is in ``got``."""

    def __init__(self, port: int, script, until_shutdown: bool = True) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PAIR)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://{HOST}:{port}")
        self.script = script
        self.until_shutdown = until_shutdown
        self.got: list[control.Message] = []
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def expect(self, kind: type, timeout: float = 20.0) -> control.Message:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = control.recv(self.sock, 0.1)
            if msg is not None:
                self.got.append(msg)
                if isinstance(msg, kind):
                    return msg
        raise TimeoutError(f"no {kind.__name__} from the frontend")

    def _run(self) -> None:
        try:
            self.script(self)
            if self.until_shutdown:
                self.expect(control.Shutdown)
        except BaseException as e:  # noqa: BLE001 - handed to the test by join()
            self.error = e

    def join(self) -> None:
        self.thread.join(30)
        assert not self.thread.is_alive()
        self.sock.close(0)
        self.ctx.term()
        if self.error is not None:
            raise self.error


def hello(fake: FakeEngine, version: int = PROTOCOL_VERSION) -> None:
    control.send(fake.sock, control.Hello(pid=os.getpid(), protocol_version=version))


def start_client(port: int, script, until_shutdown: bool = True, **kw):
    """Build a SyncMPClient against a fake engine; returns (client or the error, fake)."""
    from shmclient import SyncMPClient

    fake = FakeEngine(port, script, until_shutdown)
    try:
        return SyncMPClient(remote_config(port, **kw)), fake
    except Exception as e:  # noqa: BLE001 - the test looks at it
        return e, fake


@pytest.mark.parametrize("script,words", [
    (lambda f: f.sock.send_multipart([b"HELLO", b"4242"]), "2 frames"),
    (lambda f: hello(f, version=1), f"speaks protocol 1, this client {PROTOCOL_VERSION}"),
    (lambda f: (hello(f), f.sock.send(_map(type="Bogus"))), "unknown kind 'Bogus'"),
    (lambda f: (hello(f), control.send(f.sock, control.Shutdown())),
     "unexpected Shutdown control message"),
    (lambda f: (hello(f), f.expect(control.Start), f.sock.send(_map(
        type="Ready", pid=1, num_gpu_blocks=1, block_size=0, max_model_len=1))), "`$.block_size`"),
], ids=["old-wire", "old-version", "unknown-kind", "unexpected-kind", "bad-field"])
def test_a_bad_message_fails_the_start_up_at_once_naming_it(insecure, script, words):
    port = free_port()
    t0 = time.monotonic()
    err, fake = start_client(port, script)
    fake.join()
    assert isinstance(err, ControlMessageError), err
    assert words in str(err) and f"tcp://{HOST}:{port}" in str(err), str(err)
    assert time.monotonic() - t0 < 10  # not the 30 s ready timeout
    if "version" in words or "frames" in words:
        assert not any(isinstance(m, control.Start) for m in fake.got), fake.got


class _Exited:
    """An engine process that has exited (``Handshake`` asks ``poll()``)."""
    pid = 4242

    def poll(self) -> int:
        return 3


def test_an_engine_gone_right_after_its_hello_fails_the_start_up_instead_of_blocking():
    """The frontend's control socket keeps a message for a peer that went away until
    another connects: a Start sent after the engine's connection dropped blocked the
    start-up for good, past its deadline and the engine's exit."""
    from shmclient.control_sockets import bound_address, frontend_socket
    from shmclient.handshake import Handshake

    ctx = zmq.Context()
    front = frontend_socket(ctx, f"tcp://{HOST}:*")
    address = bound_address(front)
    watch = front.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    engine = ctx.socket(zmq.PAIR)
    outcome: list = []
    t = None
    try:
        engine.connect(address)
        control.send(engine, control.Hello(pid=4242, protocol_version=PROTOCOL_VERSION))
        assert front.poll(10_000, zmq.POLLIN)  # the Hello is in; then the engine goes
        engine.close(linger=0)
        assert watch.poll(10_000, zmq.POLLIN)
        hs = Handshake(front, EngineConfig(model="mock"), {}, address=address, proc=_Exited(),
                       secret=None, clock=None)

        def run() -> None:
            try:
                outcome.append(hs.run(30.0))
            except Exception as e:  # noqa: BLE001 - looked at below
                outcome.append(e)

        t = threading.Thread(target=run)
        t.start()
        t.join(10)
        assert not t.is_alive(), "the start-up blocked sending Start to a peer that is gone"
        assert isinstance(outcome[0], EngineDeadError), outcome
        assert "exited before it was ready" in str(outcome[0])
    finally:
        if t is not None and t.is_alive():  # (unblock the send that waits for a peer)
            other = ctx.socket(zmq.PAIR)
            other.connect(address)
            t.join(10)
            other.close(0)
        front.disable_monitor()
        watch.close(0)
        front.close(0)
        ctx.term()


@pytest.mark.parametrize("then", ["reports its death", "goes silent"])
def test_an_engine_lost_between_its_ready_and_its_data_connection_fails_the_start_up(insecure, then):
    """After Ready the frontend waited for the engine's registration on the request
    socket for the whole ready timeout, deaf to the control socket: an engine that died
    there held make_client that long, and the error said it never connected."""
    def script(fake: FakeEngine) -> None:
        hello(fake)
        fake.expect(control.Start)  # (it never connects to the data sockets)
        control.send(fake.sock, control.Ready(pid=os.getpid(), num_gpu_blocks=4,
                                              block_size=16, max_model_len=64))
        if then == "reports its death":
            control.send(fake.sock, control.EngineCoreDead(message="RuntimeError: boom"))

    t0 = time.monotonic()
    err, fake = start_client(free_port(), script, until_shutdown=False)
    fake.join()
    assert isinstance(err, EngineDeadError), err
    assert ("boom" if then == "reports its death" else "sent nothing for") in str(err), str(err)
    assert time.monotonic() - t0 < 10  # not the 30 s ready timeout


def _dead_after_start(message: str, error_type: str | None):
    def script(fake: FakeEngine) -> None:
        hello(fake)
        fake.expect(control.Start)
        control.send(fake.sock, control.EngineCoreDead(message=message, error_type=error_type))
    return script


def test_the_engines_config_error_is_raised_typed_from_its_kind(insecure):
    text = "EngineConfig.device='cuda:7' is invalid: no such GPU"
    err, fake = start_client(free_port(), _dead_after_start(text, "ConfigError"))
    fake.join()
    assert type(err) is ConfigError and str(err) == text


def test_an_engine_error_whose_text_looks_like_a_config_error_is_not_one(insecure):
    """The kind travels in its own field: an error text that merely reads like one is an
    EngineDeadError (the old regex over the text made it a ConfigError)."""
    text = "RuntimeError: Engine core initialization failed: ConfigError: spoofed"
    err, fake = start_client(free_port(), _dead_after_start(text, None))
    fake.join()
    assert isinstance(err, EngineDeadError) and not isinstance(err, ConfigError), repr(err)
    assert str(err) == f"Engine core initialization failed: {text}"


def test_after_start_up_bad_messages_are_logged_and_dropped_and_death_still_seen(insecure, caplog):
    """The monitor keeps watching through messages that are not the protocol's; the
    engine's EngineCoreDead after them is what marks it dead."""
    ready = threading.Event()
    go = threading.Event()

    def script(fake: FakeEngine) -> None:
        hello(fake)
        start = fake.expect(control.Start)
        spec = msgspec.msgpack.decode(start.channel, type=ZmqChannelSpec)
        channel = ZmqChannel.attach(fake.ctx, spec)
        try:
            control.send(fake.sock, control.Ready(pid=os.getpid(), num_gpu_blocks=4,
                                                  block_size=16, max_model_len=64))
            ready.set()
            assert go.wait(20)
            fake.sock.send(b"junk")
            fake.sock.send(_nested(100_000))
            fake.sock.send_multipart([b"ENGINE_CORE_DEAD", b"old wire"])
            hello(fake)
            control.send(fake.sock, control.EngineCoreDead(message="RuntimeError: boom"))
        finally:
            channel.close()

    # after EngineCoreDead the frontend's monitor is done: no Shutdown comes
    client, fake = start_client(free_port(), script, until_shutdown=False,
                                heartbeat_interval_s=2.0)
    try:
        assert not isinstance(client, Exception), client
        assert ready.wait(5) and client.resources.alive()
        with caplog.at_level("WARNING", logger="shmclient"):
            go.set()
            assert client.resources.dead.wait(20)
        assert client.resources.dead_reason == (
            "Engine core process reported a fatal error: RuntimeError: boom")
        dropped = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
        assert len(dropped) == 4, dropped
        assert "not msgpack" in dropped[0] and "nested too deeply" in dropped[1]
        assert "2 frames" in dropped[2]
        assert "unexpected Hello control message after its start-up" in dropped[3]
    finally:
        go.set()
        if not isinstance(client, Exception):
            client.shutdown()
        fake.join()


# ------------------------------------------------------------------ the engine's side

@pytest.fixture
def pair():
    """(frontend, engine) ends of a control socket pair in this process."""
    ctx = zmq.Context()
    front, engine = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    front.bind("inproc://ctl")
    engine.connect("inproc://ctl")
    yield front, engine
    front.close(0)
    engine.close(0)
    ctx.term()


def test_remote_engine_start_up_refuses_what_is_not_the_protocol(pair):
    from shmclient.serve_remote import connect_and_hello

    front, engine = pair
    start = ALL[2]
    control.send(front, control.Heartbeat())  # the frontend beats from Hello on: fine
    control.send(front, start)
    assert control.encode(connect_and_hello(engine, "tcp://f:1", 5.0)) == control.encode(start)
    assert isinstance(control.recv(front, 5), control.Hello)
    front.send(_map(type="Ready", pid=1, num_gpu_blocks=1, block_size=1, max_model_len=1))
    with pytest.raises(ControlMessageError, match="unexpected Ready control message from the "
                                                  "frontend at tcp://f:1 before Start"):
        connect_and_hello(engine, "tcp://f:1", 5.0)
    front.send(b"junk")
    with pytest.raises(ControlMessageError, match="frontend at tcp://f:1 broke.*not msgpack"):
        connect_and_hello(engine, "tcp://f:1", 5.0)
    control.send(front, control.Shutdown())
    with pytest.raises(PeerDeadError, match="Shutdown before Start"):
        connect_and_hello(engine, "tcp://f:1", 5.0)


def test_frontend_link_drops_bad_messages_and_stops_on_shutdown(pair, caplog):
    from shmclient.serve_remote import FrontendLink

    front, engine = pair
    with caplog.at_level("WARNING", logger="shmclient_engine"):
        front.send(b"junk")
        control.send(front, ALL[2])
        control.send(front, control.Shutdown())
        link = FrontendLink(engine, 0.05, 10.0)
        link._thread.join(10)  # it ends on Shutdown
        assert link.stop_reason == "the frontend said Shutdown"
        link.close()
    dropped = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(dropped) == 2 and "not msgpack" in dropped[0] and "Start" in dropped[1], dropped


def test_a_frontend_link_that_fails_stops_the_engine(pair, monkeypatch):
    """A bug in the remote engine's link thread ended it, and the engine never stopped:
    neither Shutdown nor the heartbeats' silence reached it any more."""
    from shmclient import serve_remote

    def broken_decode(frames):
        raise RuntimeError("a bug in decode")

    front, engine = pair
    monkeypatch.setattr(serve_remote.control, "decode", broken_decode)
    control.send(front, control.Heartbeat())
    link = serve_remote.FrontendLink(engine, 0.05, 10.0)
    link._thread.join(10)
    assert link.stop_reason == "the link to the frontend failed: RuntimeError('a bug in decode')"
    link.close()


def test_local_engine_loop_drops_bad_messages_and_stops_on_shutdown(pair, caplog):
    from shmclient.serve_loop import EngineProc
    from shmclient_engine import make_core

    from .test_engine_core import _RecordingChannel

    front, engine = pair
    proc = EngineProc(engine, os.getppid(), EngineConfig(model="mock", max_model_len=64),
                      _RecordingChannel(), make_core)
    try:
        with caplog.at_level("WARNING", logger="shmclient_engine"):
            front.send_multipart([b"SHUTDOWN", b"x"])
            control.send(front, control.Heartbeat())
            assert engine.poll(5000)
            assert proc.alive()  # neither is a Shutdown
            control.send(front, control.Shutdown())
            assert engine.poll(5000)
            assert not proc.alive()
    finally:
        proc.core.shutdown()
    dropped = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(dropped) == 2 and "2 frames" in dropped[0] and "Heartbeat" in dropped[1], dropped


@pytest.mark.parametrize("reply,code", [
    ([b"START", b"{}", b"shm", b"{}", b"[]"], 1),  # the old wire: reported, exit 1
    ([control.encode(control.Shutdown())], 0),     # the frontend gave up first
])
def test_local_engine_answers_a_bad_first_message_and_exits(reply, code):
    ctx = zmq.Context()
    front = ctx.socket(zmq.PAIR)
    front.setsockopt(zmq.LINGER, 0)
    ipc = IpcDir()
    address = ipc.address("ctl")
    front.bind(address)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.Popen([sys.executable, "-m", "shmclient_engine", address, str(os.getpid())],
                            cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        first = control.recv(front, 60)
        assert isinstance(first, control.Hello) and first.pid == proc.pid
        assert first.protocol_version == PROTOCOL_VERSION
        front.send_multipart(reply)
        if code:
            dead = control.recv(front, 30)
            assert isinstance(dead, control.EngineCoreDead) and dead.error_type is None, dead
            assert dead.message.startswith("ControlMessageError: a control message of 5 frames")
        assert proc.wait(30) == code
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)
        front.close(0)
        ctx.term()
        ipc.remove()


def test_engine_core_dead_of_any_error_can_be_sent():
    """The engine's last word must encode whatever the error: a lone surrogate (a file
    name that is not UTF-8) made the encoder raise, and the report was lost; an error
    whose str() fails raised from ``of`` itself."""

    class Unprintable(Exception):
        def __str__(self):
            raise RuntimeError("no text")

    name = b"caf\xe9".decode("utf-8", "surrogateescape")  # (as os.listdir gives it)
    odd = control.EngineCoreDead.of(OSError(f"cannot open {name}"))
    assert control.decode([control.encode(odd)]) == odd and "caf\\udce9" in odd.message
    bad = control.EngineCoreDead.of(Unprintable())
    assert control.decode([control.encode(bad)]).message == "Unprintable: <Unprintable whose str() failed>"



def test_a_remote_engines_monitor_that_finds_the_shutdown_begun_sends_shutdown(pair):
    """The client's shutdown marks the engine dead before it wakes the monitor; a
    monitor that woke in between (a heartbeat due) returned without the Shutdown, and
    the remote engine stopped only on the heartbeats' silence, logging its frontend as
    dead."""
    from shmclient.monitor import EngineMonitor

    front, engine = pair
    r, w = os.pipe()
    dead = threading.Event()
    dead.set()  # begin_shutdown() ran; its wake byte is not written
    mon = EngineMonitor(front, None, control.HeartbeatClock(0.05, 1.0), r, pid=4242,
                        address="inproc://ctl", rank=1, dead=dead,
                        mark_dead=lambda reason: None, expected_exit=lambda: True)
    try:
        mon.start()
        mon.join(10)
        assert not mon.is_alive()
        assert isinstance(control.recv(engine, 5.0), control.Shutdown)
    finally:
        os.close(r)
        os.close(w)


def test_a_monitor_that_fails_marks_the_engine_dead_rather_than_leaving_it_unwatched(pair, monkeypatch):
    """A bug in the watch (here: decoding raises what it never should) ended the
    monitor thread: a later engine death went unseen and get_output() without a
    timeout blocked for good. The engine is marked dead instead, saying why."""
    from shmclient import monitor

    front, engine = pair
    r, w = os.pipe()
    reasons: list[str] = []

    def broken_decode(frames):
        raise RuntimeError("a bug in decode")

    monkeypatch.setattr(monitor.control, "decode", broken_decode)
    mon = monitor.EngineMonitor(front, None, control.HeartbeatClock(0.05, 5.0), r, pid=4242,
                                address="inproc://ctl", rank=1, dead=threading.Event(),
                                mark_dead=reasons.append, expected_exit=lambda: False)
    try:
        mon.start()
        control.send(engine, control.Heartbeat())
        mon.join(10)
        assert not mon.is_alive()
        assert reasons == ["The client's watch of the engine core failed: RuntimeError('a bug in decode')"]
    finally:
        os.close(r)
        os.close(w)
