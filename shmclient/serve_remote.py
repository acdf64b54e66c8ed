"""The engine side of a remote engine's control link: its command line, the ``Hello`` /
``Auth`` / ``Start`` handshake with a frontend over tcp, and the heartbeat thread that
owns the socket from ``Start`` on. Protocol layer, engine side: imports ``auth``, ``config``,
``control``, ``messages`` and ``errors``; never a client, ``waiting`` or an engine. A
remote engine (``--connect``) has no parent to watch: it connects to the frontend's
control socket (retrying until the frontend listens, up to
``--ready-timeout`` seconds, for ``Start``), proves it knows the shared secret, and from
``Start`` on a ``FrontendLink`` thread beats every ``EngineConfig.heartbeat_interval_s``
and stops the engine on ``Shutdown`` or after ``heartbeat_timeout_s`` without a word
from the frontend.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time

import zmq

from . import auth, control
from .config import ready_timeout_env_s
from .control import ControlMessageError
from .errors import AuthenticationError, ConfigError, PeerDeadError
from .messages import PROTOCOL_VERSION

__all__ = ["FrontendLink", "connect_and_hello", "parse_argv"]

_SLICE_S = 0.1

log = logging.getLogger("shmclient_engine")


class FrontendLink:
    """A remote engine's control socket from ``Start`` on (see the module docstring): a
    thread reads it (``Shutdown``, heartbeats) and beats every interval; the main thread
    sends through ``send``. The socket is used under one lock by both; never blocks for
    longer than one non-blocking socket call."""

    def __init__(self, ctl: zmq.Socket, interval_s: float, timeout_s: float) -> None:
        self.ctl = ctl
        #: Why the engine must stop (None while the frontend is there).
        self.stop_reason: str | None = None
        self._hb = control.HeartbeatClock(interval_s, timeout_s)
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shmclient-engine-link",
                                        daemon=True)
        self._thread.start()

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    def send(self, msg: control.Message) -> bool:
        """Queue one message for the frontend; False when the socket cannot take it (no
        frontend connected). Never blocks."""
        with self._lock:
            try:
                control.send(self.ctl, msg, zmq.NOBLOCK)
                return True
            except zmq.ZMQError:
                return False

    def _run(self) -> None:
        try:
            self._beat_and_read()
        except Exception as e:  # a bug: the engine would never learn its frontend went
            log.exception("remote engine: the link to the frontend failed")
            self.stop_reason = f"the link to the frontend failed: {e!r}"

    def _beat_and_read(self) -> None:
        hb = self._hb
        while not self._done.wait(hb.poll_s()):
            with self._lock:
                while self.ctl.poll(0, zmq.POLLIN):
                    hb.heard()
                    self._take(self.ctl.recv_multipart())
                if self.stop_reason is None:
                    hb.beat(self.ctl)
                    if hb.expired():
                        self.stop_reason = (f"the frontend sent nothing for {hb.silence_s():.1f} "
                                            "s: it died, or the network to it is down")
                        log.warning("remote engine stops: %s", self.stop_reason)
            if self.stop_reason is not None:
                return

    def _take(self, frames: list[bytes]) -> None:
        """One message from the frontend: ``Shutdown`` stops the engine; one that is not a
        message, or not one a frontend sends after ``Start``, is logged and dropped."""
        try:
            msg = control.decode(frames)
        except ControlMessageError as e:
            log.warning("remote engine: dropped a bad control message: %s", e)
            return
        if isinstance(msg, control.Shutdown):
            self.stop_reason = "the frontend said Shutdown"
        elif not isinstance(msg, control.Heartbeat):
            log.warning("remote engine: dropped an %s",
                        ControlMessageError.unexpected(msg, "after Start"))

    def close(self) -> None:
        """Stop the thread (waits for it, at most one interval and a bit)."""
        self._done.set()
        self._thread.join(timeout=5.0)


def parse_argv(argv: list[str]) -> tuple[str, int | None, float, tuple[str, ...]]:
    """``[address, frontend pid (, seconds)]`` or ``--connect ADDRESS [--ready-timeout
    S]``: the control address, the frontend's pid (None when remote) and how long the
    engine waits for START (a local engine without the third argument: while its
    frontend lives). Raises ``SystemExit`` (usage) for anything else."""
    if argv and not argv[0].startswith("-"):
        usage = ("usage: python -m shmclient_engine <control address> <frontend pid> "
                 "[<seconds to wait for Start>] | --connect tcp://HOST:PORT [--ready-timeout S]")
        if len(argv) not in (2, 3):
            raise SystemExit(usage)
        try:
            wait_s = float(argv[2]) if len(argv) == 3 else float("inf")
            pid = int(argv[1])
        except ValueError:
            raise SystemExit(usage) from None
        if not wait_s > 0:
            raise SystemExit(usage)
        return argv[0], pid, wait_s, ()
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m shmclient_engine",
        description="A remote engine core: connects to a frontend's control socket "
                    "(EngineConfig.data_parallel_size_local) and serves it until it says "
                    "SHUTDOWN or goes silent.")
    p.add_argument("--connect", required=True, metavar="tcp://HOST:PORT",
                   help="the frontend's control address (logged by the frontend)")
    p.add_argument("--allow-module", action="append", default=[], metavar="NAME",
                   help="a module the frontend may make this engine import (an entry of "
                        "EngineConfig.utility_modules); repeat for more. A frontend naming "
                        "any other is refused")
    p.add_argument("--ready-timeout", type=float, default=None, metavar="S",
                   help="seconds to wait for the frontend's START (default: "
                        "$SHMCLIENT_ENGINE_READY_TIMEOUT_S, else 600)")
    args = p.parse_args(argv)
    if not _is_host_port(args.connect):
        p.error(f"--connect {args.connect!r}: expected tcp://HOST:PORT (PORT a number from 1 to 65535, "
                "as the frontend logs it)")
    wait = args.ready_timeout
    if wait is None:
        try:
            wait = ready_timeout_env_s()
        except ConfigError as e:
            p.error(str(e))
    elif not (math.isfinite(wait) and wait > 0):
        p.error(f"--ready-timeout {wait!r}: must be a finite number of seconds > 0")
    return args.connect, None, wait, tuple(args.allow_module)


def _is_host_port(address: str) -> bool:
    """Whether ``address`` is ``tcp://HOST:PORT`` with a host and a port from 1 to 65535
    (zmq would fail on anything else only once it connects, with its own traceback)."""
    scheme, _, rest = address.partition("://")
    host, _, port = rest.rpartition(":")
    return (scheme == "tcp" and bool(host) and port.isascii() and port.isdigit()
            and 1 <= int(port) <= 65535)


def connect_and_hello(ctl: zmq.Socket, address: str, wait_s: float,
                      secret: bytes | None = None) -> control.Start | None:
    """Remote engine: say ``Hello`` once the frontend listens, then wait for ``Start``;
    None if either takes longer than ``wait_s`` in all (blocks up to that). With a
    ``secret``, the frontend's ``Auth`` challenge is answered first. Raises
    ``AuthenticationError`` for a frontend that cannot prove it knows the secret (or
    sends ``Start`` without trying): nothing of its config is decoded, no module it names
    is imported; ``ControlMessageError`` for a message that is not the protocol's;
    ``PeerDeadError`` when the frontend says ``Shutdown`` first."""
    deadline = time.monotonic() + wait_s
    nonce_e = auth.nonce() if secret is not None else b""
    hello = control.encode(control.Hello(pid=os.getpid(), protocol_version=PROTOCOL_VERSION,
                                         nonce=nonce_e))
    while True:
        try:
            ctl.send(hello, zmq.NOBLOCK)
            break
        except zmq.Again:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ctl.poll(int(min(_SLICE_S, left) * 1000) + 1, zmq.POLLOUT)
    authenticated = secret is None
    while True:
        try:
            msg = control.recv(ctl, min(_SLICE_S, max(0.0, deadline - time.monotonic())))
        except ControlMessageError as e:
            raise ControlMessageError(
                f"the frontend at {address} broke the start-up protocol: {e}") from None
        if msg is None:
            if time.monotonic() >= deadline:
                return None
        elif isinstance(msg, control.Auth) and not authenticated:
            if len(msg.nonce) != auth.NONCE_BYTES or not auth.verify(
                    secret, b"frontend", nonce_e, msg.nonce, msg.proof):
                raise AuthenticationError(
                    f"the frontend at {address} could not prove it knows the shared secret: "
                    "it is not the frontend this engine was started for, or its "
                    f"{auth.SECRET_FILE_ENV} / {auth.SECRET_ENV} differs")
            authenticated = True
            control.send(ctl, control.Auth(proof=auth.proof(secret, b"engine", msg.nonce, nonce_e)))
        elif isinstance(msg, control.Start):
            if not authenticated:
                raise AuthenticationError(
                    f"the frontend at {address} sent Start without authenticating (it has "
                    f"no shared secret): give it the same {auth.SECRET_FILE_ENV} or "
                    f"{auth.SECRET_ENV} as this engine")
            return msg
        elif isinstance(msg, control.Shutdown):
            raise PeerDeadError(f"the frontend at {address} said Shutdown before Start")
        elif not isinstance(msg, control.Heartbeat):
            raise ControlMessageError.unexpected(msg, f"from the frontend at {address} before Start")
