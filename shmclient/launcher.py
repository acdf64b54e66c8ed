"""Start, watch and stop one engine core; own everything an MP client holds
(``EngineResources``). Upper-middle layer: imports ``control``, ``control_sockets``,
``handshake`` (the start-up conversation), ``monitor`` (the thread that sees the engine's
death), ``engine_process`` (the OS process), channels, errors and zmq; never a client
class and never an engine (it runs as ``python -m <EngineConfig.engine_module>``). The
client registers ``weakref.finalize(client, resources.shutdown)``, as vLLM's
BackgroundResources, so a failure half-way through construction, ``shutdown()`` or plain
garbage collection all end the same way: engine stopped (``Shutdown``, then SIGTERM, then
SIGKILL), monitor thread joined, sockets closed before the ZMQ context terminates,
/dev/shm names removed. A remote engine (``EngineConfig.is_remote``) is not spawned: the
sockets are bound on tcp and it connects itself (docs/design.md, "The control plane").
"""

from __future__ import annotations

import itertools
import logging
import os
import subprocess
import threading
import weakref
from typing import TYPE_CHECKING, Any, Callable

import zmq

from . import auth, control, control_sockets, engine_process, forksafe
from .channel import ShmChannel
from .channel_zmq import ZmqChannel
from .errors import ConfigError, PeerNotProducingError
from .handshake import (DEFAULT_READY_TIMEOUT_S, READY_TIMEOUT_ENV, Handshake, connect_address, connect_hint,
                        ready_timeout_s)
from .monitor import REMOTE_LINGER_MS, EngineMonitor, send_shutdown

if TYPE_CHECKING:
    from .channel_spec import ShmChannelSpec
    from .channel_zmq import ZmqChannelSpec
    from .config import EngineConfig

__all__ = ["DEFAULT_READY_TIMEOUT_S", "EngineResources", "READY_TIMEOUT_ENV",
           "ready_timeout_s", "remote_control_port", "weak_callback"]

logger = logging.getLogger("shmclient")

#: What a caller of ``shutdown`` waits beyond its timeout for the stop to end (the
#: monitor's join, the reader's lock, SIGTERM, then SIGKILL 2 s later).
_STOP_GRACE_S = 10.0

def remote_control_port(config: EngineConfig) -> int:
    """The control port of a remote rank: ``data_parallel_rpc_port + rank - local``
    (the first remote rank on the port itself), or 0 (a free port) when the port is 0."""
    base = getattr(config, "data_parallel_rpc_port", 0)
    if not base:
        return 0
    return base + (config.data_parallel_rank or 0) - (config.data_parallel_size_local or 0)


def _ipc_bind_error(address: str, e: zmq.ZMQError) -> ConfigError:
    """The error for a local engine's control socket (ipc, in a private folder under
    ``SHMCLIENT_IPC_DIR`` or the temporary folder) that cannot be bound: it names where the
    folder is and, for a path too long for a unix socket, the limit (no setting of the
    config is involved, whatever zmq says)."""
    import tempfile

    env = control_sockets.IPC_DIR_ENV
    base = os.environ.get(env)
    where = f"{env}={base!r}" if base else f"the temporary folder {tempfile.gettempdir()!r} ({env} unset)"
    path = address.partition("://")[2]
    limit = getattr(zmq, "IPC_PATH_MAX_LEN", 107) or 107
    n = len(os.fsencode(path))
    if n > limit:
        why = (f"its path is {n} bytes long, more than a unix socket's limit of {limit}: set {env} "
               "to a folder with a shorter path")
    else:
        why = str(e)
    return ConfigError(f"cannot listen on the engine's control socket {address}, in a folder under "
                       f"{where}: {why}")


