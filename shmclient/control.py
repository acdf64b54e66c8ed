"""The ZMQ control plane: ready handshake, ENGINE_CORE_DEAD and shutdown.

Middle layer: imports zmq, msgspec, messages and errors; never clients or the engine.
Control traffic is rare, so ZMQ's ~80 µs per message does not matter here; all data
(requests, outputs, utility calls) goes over the channel so that its order with respect
to adds and aborts is the ring's order.

One PAIR socket per engine, bound by the frontend on a unix socket in a private (0700)
directory (``IpcDir``: only this uid can connect; unlinked as soon as the engine has
connected, so nothing is left in the file system once it has started), or on tcp (``tcp_address``) for an engine on another host, which connects to it itself
(``python -m shmclient_engine --connect tcp://HOST:PORT``). Every message is one
multipart message whose first frame is its kind:

    engine → frontend   HELLO <pid> [<nonce>]  the engine process is up
    frontend → engine   AUTH <nonce> <proof>   remote only (shmclient.auth): the
    engine → frontend   AUTH <proof>           challenge-response, before START
    frontend → engine   START <config> <transport> <channel spec> <frontend GPU UUIDs>
    engine → frontend   READY <ReadyInfo>      channel attached, core built
    engine → frontend   ENGINE_CORE_DEAD <error text>   (one frame kind, flushed before exit)
    frontend → engine   SHUTDOWN
    both ways           HEARTBEAT              remote engines only, after READY

A remote engine has no pid the frontend can watch and no parent it can poll, so both
sides send HEARTBEAT every ``EngineConfig.heartbeat_interval_s`` and take the peer for
dead after ``heartbeat_timeout_s`` of silence (any message counts; ``Heartbeat`` keeps
the clock).
"""

from __future__ import annotations

import os
import secrets
import time

import msgspec
import zmq

HELLO = b"HELLO"
START = b"START"
READY = b"READY"
ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"
SHUTDOWN = b"SHUTDOWN"
HEARTBEAT = b"HEARTBEAT"
#: Remote start-up only: the challenge-response of ``shmclient.auth``, before START.
AUTH = b"AUTH"


class ReadyInfo(msgspec.Struct, frozen=True):
    """What the engine reports once it can serve: its real capacity and its pid."""

    pid: int
    num_gpu_blocks: int
    block_size: int
    max_model_len: int
    protocol_version: int
    #: GPUs the engine sees (UUIDs), so the frontend knows where CUDA IPC can go.
    gpu_uuids: list[str] = []


def make_address(tag: str = "ctl") -> str:
    """A fresh abstract-namespace ipc address (Linux): nothing to unlink afterwards, but
    any process of any uid may connect to it: the clients use ``IpcDir`` instead."""
    return f"ipc://@shmc-{os.getpid()}-{secrets.token_hex(8)}-{tag}"


#: Env variable: the directory the private ipc directories are made in (default: the
#: system's temporary directory).
IPC_DIR_ENV = "SHMCLIENT_IPC_DIR"
_IPC_PREFIX = "shmc-ipc-"


class IpcDir:
    """A private (0700) directory for the ipc sockets of one client's engine start-up:
    only processes of this uid (and root) can connect to a socket in it, where any uid
    could reach an abstract socket. ``remove()`` unlinks the sockets and the directory
    (the frontend calls it as soon as the engine has connected: connections already made
    stay up). The name carries the creator's pid, and a new ``IpcDir`` removes the
    directories of creators that are gone (killed between start and connect), so
    nothing is left behind for long. Never blocks."""

    def __init__(self) -> None:
        import tempfile

        base = os.environ.get(IPC_DIR_ENV) or tempfile.gettempdir()
        _sweep(base)
        self.path = tempfile.mkdtemp(prefix=f"{_IPC_PREFIX}{os.getpid()}-", dir=base)
        os.chmod(self.path, 0o700)
        self._names: list[str] = []

    def address(self, tag: str) -> str:
        """``ipc://<dir>/<tag>`` (a zmq ipc address; the socket is made when bound)."""
        self._names.append(tag)
        return f"ipc://{self.path}/{tag}"

    def remove(self) -> None:
        """Unlink every socket in the directory and the directory (idempotent)."""
        path, self.path = self.path, ""
        if not path:
            return
        _remove_dir(path)


