"""The frontend's side of one engine's start-up on the control socket: wait for ``Hello``,
authenticate a remote engine (``auth``'s challenge-response, before anything of this
client crosses), send ``Start``, wait for ``Ready``; and every way that can fail, raised
typed where it is seen: ``ConfigError`` (the engine module is not an engine, or the
engine reported a ``ConfigError``), ``AuthenticationError``, ``PeerNotProducingError``
(the ready timeout), ``EngineDeadError`` (the engine died or reported another error
while starting), ``ControlMessageError`` (a message that is not the protocol's).
Upper-middle layer, beside ``launcher`` (which owns the socket and the process and calls
this): imports ``control``, ``auth``, ``engine_process``, errors, zmq and msgspec; never
a channel, a client or an engine.
"""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
from typing import TYPE_CHECKING, Callable

import msgspec
import zmq

from . import auth, control
from .control import ControlMessageError, EngineCoreDead
from .engine_process import describe_exit
from .errors import AuthenticationError, ConfigError, EngineDeadError, PeerNotProducingError
from .config import DEFAULT_READY_TIMEOUT_S, READY_TIMEOUT_ENV, ready_timeout_env_s
from .messages import PROTOCOL_VERSION
from .gpus import local_gpu_uuids

if TYPE_CHECKING:
    from .channel_spec import ShmChannelSpec
    from .channel_zmq import ZmqChannelSpec
    from .config import EngineConfig

__all__ = ["DEFAULT_READY_TIMEOUT_S", "Handshake", "READY_TIMEOUT_ENV", "connect_address", "ready_timeout_s"]

_POLL_S = 0.1
#: How long an engine that reported its start-up failure is given to exit by itself (a
#: SIGTERM in its exit would print a second traceback).
_REPORTED_EXIT_S = 5.0


def ready_timeout_s(config: EngineConfig) -> float:
    """The ready timeout: EngineConfig.engine_ready_timeout_s, else the env variable.
    Raises ``ConfigError`` for a variable that is not a finite number of seconds > 0
    (the config field's rule: NaN never ran out, 0 or less gave up at once)."""
    value = getattr(config, "engine_ready_timeout_s", None)
    if value is not None:
        return float(value)
    return ready_timeout_env_s()


def connect_address(address: str) -> str:
    """The control ``address`` the frontend listens on, as an engine on another host gives
    it to ``--connect``: a wildcard host (every interface: ``0.0.0.0``, ``*``, ``[::]``),
    which cannot be connected to, becomes this host's name (any address of this host
    reaches the port too); any other address is returned as it is."""
    scheme, _, rest = address.partition("://")
    host, _, port = rest.rpartition(":")
    if scheme == "tcp" and host in ("0.0.0.0", "*", "[::]"):
        return f"tcp://{socket.gethostname()}:{port}"
    return address


def connect_hint(address: str) -> str:
    """What to add where ``connect_address(address)`` is logged: why the host there is not
    the one configured, when it is not."""
    if connect_address(address) == address:
        return ""
    return (f" (it listens on every interface, {address}: the command names this host; any "
            "address of it that the engine's host reaches works too)")


