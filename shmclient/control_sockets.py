"""Where the control plane's sockets live and how they are made: the private (0700) ipc
directory of a same-host engine (``IpcDir``: only this uid can connect; unlinked as soon as
the engine has connected), tcp addresses for an engine on another host (which connects
itself: ``python -m shmclient_engine --connect tcp://HOST:PORT``), and the PAIR sockets
of both ends. Middle layer: imports zmq and the standard library only; never messages,
channels, clients or an engine (what travels on these sockets is ``control``'s). Nothing
here blocks.
"""

from __future__ import annotations

import os
import secrets

import zmq

from .errors import ConfigError

#: The most bytes one frame of a control message may have: a larger frame makes zmq
#: drop the peer (``ZMQ_MAXMSGSIZE``), before anything of it is read. The limit is per
#: frame: a message of many frames is read whole, then refused (a control message is
#: one frame), so a peer that reaches a control port, before it authenticates too, can
#: make the process hold many such frames at once (zmq has no limit on a message's
#: frames): a reason to keep a remote engine's ports on a trusted network.
MAX_MESSAGE_BYTES = 1 << 20


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
        try:
            self.path = tempfile.mkdtemp(prefix=f"{_IPC_PREFIX}{os.getpid()}-", dir=base)
        except OSError as e:
            if not os.environ.get(IPC_DIR_ENV):
                raise
            raise ConfigError(f"{IPC_DIR_ENV}={base!r} cannot hold the control sockets' "
                              f"folder: {e.strerror or e}") from None
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
    host (``0.0.0.0``, ``*``, ``[::]``) is replaced by the host of ``via``, or by the
    loopback address when ``via`` is not tcp (a local engine's ipc control socket)."""
    scheme, _, rest = address.partition("://")
    if scheme != "tcp":
        return address
    host, _, port = rest.rpartition(":")
    if host in ("0.0.0.0", "*", "[::]"):
        via_scheme, _, via_rest = via.partition("://")
        if via_scheme == "tcp":
            host = via_rest.rpartition(":")[0]
        else:
            host = "[::1]" if host == "[::]" else "127.0.0.1"
    return f"tcp://{host}:{port}"


def frontend_socket(ctx: zmq.Context, address: str) -> zmq.Socket:
    """The frontend's control socket, bound on ``address`` (raises ``zmq.ZMQError`` when
    it cannot be bound, e.g. the port is taken). Never blocks."""
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    try:
        sock.bind(address)
    except BaseException:
        sock.close(linger=0)  # else the context's term() waits for it forever
        raise
    return sock


def engine_socket(ctx: zmq.Context, address: str) -> zmq.Socket:
    """The engine's control socket, connected to ``address`` (the connection is made in
    the background: a frontend that is not listening yet is retried). Never blocks."""
    sock = ctx.socket(zmq.PAIR)
    # The dead signal must get out before the process exits.
    sock.setsockopt(zmq.LINGER, 2000)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    sock.connect(address)
    return sock