def remove_orphaned_dir(address: str, creator_pid: int) -> bool:
    """For an engine whose frontend (``creator_pid``) is gone: remove the private ipc
    directory of ``address`` if it is that frontend's (its name carries the pid), so that
    a frontend killed before it could remove it leaves nothing. True if removed."""
    path = os.path.dirname(address[len("ipc://"):]) if address.startswith("ipc://") else ""
    if not os.path.basename(path).startswith(f"{_IPC_PREFIX}{creator_pid}-"):
        return False
    if os.path.exists(f"/proc/{creator_pid}"):
        return False
    _remove_dir(path)
    return True


def _remove_dir(path: str) -> None:
    try:
        names = os.listdir(path)
    except OSError:
        return
    for name in names:
        try:
            os.unlink(os.path.join(path, name))
        except OSError:
            pass
    try:
        os.rmdir(path)
    except OSError:
        pass


def _sweep(base: str) -> None:
    """Remove private ipc directories of this uid whose creator process is gone."""
    try:
        names = os.listdir(base)
    except OSError:
        return
    me = os.getuid()
    for name in names:
        if not name.startswith(_IPC_PREFIX):
            continue
        pid = name[len(_IPC_PREFIX):].partition("-")[0]
        path = os.path.join(base, name)
        try:
            if not pid.isdigit() or os.stat(path).st_uid != me or os.path.exists(f"/proc/{pid}"):
                continue
        except OSError:
            continue
        _remove_dir(path)


def tcp_address(host: str, port: int = 0) -> str:
    """``tcp://host:port`` to bind (``*`` and ``0.0.0.0`` are every interface; port 0: a
    free port, read back with ``bound_address``)."""
    return f"tcp://{host}:{port}"


def bound_address(sock: zmq.Socket) -> str:
    """The address a socket is bound on, with the port the OS picked."""
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def reachable(address: str, via: str) -> str:
    """``address`` as a peer that reached us at ``via`` can connect to it: a wildcard
    host (``0.0.0.0``, ``*``, ``[::]``) is replaced by the host of ``via``."""
    scheme, _, rest = address.partition("://")
    if scheme != "tcp":
        return address
    host, _, port = rest.rpartition(":")
    if host in ("0.0.0.0", "*", "[::]"):
        host = via.partition("://")[2].rpartition(":")[0]
    return f"tcp://{host}:{port}"


def frontend_socket(ctx: zmq.Context, address: str) -> zmq.Socket:
    """The frontend's control socket, bound on ``address`` (raises ``zmq.ZMQError`` when
    it cannot be bound, e.g. the port is taken). Never blocks."""
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.bind(address)
    except BaseException:
        sock.close(linger=0)  # else the context's term() waits for it forever
        raise
    return sock


def engine_socket(ctx: zmq.Context, address: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PAIR)
    # The dead signal must get out before the process exits.
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(address)
    return sock


def recv(sock: zmq.Socket, timeout_s: float) -> list[bytes] | None:
    """One control message, or None if none arrives within ``timeout_s``."""
    if sock.poll(max(0, int(timeout_s * 1000)), zmq.POLLIN):
        return sock.recv_multipart()
    return None


class Heartbeat:
    """The clock of one side's heartbeats: when to send the next, and whether the peer
    has been silent too long. Not thread-safe (the one thread that owns the control
    socket uses it); never blocks."""

    def __init__(self, interval_s: float, timeout_s: float) -> None:
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        now = time.monotonic()
        self._last_rx = now
        self._next_tx = now

    def heard(self) -> None:
        """A message came from the peer."""
        self._last_rx = time.monotonic()

    def silence_s(self) -> float:
        return time.monotonic() - self._last_rx

    def expired(self) -> bool:
        """The peer has been silent for longer than the timeout."""
        return self.silence_s() > self.timeout_s

    def beat(self, sock: zmq.Socket) -> None:
        """Send HEARTBEAT if one is due (never blocks: dropped when the socket cannot
        take it, e.g. no peer connected)."""
        now = time.monotonic()
        if now < self._next_tx:
            return
        self._next_tx = now + self.interval_s
        try:
            sock.send(HEARTBEAT, zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def poll_s(self) -> float:
        """How long the owner may wait before the next beat is due or the peer's
        silence runs out, whichever comes first."""
        now = time.monotonic()
        return max(0.0, min(self._next_tx - now, self._last_rx + self.timeout_s - now,
                            self.interval_s))