class Handshake:
    """One start-up, from the frontend's side. ``proc``: the local engine process (None
    for a remote engine, which ``clock`` then watches by its heartbeats from its
    ``Hello`` on); ``secret``: a remote start-up's shared secret (None: none asked)."""

    def __init__(self, ctl: zmq.Socket, config: EngineConfig, spec: ShmChannelSpec | ZmqChannelSpec, *, address: str,
                 proc: subprocess.Popen | None, secret: bytes | None,
                 clock: control.HeartbeatClock | None) -> None:
        self.ctl = ctl
        self.config = config
        self.spec = spec
        self.address = address
        self.proc = proc
        self.secret = secret
        self.clock = clock
        self.hello = False
        self.started = False
        #: Called once the engine's ``Hello`` came (its control socket is connected).
        self.on_hello: Callable[[], None] | None = None
        #: (engine's nonce, frontend's nonce) while the engine's proof is awaited.
        self.challenge: tuple[bytes, bytes] | None = None
        self._deadline = self._timeout = 0.0  # (run() sets them)

    def run(self, timeout: float, abandon: threading.Event | None = None) -> control.Ready:
        """Blocks until the engine is ready (its ``Ready``), up to ``timeout`` seconds;
        raises one of the errors of the module docstring. ``abandon`` set (another start
        of its data-parallel group failed): PeerNotProducingError within a poll slice."""
        deadline = self._deadline = time.monotonic() + timeout
        self._timeout = timeout
        clock = self.clock
        while True:
            self._check_abandoned(abandon)
            wait = max(0.0, deadline - time.monotonic())
            if clock is not None and self.hello:
                clock.beat(self.ctl)
                self._check_silence()
                wait = min(wait, clock.poll_s())
            try:
                msg = control.recv(self.ctl, min(_POLL_S, wait))
            except ControlMessageError as e:
                raise ControlMessageError(
                    f"the engine at {self.address} broke the start-up protocol: {e}") from None
            if msg is None:
                self._check_exit()
                if time.monotonic() >= deadline:
                    raise self._timed_out(timeout)
                continue
            if clock is not None:
                clock.heard()
            if isinstance(msg, control.Ready):
                if not self.started:
                    raise AuthenticationError(
                        f"the engine at {self.address} said Ready before it was sent Start: "
                        "it does not follow the start-up protocol")
                return msg
            if isinstance(msg, EngineCoreDead):
                raise self._failed(msg)
            self._on(msg)

    def _check_abandoned(self, abandon: threading.Event | None) -> None:
        if abandon is not None and abandon.is_set():
            raise PeerNotProducingError(
                f"the start of the engine of data-parallel rank "
                f"{self.config.data_parallel_rank or 0} was abandoned: another engine "
                "of its group failed to start")

    def remaining(self) -> float:
        """Seconds left of ``run``'s timeout (0 once it passed)."""
        return max(0.0, self._deadline - time.monotonic())

    def watch_until(self, done: Callable[[float], bool], timeout: float, what: str,
                    abandon: threading.Event | None = None) -> None:
        """After ``Ready``: until ``done(slice_s)`` (which may wait that long), keep the
        start-up's watch of the engine (its exit, its ``EngineCoreDead``, its heartbeats,
        ours), then PeerNotProducingError(``what``) after ``timeout`` seconds; ``abandon``
        set: as in ``run``, within a slice."""
        deadline = time.monotonic() + timeout
        clock = self.clock
        while not done(_POLL_S):
            self._check_abandoned(abandon)
            if clock is not None:
                clock.beat(self.ctl)
            while True:
                try:
                    msg = control.recv(self.ctl, 0)
                except ControlMessageError:
                    msg = control.Heartbeat()  # (a bad one still says it is there)
                if msg is None:
                    break
                if clock is not None:
                    clock.heard()
                if isinstance(msg, EngineCoreDead):
                    raise self._failed(msg)
            self._check_silence()
            self._check_exit()
            if time.monotonic() >= deadline:
                raise PeerNotProducingError(what)

    def _check_silence(self) -> None:
        """EngineDeadError if the engine has been silent too long: judged only while
        nothing from it waits unread (this thread may itself have been held up, e.g.
        by a slow GPU query or another thread holding the GIL, with the engine's
        heartbeats queued meanwhile)."""
        clock = self.clock
        if clock is not None and clock.expired() and not self.ctl.poll(0, zmq.POLLIN):
            raise EngineDeadError(
                f"Engine core initialization failed: the remote engine at "
                f"{self.address} sent nothing for {clock.silence_s():.1f} s "
                f"(heartbeat_interval_s={self.config.heartbeat_interval_s:g} x "
                f"heartbeat_misses={self.config.heartbeat_misses}) while starting: "
                "it died or the network is down. See its output for the root cause.")

    def _send(self, msg: control.Message) -> None:
        """Send ``msg`` without waiting past the start-up's deadline: the socket holds a
        message for a peer that went away until another connects, so a send that
        cannot go now is retried while the engine lives, its heartbeats come and the
        deadline is ahead."""
        while True:
            try:
                control.send(self.ctl, msg, zmq.NOBLOCK)
                return
            except zmq.Again:
                pass
            self._check_exit()
            self._check_silence()
            left = self._deadline - time.monotonic()
            if left <= 0:
                raise self._timed_out(self._timeout)
            self.ctl.poll(max(1, int(min(_POLL_S, left) * 1000)), zmq.POLLOUT)

    def _on(self, msg: control.Message) -> None:
        if isinstance(msg, control.Hello) and not self.hello:
            self.hello = True
            if self.on_hello is not None:
                self.on_hello()
            if msg.protocol_version != PROTOCOL_VERSION:
                raise ControlMessageError(
                    f"the engine at {self.address} speaks protocol {msg.protocol_version}, "
                    f"this client {PROTOCOL_VERSION}: install the same shmclient version on both")
            if self.secret is not None:
                # Nothing about this client crosses before the engine has proved it
                # knows the secret (auth's challenge-response).
                if len(msg.nonce) != auth.NONCE_BYTES:
                    raise AuthenticationError(
                        f"the remote engine at {self.address} offered no authentication (it "
                        "has no shared secret): start it with the same "
                        f"{auth.SECRET_FILE_ENV} or {auth.SECRET_ENV} as this frontend")
                nonce_f = auth.nonce()
                self.challenge = (msg.nonce, nonce_f)
                self._send(control.Auth(
                    nonce=nonce_f, proof=auth.proof(self.secret, b"frontend", msg.nonce, nonce_f)))
                return
            self._send_start()
        elif isinstance(msg, control.Auth) and self.challenge is not None:
            nonce_e, nonce_f = self.challenge
            self.challenge = None
            if msg.nonce or not auth.verify(self.secret, b"engine", nonce_f, nonce_e, msg.proof):
                raise AuthenticationError(
                    f"the remote engine at {self.address} could not prove it knows the shared "
                    "secret: it is not this frontend's engine, or its "
                    f"{auth.SECRET_FILE_ENV} / {auth.SECRET_ENV} differs")
            self._send_start()
        elif not (isinstance(msg, control.Heartbeat) and self.hello):
            raise ControlMessageError.unexpected(
                msg, f"from the engine at {self.address} during its start-up")

    def _send_start(self) -> None:
        self._send(control.Start(
            config=msgspec.Raw(msgspec.msgpack.encode(self.config)),
            transport=self.config.transport,
            channel=msgspec.Raw(msgspec.msgpack.encode(self.spec)),
            gpu_uuids=local_gpu_uuids(ask_torch=self.config.is_cuda)))
        self.started = True
        if self.clock is not None:
            # The engine beats from Start on (the config it carries sets the interval):
            # its silence counts from now, not from its last word before (the GPU
            # query above can take seconds where it initialises CUDA).
            self.clock.heard()

    def _failed(self, dead: EngineCoreDead) -> Exception:
        """The error to raise for the engine's own report of its start-up failure."""
        if self.secret is not None and not self.started:
            # Nobody has proved it knows the secret yet: whoever reached the port first can
            # say anything, so its report is never typed from its own error_type (a forged
            # ConfigError would be raised as this client's own, and in a group cancel every
            # rank's start). A real engine sends one here only to refuse our proof.
            if self.challenge is None:
                return AuthenticationError(
                    f"the peer at {self.address} reported a start-up failure before this "
                    "frontend's authentication challenge, which no engine does: it is not this "
                    f"frontend's engine. Its claim: {dead.message!r}")
            return AuthenticationError(
                f"the remote engine at {self.address} refused this frontend's proof of the "
                f"shared secret. Its claim (it has not proved the secret itself): {dead.message!r}")
        if self.proc is not None:
            try:  # it exits by itself now
                self.proc.wait(_REPORTED_EXIT_S)
            except subprocess.TimeoutExpired:
                pass
        if dead.error_type == "AuthenticationError":
            return AuthenticationError(
                f"the remote engine at {self.address} refused this frontend: {dead.message}")
        if dead.error_type is not None:
            return control.ERROR_TYPES[dead.error_type](dead.message)
        return EngineDeadError(f"Engine core initialization failed: {dead.message}")

    def _check_exit(self) -> None:
        """Raise if the local engine process has exited."""
        proc = self.proc
        rc = proc.poll() if proc is not None else None
        if rc is None:
            return
        module = self.config.engine_module
        if rc >= 0 and not self.hello:
            # It ran and ended without a word of the handshake: not an engine (no such
            # module there, or one that does not speak the protocol).
            raise ConfigError(
                f"EngineConfig.engine_module={module!r} is invalid: 'python -m {module}' "
                f"(pid {proc.pid}) exited ({describe_exit(rc)}) without starting the engine "
                "handshake. See its output above for the root cause.")
        raise EngineDeadError(
            f"Engine core initialization failed: the engine process {proc.pid} (python -m "
            f"{module}) exited before it was ready ({describe_exit(rc)}). See its output "
            "above for the root cause.")

    def _timed_out(self, timeout: float) -> PeerNotProducingError:
        config = self.config
        if self.proc is None and not self.hello:
            return PeerNotProducingError(
                f"Timed out waiting for the remote engine of data-parallel rank "
                f"{config.data_parallel_rank or 0}: nothing connected to {self.address} "
                f"within {timeout:g} s. Start it with 'python -m {config.engine_module} "
                f"--connect {connect_address(self.address)}'{connect_hint(self.address)}, or "
                f"wait longer: set {READY_TIMEOUT_ENV} or EngineConfig.engine_ready_timeout_s.")
        return PeerNotProducingError(
            "Timed out waiting for engine core processes to start. This is often caused by "
            f"slow weight loading for large models. Waited {timeout:g} s; set "
            f"{READY_TIMEOUT_ENV} (now {os.environ.get(READY_TIMEOUT_ENV, 'unset')}) or "
            "EngineConfig.engine_ready_timeout_s to wait longer.")