class EngineResources:
    """Everything one MP client owns. Holds no reference to the client itself."""

    def __init__(self) -> None:
        self.ctx: zmq.Context | None = None
        self.ctl: zmq.Socket | None = None
        self.channel: ShmChannel | ZmqChannel | None = None
        self.proc: subprocess.Popen | None = None
        #: The private directory of the ipc sockets until the engine has connected.
        self.ipc_dir: control_sockets.IpcDir | None = None
        self.monitor: EngineMonitor | None = None
        #: True when the engine is remote: not started here, reached over tcp.
        self.remote = False
        #: The control socket's address (tcp for a remote engine).
        self.control_address = ""
        self._heartbeat: control.HeartbeatClock | None = None
        #: The shared secret of a remote start-up (None: unauthenticated, opted in).
        self._secret: bytes | None = None
        self._rank = 0
        self.dead = threading.Event()
        self.dead_reason = ""
        #: Set with ``dead``: True when the client's shutdown marked it (no death).
        self.by_shutdown = False
        self._callbacks: list[_Once] = []
        #: The first ``mark_dead`` takes 0 (one C call: no thread, signal or garbage
        #: collection comes between the test and the take).
        self._death_claims = itertools.count()
        self._before_close: list[Callable[[], None]] = []
        self._close_lock: threading.Lock | None = None
        self._shutting_down = False
        #: The shutdown's work is claimed by one ``next`` (the first gets 0).
        self._stop_claims = itertools.count()
        self._stop_claimed = False
        self._stop_thread_started = False
        #: The thread doing the shutdown's work (its ident), and the timeout it runs
        #: with, once one claimed it.
        self._stop_worker: int | None = None
        self._stop_timeout: float | None = None
        self._hook_claims = itertools.count()
        self._shutdown_finished = threading.Event()
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        forksafe.register(self)

    def _forget_after_fork(self) -> None:
        """In a forked child: the engine is the parent's; shutdown() here does nothing.
        Takes no lock: one another thread of the parent held at the fork stays held in
        the child (the Event is replaced by a new one, set)."""
        self._shutting_down = True
        next(self._stop_claims)
        self._stop_claimed = True
        finished = threading.Event()  # (a lock of its own, which nobody holds)
        finished.set()
        self._shutdown_finished = finished
        self.proc = None

    # -- start ------------------------------------------------------------------------
    def start(self, config: EngineConfig, *, wake_fd: bool,
              abandon: threading.Event | None = None) -> control.Ready:
        """Create the channel, spawn the engine (or, for a remote rank, wait for one to
        connect) and wait for its ``Ready``. Raises ``ConfigError`` (``engine_module``
        cannot be run, an address that cannot be bound, or the engine's own
        ``ConfigError``) or what ``Handshake.run`` raises. On failure the caller must
        call ``shutdown()`` (the finalizer does)."""
        timeout = ready_timeout_s(config)
        self.remote = remote = bool(getattr(config, "is_remote", False))
        host = getattr(config, "data_parallel_address", None)
        if not remote:
            engine_process.find_engine_module(config.engine_module)
        else:
            self._secret = auth.require_secret("frontend")
        self.ctx = zmq.Context()
        # A local engine's data may go over tcp (zmq with data_parallel_address); its
        # control socket never does: it carries the config and is not authenticated.
        data_tcp = remote or (host is not None and config.transport == "zmq")
        spec: ShmChannelSpec | ZmqChannelSpec | None = None
        if config.transport == "shm" and not remote:
            # (first: its memfds have no name, and the folder below should live as
            # short a time as it can: a SIGKILL of both sides meanwhile leaves it)
            self.channel, spec = ShmChannel.create(
                ring_capacity=config.ring_capacity_bytes,
                arena_bytes=config.tensor_arena_bytes,
                spin_us=config.spin_us,
                wake_fd=wake_fd,
                enable_cuda_ipc=config.enable_cuda_ipc,
            )
        if not remote:
            # Only this uid may reach the sockets; removed once the engine is connected.
            self.ipc_dir = control_sockets.IpcDir()
        address = (control_sockets.tcp_address(host, remote_control_port(config))
                   if remote else self.ipc_dir.address("ctl"))
        try:
            self.ctl = control_sockets.frontend_socket(self.ctx, address)
        except zmq.ZMQError as e:
            if not remote:
                raise _ipc_bind_error(address, e) from e
            raise ConfigError(
                f"EngineConfig.data_parallel_address={host!r} / data_parallel_rpc_port="
                f"{getattr(config, 'data_parallel_rpc_port', 0)!r} is invalid: cannot listen "
                f"on {address}: {e}") from e
        if remote:
            address = control_sockets.bound_address(self.ctl)
        self.control_address = address
        only_control_in_folder = spec is not None  # (the rings have no name)
        if spec is None:
            if data_tcp:
                self.channel, spec = ZmqChannel.create(self.ctx, host=host)
            else:
                self.channel, spec = ZmqChannel.create(self.ctx, self.ipc_dir.address("data"))
        self._rank = rank = config.data_parallel_rank or 0
        if remote:
            port_given = getattr(config, "data_parallel_rpc_port", 0) != 0
            # (a wildcard bind address cannot be connected to: the command names this host)
            command_address = connect_address(address)
            logger.log(
                logging.INFO if port_given else logging.WARNING,
                "waiting up to %g s for the engine of data-parallel rank %d: start it with "
                "'python -m %s --connect %s'%s", timeout, rank, config.engine_module,
                command_address, connect_hint(address),
                extra={"shmclient_control_address": command_address, "data_parallel_rank": rank})
        else:
            fds = self.channel.handle_fds() if self.channel.handle_fds is not None else ()
            self.proc = engine_process.spawn(config.engine_module, address, fds, timeout)
        handshake = self._handshake(config, spec)
        if only_control_in_folder and self.ipc_dir is not None:
            # Only the control socket is in the folder, and the engine's Hello says it
            # is connected: the folder goes then, not after the model's load.
            handshake.on_hello = self.ipc_dir.remove
        info = handshake.run(timeout, abandon)
        channel = self.channel
        if channel.wait_registered is not None:
            # (registered before its Ready: only a death, a lost connection or a data
            # port it cannot reach holds it up) What is left of the start-up's timeout.
            handshake.watch_until(
                lambda slice_s: _registered(channel, slice_s), max(1.0, handshake.remaining()),
                f"the engine of data-parallel rank {rank} said it was ready but did not "
                f"connect to the request socket ({spec.input_address}; it and "
                f"{spec.output_address} must be reachable from the engine)", abandon)
        if channel.peer_attached is not None:
            channel.peer_attached()
        if self.ipc_dir is not None:
            self.ipc_dir.remove()  # the engine is connected: nothing else may connect
        if channel.set_peer_gpus is not None:
            channel.set_peer_gpus(info.gpu_uuids)
        if channel.set_peer_pid is not None and self.proc is not None:
            channel.set_peer_pid(self.proc.pid)
        self.monitor = EngineMonitor(
            self.ctl, self.proc, self._heartbeat, self._wake_r, pid=info.pid,
            address=self.control_address, rank=self._rank, dead=self.dead,
            mark_dead=self.mark_dead, expected_exit=lambda: self._shutting_down)
        self.monitor.start()
        return info

    def _handshake(self, config: EngineConfig, spec: ShmChannelSpec | ZmqChannelSpec) -> Handshake:
        assert self.ctl is not None and (self.proc is not None or self.remote)
        # A remote engine watches the frontend by its heartbeats from Start on (its
        # model may load for minutes); its own beats say it is still loading.
        self._heartbeat = (control.HeartbeatClock(config.heartbeat_interval_s,
                                                  config.heartbeat_timeout_s)
                           if self.remote else None)
        if self.remote:
            control.load_torch_before_heartbeats()
        return Handshake(self.ctl, config, spec, address=self.control_address, proc=self.proc,
                         secret=self._secret, clock=self._heartbeat)

    # -- death ------------------------------------------------------------------------
    def on_dead(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the engine is dead (``mark_dead``; in the thread that
        marks it, mostly the monitor's), at once in this thread when it is already:
        once either way."""
        once = _Once(callback)
        self._callbacks.append(once)
        if self.dead.is_set():
            once()  # (mark_dead, at the same moment, may call it too: it runs once)

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
        self.mark_dead("the client was shut down")

    def mark_dead(self, reason: str) -> None:
        """The engine is dead for ``reason`` (its monitor saw it, the client shuts down,
        or the client found its channel broken): set ``dead``, then call each ``on_dead``
        callback (outside the lock). Only the first call counts: the test and the set
        are one step under the lock, so two threads that see the death at once (the
        monitor and a reader finding the channel broken) call the callbacks once.
        ``by_shutdown`` says whether that first call came once shutdown had begun. No
        lock: a finalizer that the garbage collector runs here, in this thread (the
        client's shutdown), must not wait for one this call holds."""
        if next(self._death_claims):
            return
        self.dead_reason = reason
        self.by_shutdown = self._shutting_down
        self.dead.set()
        if not self.by_shutdown:
            logger.error("%s", reason)
        for cb in list(self._callbacks):
            try:
                cb()
            except Exception:  # pragma: no cover - a callback bug must not kill the monitor
                logger.exception("engine death callback failed")

    # -- stop -------------------------------------------------------------------------
    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop everything; idempotent, callable from any thread and from a finalizer.
        Waits up to ``timeout`` for a clean exit, then SIGTERM, then SIGKILL. The work
        runs once, in a thread of its own (``shmclient-shutdown``) that the caller waits
        for: interrupted (Ctrl-C), the stop goes on and a later call waits for it, as a
        second caller waits for the first (and the interpreter's exit waits for it).
        A call interrupted while it starts that thread (which may or may not have
        started) leaves it to the next call to start another; whichever thread comes
        first does the work. Inline where no thread can start (Python 3.12.0/1 at
        interpreter shutdown)."""
        if self._shutdown_finished.is_set():
            return
        with self._lock:
            self._shutting_down = True
            start = not self._stop_thread_started and not self._stop_claimed
        if self._stop_worker == threading.get_ident():
            return  # (from inside the work: a finalizer the garbage collector ran there)
        on_monitor = threading.current_thread() is self.monitor
        # The hooks (they never block) run here, in the caller's thread: on an event
        # loop's thread, stopping its watch of the channel is done at once, where the
        # worker could only queue it to a loop that waits below while the descriptor is
        # closed and its number reused.
        self._run_hooks()
        if start:
            try:
                threading.Thread(
                    target=self._claim_shutdown, args=(timeout,), name="shmclient-shutdown"
                ).start()
            except RuntimeError:  # "can't create new thread at interpreter shutdown"
                if not on_monitor:  # (the monitor cannot join itself)
                    self._claim_shutdown(timeout)
                return
            self._stop_thread_started = True
        if not on_monitor:
            # (On the monitor, the last reference went away inside a death callback: it
            # must not wait for the work that joins it.) A shorter timeout than the one
            # the work runs with (a retry with 0 after Ctrl-C) waits for that one.
            if not self._shutdown_finished.wait(timeout + _STOP_GRACE_S):
                longer = self._stop_timeout
                if longer is not None and longer > timeout:
                    self._shutdown_finished.wait(longer - timeout)

    def _claim_shutdown(self, timeout: float) -> None:
        """Do the shutdown's work if no other thread has claimed it."""
        if next(self._stop_claims):
            return
        self._stop_worker = threading.get_ident()
        self._stop_timeout = timeout
        self._stop_claimed = True
        self._shutdown(timeout)

    def _run_hooks(self) -> None:
        """The ``before_close`` hooks, once, whoever calls first."""
        if next(self._hook_claims):
            return
        for hook in self._before_close:
            try:
                hook()
            except Exception:  # pragma: no cover
                logger.exception("shutdown hook failed")

    @property
    def shut_down(self) -> bool:
        """True once shutdown's work is over."""
        return self._shutdown_finished.is_set()

    def guard_close(self, lock: threading.Lock) -> None:
        """Hold ``lock`` (the lock of whoever reads the channel) from before the channel
        is closed to the end of shutdown, so no reader is inside it when it closes:
        wait up to 2 s for it (readers look at ``dead`` at least every 0.1 s)."""
        self._close_lock = lock

    def _shutdown(self, timeout: float) -> None:
        held = None
        try:
            self._run_hooks()  # (run already by shutdown(), in its caller's thread)
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
            lock = self._close_lock
            if lock is not None and lock.acquire(timeout=2.0):
                held = lock
            if self.channel is not None:
                try:
                    self.channel.close()
                except Exception:  # the engine is stopped and the rest freed all the same
                    logger.exception("closing the channel to the engine failed")
            if self.proc is not None:
                engine_process.stop(self.proc, timeout)
            if mon is None and self.ctl is not None:
                if self.remote and self._heartbeat is not None:
                    # Failed after the handshake began: tell the engine (it would
                    # otherwise stop on the missing heartbeats).
                    send_shutdown(self.ctl)
                    self.ctl.close(linger=REMOTE_LINGER_MS)
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
            if held is not None:
                held.release()
            self._shutdown_finished.set()


class _Once:
    """A death callback that runs once, whoever calls it (``on_dead`` and ``mark_dead``
    may both, at the same moment)."""

    __slots__ = ("fn", "_claims")

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn
        self._claims = itertools.count()

    def __call__(self) -> None:
        if next(self._claims) == 0:
            self.fn()


def weak_callback(method: Callable[[], None]) -> Callable[[], None]:
    """Wrap a bound method so the resources never keep its object alive."""
    ref = weakref.WeakMethod(method)  # type: ignore[arg-type]

    def call() -> None:
        m = ref()
        if m is not None:
            m()

    return call


def _registered(channel: Any, slice_s: float) -> bool:
    """Whether the engine's registration came within ``slice_s`` seconds."""
    try:
        channel.wait_registered(timeout=slice_s)
        return True
    except PeerNotProducingError:
        return False
