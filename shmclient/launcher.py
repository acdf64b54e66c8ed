"""Start, watch and stop the engine core process; own everything a client holds.

Upper-middle layer: imports control, channel, shm, errors, zmq; not the client classes and
never an engine: the engine runs as ``python -m <EngineConfig.engine_module>`` (the
project's ``shmclient_engine`` by default) in a fresh interpreter, which is what CUDA needs:
no fork. The module is looked up, not imported, before the launch (``find_engine_module``);
the engine process finds it on its own path: the working directory, ``PYTHONPATH`` (this
project's root is put first) and the installed packages. ``EngineResources`` is the
finalizer-owned bag, as vLLM's
BackgroundResources: the client registers ``weakref.finalize(client, resources.shutdown)``,
so a failure half-way through construction, ``shutdown()`` or plain garbage collection all
end the same way: engine stopped (SHUTDOWN, then SIGTERM, then SIGKILL), monitor thread
joined, sockets closed before the ZMQ context terminates, /dev/shm names removed.

Engine death is detected from the OS, not from timeouts: the monitor thread polls the
control socket (ENGINE_CORE_DEAD) and a pidfd of the engine process (exit), and calls the
registered death callbacks at once.

A remote engine (``EngineConfig.is_remote``: a data-parallel rank beyond
``data_parallel_size_local``) is not spawned: the control and data sockets are bound on
tcp (``data_parallel_address``; the control port from ``data_parallel_rpc_port``, data
ports free and sent in START) and the frontend waits, up to the ready timeout, for an
engine started apart (``python -m shmclient_engine --connect tcp://HOST:PORT``) to say
HELLO. There is no pid to watch across hosts: from START on both sides send heartbeats on
the control socket and the monitor marks the engine dead after ``heartbeat_timeout_s``
of silence. It is stopped by SHUTDOWN on the control socket only (no signals to another
host); if that is lost, the engine stops on the frontend's missing heartbeats.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from typing import Any, Callable, NoReturn

import msgspec
import zmq

from . import auth, control, forksafe
from .errors import AuthenticationError, ConfigError
from .channel import ShmChannel
from .channel_zmq import ZmqChannel
from .messages import PROTOCOL_VERSION
from .tensors_cuda import local_gpu_uuids

logger = logging.getLogger("shmclient")

READY_TIMEOUT_ENV = "SHMCLIENT_ENGINE_READY_TIMEOUT_S"
DEFAULT_READY_TIMEOUT_S = 600.0
_POLL_S = 0.1
#: How long closing a remote engine's control socket may take to get SHUTDOWN out.
_REMOTE_LINGER_MS = 500


def remote_control_port(config: Any) -> int:
    """The control port of a remote rank: ``data_parallel_rpc_port + rank - local``
    (the first remote rank on the port itself), or 0 (a free port) when the port is 0."""
    base = getattr(config, "data_parallel_rpc_port", 0)
    if not base:
        return 0
    return base + (config.data_parallel_rank or 0) - (config.data_parallel_size_local or 0)


def ready_timeout_s(config: Any) -> float:
    """The ready timeout: EngineConfig.engine_ready_timeout_s, else the env variable."""
    value = getattr(config, "engine_ready_timeout_s", None)
    if value is not None:
        return float(value)
    raw = os.environ.get(READY_TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_READY_TIMEOUT_S
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{READY_TIMEOUT_ENV} must be a number of seconds, got {raw!r}") from None


def find_engine_module(name: str) -> None:
    """Check that ``python -m <name>`` can run: ``name`` is found on this interpreter's
    path and, for a package, has a ``__main__``. Never imports ``name`` itself (its parent
    packages are imported, as any lookup of a dotted name does), never blocks. Raises
    ``ConfigError`` naming ``EngineConfig.engine_module`` otherwise."""
    import importlib.machinery
    import importlib.util

    def fail(why: str) -> NoReturn:
        raise ConfigError(f"EngineConfig.engine_module={name!r} is invalid: {why}")

    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError) as e:
        fail(f"cannot look it up: {type(e).__name__}: {e}")
    if spec is None:
        fail("no module of that name is importable here")
    if spec.submodule_search_locations is not None and importlib.machinery.PathFinder.find_spec(
            "__main__", list(spec.submodule_search_locations)) is None:
        fail("it is a package without a __main__ module, so 'python -m' cannot run it as "
             "the engine process")


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


class EngineResources:
    """Everything one MP client owns. Holds no reference to the client itself."""

    def __init__(self) -> None:
        self.ctx: zmq.Context | None = None
        self.ctl: zmq.Socket | None = None
        self.channel: ShmChannel | ZmqChannel | None = None
        self.proc: subprocess.Popen | None = None
        #: The private directory of the ipc sockets until the engine has connected.
        self.ipc_dir: control.IpcDir | None = None
        self.monitor: threading.Thread | None = None
        #: True when the engine is remote: not started here, reached over tcp.
        self.remote = False
        #: The control socket's address (tcp for a remote engine).
        self.control_address = ""
        self._heartbeat: control.Heartbeat | None = None
        #: The shared secret of a remote start-up (None: unauthenticated, opted in).
        self._secret: bytes | None = None
        self._rank = 0
        self.dead = threading.Event()
        self.dead_reason = ""
        self._callbacks: list[Callable[[], None]] = []
        self._before_close: list[Callable[[], None]] = []
        self._shutting_down = False
        self._shutdown_started = False
        self._shutdown_finished = threading.Event()
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        forksafe.register(self)

    def _forget_after_fork(self) -> None:
        """In a forked child: the engine is the parent's; shutdown() here does nothing."""
        self._shutdown_started = self._shutting_down = True
        self._shutdown_finished.set()
        self.proc = None

    # -- start ------------------------------------------------------------------------
    def start(self, config: Any, *, wake_fd: bool) -> control.ReadyInfo:
        """Create the channel, spawn the engine (or, for a remote rank, wait for one to
        connect) and wait for READY. Raises ConfigError (``engine_module`` cannot be
        run, or exits before its first handshake message; an address that cannot be
        bound), TimeoutError (ready timeout) or RuntimeError (engine died during
        start-up). On failure the caller must call ``shutdown()`` (the finalizer does)."""
        timeout = ready_timeout_s(config)
        self.remote = remote = bool(getattr(config, "is_remote", False))
        host = getattr(config, "data_parallel_address", None)
        if not remote:
            find_engine_module(config.engine_module)
        else:
            self._secret = auth.require_secret("frontend")
        self.ctx = zmq.Context()
        tcp = remote or (host is not None and config.transport == "zmq")
        if not tcp:
            # Only this uid may reach the sockets; removed once the engine is connected.
            self.ipc_dir = control.IpcDir()
        address = (control.tcp_address(host, remote_control_port(config) if remote else 0)
                   if tcp else self.ipc_dir.address("ctl"))
        try:
            self.ctl = control.frontend_socket(self.ctx, address)
        except zmq.ZMQError as e:
            raise ConfigError(
                f"EngineConfig.data_parallel_address={host!r} / data_parallel_rpc_port="
                f"{getattr(config, 'data_parallel_rpc_port', 0)!r} is invalid: cannot listen "
                f"on {address}: {e}") from e
        if tcp:
            address = control.bound_address(self.ctl)
        self.control_address = address
        if config.transport == "shm" and not remote:
            self.channel, spec = ShmChannel.create(
                ring_capacity=config.ring_capacity_bytes,
                arena_bytes=config.tensor_arena_bytes,
                spin_us=config.spin_us,
                wake_fd=wake_fd,
                enable_cuda_ipc=config.enable_cuda_ipc,
            )
        elif tcp:
            self.channel, spec = ZmqChannel.create(self.ctx, host=host)
        else:
            self.channel, spec = ZmqChannel.create(self.ctx, self.ipc_dir.address("data"))
        self._rank = rank = config.data_parallel_rank or 0
        if remote:
            port_given = getattr(config, "data_parallel_rpc_port", 0) != 0
            logger.log(
                logging.INFO if port_given else logging.WARNING,
                "waiting up to %g s for the engine of data-parallel rank %d: start it with "
                "'python -m %s --connect %s'", timeout, rank, config.engine_module,
                address, extra={"shmclient_control_address": address,
                                "data_parallel_rank": rank})
        else:
            env = dict(os.environ)
            root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
            # The engine inherits the segments' and the wake pipe's fds (same numbers), so
            # it attaches without going through /proc/<pid>/fd.
            fds = self.channel.handle_fds() if self.channel.handle_fds is not None else ()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", config.engine_module, address, str(os.getpid())],
                env=env,
                stdin=subprocess.DEVNULL,
                pass_fds=fds,
            )
        info = self._handshake(config, spec, timeout)
        channel = self.channel
        if channel.wait_registered is not None:
            channel.wait_registered(timeout=max(1.0, timeout))
        if channel.peer_attached is not None:
            channel.peer_attached()
        if self.ipc_dir is not None:
            self.ipc_dir.remove()  # the engine is connected: nothing else may connect
        if channel.set_peer_gpus is not None:
            channel.set_peer_gpus(info.gpu_uuids)
        if channel.set_peer_pid is not None and self.proc is not None:
            channel.set_peer_pid(self.proc.pid)
        self.monitor = threading.Thread(
            target=self._monitor_loop, name=f"shmclient-monitor-{info.pid}", daemon=True
        )
        self.monitor.start()
        return info

    def _send_start(self, config: Any, spec: Any) -> None:
        self.ctl.send_multipart(
            [
                control.START,
                msgspec.msgpack.encode(config),
                config.transport.encode(),
                msgspec.msgpack.encode(spec),
                msgspec.msgpack.encode(local_gpu_uuids()),
            ]
        )

    def _handshake(self, config: Any, spec: Any, timeout: float) -> control.ReadyInfo:
        assert self.ctl is not None and (self.proc is not None or self.remote)
        deadline = time.monotonic() + timeout
        hello = False
        challenge: tuple[bytes, bytes] | None = None
        started = False
        # A remote engine watches the frontend by its heartbeats from START on (its
        # model may load for minutes); its own beats say it is still loading.
        hb = self._heartbeat = (control.Heartbeat(config.heartbeat_interval_s,
                                                  config.heartbeat_timeout_s)
                                if self.remote else None)
        while True:
            wait = max(0.0, deadline - time.monotonic())
            if hb is not None and hello:
                hb.beat(self.ctl)
                if hb.expired():
                    raise RuntimeError(
                        f"Engine core initialization failed: the remote engine at "
                        f"{self.control_address} sent nothing for {hb.silence_s():.1f} s "
                        f"(heartbeat_interval_s={config.heartbeat_interval_s:g} x "
                        f"heartbeat_misses={config.heartbeat_misses}) while starting: it "
                        "died or the network is down. See its output for the root cause.")
                wait = min(wait, hb.poll_s())
            msg = control.recv(self.ctl, min(_POLL_S, wait))
            if msg is None:
                rc = self.proc.poll() if self.proc is not None else None
                if rc is not None and rc >= 0 and not hello:
                    # It ran and ended without a word of the handshake: not an engine
                    # (no such module there, or one that does not speak the protocol).
                    raise ConfigError(
                        f"EngineConfig.engine_module={config.engine_module!r} is invalid: "
                        f"'python -m {config.engine_module}' (pid {self.proc.pid}) "
                        f"exited ({describe_exit(rc)}) without starting the engine "
                        "handshake. See its output above for the root cause.")
                if rc is not None:
                    raise RuntimeError(
                        f"Engine core initialization failed: the engine process "
                        f"{self.proc.pid} (python -m {config.engine_module}) exited before "
                        f"it was ready ({describe_exit(rc)}). See its output above for the "
                        "root cause."
                    )
                if time.monotonic() >= deadline:
                    if self.remote and not hello:
                        raise TimeoutError(
                            f"Timed out waiting for the remote engine of data-parallel rank "
                            f"{config.data_parallel_rank or 0}: nothing connected to "
                            f"{self.control_address} within {timeout:g} s. Start it with "
                            f"'python -m {config.engine_module} --connect "
                            f"{self.control_address}', or wait longer: set "
                            f"{READY_TIMEOUT_ENV} or EngineConfig.engine_ready_timeout_s.")
                    raise TimeoutError(
                        "Timed out waiting for engine core processes to start. This is "
                        "often caused by slow weight loading for large models. Waited "
                        f"{timeout:g} s; set {READY_TIMEOUT_ENV} (now "
                        f"{os.environ.get(READY_TIMEOUT_ENV, 'unset')}) or "
                        "EngineConfig.engine_ready_timeout_s to wait longer."
                    )
                continue
            if hb is not None:
                hb.heard()
            kind = msg[0]
            if kind == control.HELLO and not hello:
                hello = True
                if self.remote and self._secret is not None:
                    # Nothing about this client crosses before the engine has proved it
                    # knows the secret (auth's challenge-response).
                    nonce_e = msg[2] if len(msg) > 2 else b""
                    if len(nonce_e) != auth.NONCE_BYTES:
                        raise AuthenticationError(
                            f"the remote engine at {self.control_address} offered no "
                            "authentication (it has no shared secret): start it with the "
                            f"same {auth.SECRET_FILE_ENV} or {auth.SECRET_ENV} as this "
                            "frontend")
                    nonce_f = auth.nonce()
                    challenge = (nonce_e, nonce_f)
                    self.ctl.send_multipart(
                        [control.AUTH, nonce_f, auth.proof(self._secret, b"frontend", nonce_e, nonce_f)])
                    continue
                self._send_start(config, spec)
                started = True
            elif kind == control.AUTH and challenge is not None:
                nonce_e, nonce_f = challenge
                challenge = None
                if len(msg) != 2 or not auth.verify(self._secret, b"engine", nonce_f, nonce_e, msg[1]):
                    raise AuthenticationError(
                        f"the remote engine at {self.control_address} could not prove it knows "
                        "the shared secret: it is not this frontend's engine, or its "
                        f"{auth.SECRET_FILE_ENV} / {auth.SECRET_ENV} differs")
                self._send_start(config, spec)
                started = True
            elif kind == control.READY and not started:
                raise AuthenticationError(
                    f"the engine at {self.control_address} said READY before it was sent "
                    "START: it does not follow the start-up protocol")
            elif kind == control.READY:
                info = msgspec.msgpack.decode(msg[1], type=control.ReadyInfo)
                if info.protocol_version != PROTOCOL_VERSION:
                    raise RuntimeError(
                        f"engine speaks protocol {info.protocol_version}, this client "
                        f"{PROTOCOL_VERSION}: install the same shmclient version on both"
                    )
                return info
            elif kind == control.ENGINE_CORE_DEAD:
                text = msg[1].decode(errors="replace") if len(msg) > 1 else ""
                if text.startswith("AuthenticationError: "):
                    raise AuthenticationError(
                        f"the remote engine at {self.control_address} refused this "
                        f"frontend: {text[len('AuthenticationError: '):]}")
                raise RuntimeError(f"Engine core initialization failed: {text}")

    # -- death ------------------------------------------------------------------------
    def on_dead(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (from the monitor thread) once the engine is dead."""
        self._callbacks.append(callback)
        if self.dead.is_set():
            callback()

    def before_close(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` at the start of shutdown, before the channel is closed."""
        self._before_close.append(hook)

    def alive(self) -> bool:
        """Liveness check handed to every blocking wait on the channel."""
        return not self.dead.is_set()

    def begin_shutdown(self) -> None:
        """From here on an engine exit is expected: waiters and pending calls get
        EngineDeadError("the client was shut down") now, before anything is closed."""
        self._shutting_down = True
        self._mark_dead("the client was shut down")

    def _mark_dead(self, reason: str) -> None:
        if self.dead.is_set():
            return
        self.dead_reason = reason
        self.dead.set()
        if not self._shutting_down:
            logger.error("%s", reason)
        for cb in list(self._callbacks):
            try:
                cb()
            except Exception:  # pragma: no cover - a callback bug must not kill the monitor
                logger.exception("engine death callback failed")

    def _monitor_loop(self) -> None:
        assert self.ctl is not None and (self.proc is not None or self.remote)
        poller = zmq.Poller()
        poller.register(self.ctl, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        pidfd: int | None = None
        if self.proc is not None:
            try:
                pidfd = os.pidfd_open(self.proc.pid)
                poller.register(pidfd, zmq.POLLIN)
            except (AttributeError, OSError):  # pragma: no cover - old kernels
                pidfd = None
        hb = self._heartbeat
        try:
            while True:
                if hb is not None:
                    wait: float | None = hb.poll_s() * 1000
                else:
                    wait = None if pidfd is not None else _POLL_S * 1000
                events = dict(poller.poll(wait))
                if self.ctl in events:
                    while self.ctl.poll(0, zmq.POLLIN):
                        msg = self.ctl.recv_multipart()
                        if hb is not None:
                            hb.heard()
                        if msg[0] == control.ENGINE_CORE_DEAD:
                            text = msg[1].decode(errors="replace") if len(msg) > 1 else ""
                            self._mark_dead(f"Engine core process reported a fatal error: {text}")
                if self._wake_r in events:
                    if self.proc is None or self.proc.poll() is None:
                        try:
                            self.ctl.send_multipart([control.SHUTDOWN], zmq.NOBLOCK)
                        except zmq.ZMQError:
                            pass
                    return
                if hb is not None:
                    if self.dead.is_set():
                        return  # it reported its death; it is gone
                    hb.beat(self.ctl)
                    if hb.expired():
                        self._mark_dead(
                            f"Remote engine core of data-parallel rank {self._rank} at "
                            f"{self.control_address} sent no heartbeat for "
                            f"{hb.silence_s():.1f} s: it died, or the network to it is down.")
                        return
                elif (pidfd is not None and pidfd in events) or self.proc.poll() is not None:
                    rc = self.proc.wait()
                    if not self._shutting_down:
                        self._mark_dead(
                            f"Engine core process {self.proc.pid} died unexpectedly "
                            f"({describe_exit(rc)})."
                        )
                    return
        finally:
            if pidfd is not None:
                os.close(pidfd)
            # Over tcp the SHUTDOWN needs a moment to leave (ctx.term() waits for it); a
            # remote engine that does not get it stops on the missing heartbeats.
            self.ctl.close(linger=_REMOTE_LINGER_MS if hb is not None else 0)

    # -- stop -------------------------------------------------------------------------
    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop everything; idempotent, callable from any thread and from a finalizer.
        Waits up to ``timeout`` for a clean exit, then SIGTERM, then SIGKILL. A second
        caller waits until the first has finished."""
        with self._lock:
            if self._shutdown_started:
                first = False
            else:
                self._shutdown_started = first = True
                self._shutting_down = True
        if not first:
            if threading.current_thread() is not self.monitor:
                self._shutdown_finished.wait(timeout + 10.0)
            return
        if threading.current_thread() is self.monitor:
            # The last reference went away inside a death callback: the monitor cannot
            # join itself or close its own socket under its feet; hand the work over.
            threading.Thread(
                target=self._shutdown, args=(timeout,), name="shmclient-shutdown"
            ).start()
            return
        self._shutdown(timeout)

    def _shutdown(self, timeout: float) -> None:
        try:
            for hook in self._before_close:
                try:
                    hook()
                except Exception:  # pragma: no cover
                    logger.exception("shutdown hook failed")
            # Waiters and pending calls learn of it first (EngineDeadError), before the
            # channel they may be blocked on goes away.
            self.begin_shutdown()
            try:
                os.write(self._wake_w, b"x")
            except OSError:
                pass
            mon = self.monitor
            if mon is not None:
                mon.join(timeout=2.0)
            if self.channel is not None:
                self.channel.close()
            if self.proc is not None:
                self._stop_process(self.proc, timeout)
            if mon is None and self.ctl is not None:
                if self.remote and self._heartbeat is not None:
                    # Failed after the handshake began: tell the engine (it would
                    # otherwise stop on the missing heartbeats).
                    try:
                        self.ctl.send_multipart([control.SHUTDOWN], zmq.NOBLOCK)
                    except zmq.ZMQError:
                        pass
                    self.ctl.close(linger=_REMOTE_LINGER_MS)
                else:
                    self.ctl.close(linger=0)
            if self.ipc_dir is not None:
                self.ipc_dir.remove()
            if self.ctx is not None:
                if mon is not None and mon.is_alive():  # pragma: no cover - monitor stuck
                    self.ctx.destroy(linger=0)
                else:
                    self.ctx.term()
            for fd in (self._wake_r, self._wake_w):
                try:
                    os.close(fd)
                except OSError:
                    pass
        finally:
            self._shutdown_finished.set()

    @staticmethod
    def _stop_process(proc: subprocess.Popen, timeout: float) -> None:
        try:
            proc.wait(timeout=timeout)
            return
        except subprocess.TimeoutExpired:
            if timeout > 0:  # at 0 the caller asked for the SIGTERM: nothing to warn of
                logger.warning("engine process %d did not exit in %.1f s: SIGTERM",
                               proc.pid, timeout)
        proc.terminate()
        try:
            proc.wait(timeout=2.0)
            return
        except subprocess.TimeoutExpired:
            logger.warning("engine process %d ignored SIGTERM: SIGKILL", proc.pid)
        proc.kill()
        proc.wait()


def weak_callback(method: Callable[[], None]) -> Callable[[], None]:
    """Wrap a bound method so the resources never keep its object alive."""
    ref = weakref.WeakMethod(method)  # type: ignore[arg-type]

    def call() -> None:
        m = ref()
        if m is not None:
            m()

    return call
