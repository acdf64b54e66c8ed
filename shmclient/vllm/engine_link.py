"""The engine core's ends of its channels: one per frontend (API server) it serves.

Imports ``shmclient.channel``, ``shmclient.shm``, ``shmclient.waiting`` and the plug-in's
``wire`` and ``link`` (its notice to a launcher); vLLM only for its serializers (through
``wire``). ``_links`` attaches, once per process, to the channels the environment names
for this engine (``SHMCLIENT_VLLM_SPEC``), in client-index order, and closes the handles
of every other channel a forked engine inherited. ``_EngineLink`` is one of them: a send
never waits for the frontend; what its full ring cannot take now is kept, in order, and
written by the link's flusher thread as the frontend makes room (vLLM's PUSH sockets
queue the same way), so an API server that stops reading holds back neither the busy
loop nor the other API servers' outputs. The frontend is this process's parent when it
started the engine, or, when a launcher (``vllm serve`` with several API servers) did,
the process its HELLO names, watched with a pidfd.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
import time
from collections import deque
from typing import Any

import msgspec

from .. import waiting
from ..channel import ShmChannel
from ..errors import ClientClosedError, PeerDeadError, ProtocolError, WouldBlock
from ..shm import Segment, close_inherited, drop_inherited, fd_ready, open_fds
from . import wire

_state_lock = threading.Lock()
_state: "list[_EngineLink] | None" = None
_looked = False  # whether the environment was read (once per process)
_failed: "BaseException | None" = None  # why that attach failed: every later caller is told

#: Longest the engine waits, at shutdown or before ENGINE_CORE_DEAD, for live frontends
#: to take what their full rings held back (vLLM's PUSH sockets linger 4 s).
DRAIN_S = 4.0


class _EngineLink:
    """This engine core process's end of the channel to one frontend (one API server)."""

    def __init__(self, spec: wire.EngineSpec) -> None:
        from .link import notify_attached

        self.spec = spec
        self.client_index = spec.client_index
        self.framing: wire.VllmFraming | None = None

        def framing(tx, rx):
            self.framing = wire.VllmFraming(tx, rx, side="engine", tensor_min_bytes=spec.tensor_min_bytes,
                                            cuda_ipc=spec.channel.enable_cuda_ipc,
                                            arenas=spec.arenas)
            return self.framing

        self.channel = ShmChannel.attach(spec.channel, framing)
        #: A launcher made the channel (several API servers): the frontend is not the
        #: parent, its pid comes in its HELLO; the parent is the launcher.
        self.launcher_pid = spec.launcher_pid
        self.frontend_pid: int | None = spec.frontend_pid or None
        if self.frontend_pid is not None:
            self.channel.set_peer_pid(self.frontend_pid)
        self.channel.set_peer_gpus(list(spec.frontend_gpus))
        self.frontend_gone = False
        self.launcher_gone = False
        #: outputs went to this frontend since the last step (see _prewake_before_outputs)
        self.active = False
        self._pidfd: int | None = None
        self._parked: Segment | None = None
        self._parked_flag: Any = None
        self._start_sending()
        try:
            if spec.parked:
                self._parked = Segment.attach(spec.parked)
                self._parked_flag = self._parked.buf
        except BaseException:
            self.close()
            raise
        notify_attached(spec.attached_pipe)

    def _start_sending(self) -> None:
        #: Messages the full ring could not take, oldest first, as (record type,
        #: payload); while there are any, every send joins them.
        self._backlog: deque = deque()
        self._backlog_lock = threading.Lock()
        self._drained = threading.Condition(self._backlog_lock)
        self._flusher: threading.Thread | None = None  # writes the backlog while there is one

    def on_hello(self, obj: Any) -> None:
        """The frontend's first record names its pid: with a launcher, the process to
        watch from now on."""
        try:
            pid = wire.check_pid(obj)
        except ValueError as e:
            _log().error("shmclient.vllm: frontend %d: %s", self.client_index, e)
            return
        if self.launcher_pid and self.frontend_pid is None:
            try:
                self._pidfd = os.pidfd_open(pid)
            except OSError:  # gone already (or no pidfd: the launcher's watch remains)
                if not _exists(pid):
                    self.frontend_gone = True
            self.frontend_pid = pid
            self.channel.set_peer_pid(pid)

    def frontend_alive(self) -> bool:
        if self.frontend_gone:
            return False
        if self.launcher_pid:
            if os.getppid() != self.launcher_pid:
                self.frontend_gone = self.launcher_gone = True
            else:
                # (A pidfd closed by close() meanwhile polls as not open: gone for us.)
                pidfd = self._pidfd
                if pidfd is not None and fd_ready(pidfd):
                    self.frontend_gone = True
        elif os.getppid() != self.frontend_pid:
            self.frontend_gone = True
        return not self.frontend_gone

    @property
    def ends_engine(self) -> bool:
        """Whether this frontend's end means the engine's: it is the engine's parent, or
        the launcher (the parent) is gone. An API server of several that dies leaves the
        engine to its launcher, which shuts everything down (as vLLM's does)."""
        if self.launcher_pid and os.getppid() != self.launcher_pid:
            self.launcher_gone = True
        return not self.launcher_pid or self.launcher_gone

    def prewake(self) -> None:
        """Early wake-up: if the frontend's output task is parked, wake it now, before
        this step's outputs are built and encoded, so that its wake-up overlaps that work
        (it then spins for the outputs; see shmclient.vllm.frontend_async). One load when it is
        not parked; never blocks."""
        flag = self._parked_flag
        if flag is not None and flag[0]:
            flag[0] = 0
            self.channel.wake_peer()

    def close(self) -> None:
        self.frontend_gone = True
        self._parked_flag = None
        self.channel.close()  # wakes a flusher waiting for room: it ends
        flusher = self._flusher
        if flusher is not None and flusher is not threading.current_thread():
            flusher.join(5.0)
        if self._parked is not None:
            self._parked.close()
        pidfd, self._pidfd = self._pidfd, None
        if pidfd is not None:
            os.close(pidfd)

    def send(self, kind: int, frames, *, wake: bool = True, placed: list = ()) -> bool:
        """Write one message now, or keep it for the flusher thread when the ring has no
        room for it (the frontend is slow) or older messages are kept: it goes after them,
        as the frontend makes room. Never waits for the frontend. Dropped once the
        frontend is gone. True when the message was kept: its frames must not be reused.

        ``wake=False``: publish it without waking a parked frontend; the wake-up is owed
        until ``wake_owed()`` (the caller's promise). A ring without room gives any owed
        wake-up at once (the frontend must read to make room). ``placed``: the handles
        the encode of ``frames`` placed out of band (``VllmFraming.take_placed``)."""
        if self.frontend_gone:
            return False
        rtype, payload = wire.message(kind, frames, placed)
        with self._backlog_lock:
            if not self._backlog:
                try:
                    self.channel.send_nowait(rtype, payload, wake=wake)
                    return False
                except WouldBlock:
                    # Nothing sent, or the fragments that fit: the flusher sends the
                    # same payload again, which resumes after them. A wake-up held back
                    # goes now: the frontend must read to make room.
                    self.channel.wake_owed()
                except (PeerDeadError, ClientClosedError):
                    self.frontend_gone = True
                    return False
                except ProtocolError as e:
                    self.broken(e)
                    return False
            self._backlog.append((rtype, payload))
            if self._flusher is None:
                self._flusher = threading.Thread(target=self._flush, daemon=True,
                                                 name=f"shmclient-flush-{self.client_index}")
                self._flusher.start()
        return True

    def _flush(self) -> None:
        """The flusher thread: write the backlog, oldest first, waiting for room and
        checking the frontend's liveness; ends when the backlog is empty (dropped once the
        frontend is gone or the link closed). Only this thread writes while there is a
        backlog: ``send`` adds to it instead. SIGTERM and SIGINT are blocked here, as in the
        engine's IO threads: a thread that wakes every liveness slice could take a signal
        meant to wake vLLM's main thread (it may be started from the busy loop, whose mask
        it inherits)."""
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
        while True:
            with self._backlog_lock:
                if not self._backlog or self.frontend_gone:
                    self._backlog.clear()
                    self._flusher = None
                    self._drained.notify_all()
                    return
                rtype, payload = self._backlog[0]
            try:
                waiting.send(self.channel, rtype, payload, timeout=None, alive=self.frontend_alive)
            except (PeerDeadError, ClientClosedError):
                self.frontend_gone = True
                continue
            except ProtocolError as e:
                self.broken(e)
                continue
            except Exception as e:  # this message only (e.g. over the ring's 4 GiB)
                _log().error("shmclient.vllm: a message to frontend %d dropped: %r", self.client_index, e)
            with self._backlog_lock:
                self._backlog.popleft()

    def broken(self, error: BaseException) -> None:
        """This frontend broke the channel's protocol (a position in its ring that no
        writer could have left, ``ProtocolError``): it is taken as gone, as if it had
        died; its outputs are dropped from now on and the other frontends' served on.
        Logged once, whichever side of the channel found it first."""
        if not self.frontend_gone:
            self.frontend_gone = True
            _log().error("shmclient.vllm: frontend %d broke the channel's protocol (%s); it is taken as gone",
                         self.client_index, error)

    def drain(self, deadline: float) -> bool:
        """Wait until the backlog is written (True), the frontend is gone (True: nobody to
        write it to), or ``time.monotonic()`` passes ``deadline`` (False)."""
        with self._drained:
            while self._flusher is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._drained.wait(left)
        return True

    def wake_owed(self) -> None:
        """Give the frontend the wake-up that sends with ``wake=False`` held back (if
        any). Never blocks."""
        self.channel.wake_owed()

    def greet(self) -> None:
        """The first records: HELLO (this process's pid), then, with arenas, GPUS: the
        GPUs this process has a CUDA context on (CUDA tensors from the frontend come by
        IPC handle only for those)."""
        self.send(wire.HELLO, [msgspec.msgpack.encode(os.getpid())])
        if not self.spec.arenas:
            return
        gpus: list[str] = []
        try:
            import torch

            if torch.cuda.is_initialized():
                from ..gpus import local_gpu_uuids

                gpus = local_gpu_uuids()
        except ImportError:
            pass
        self.send(wire.GPUS, [msgspec.msgpack.encode(gpus)])


def drain(links: "list[_EngineLink]", timeout: float = DRAIN_S) -> None:
    """Give live frontends up to ``timeout`` seconds in all to take what their full
    rings held back (see ``_EngineLink.drain``)."""
    deadline = time.monotonic() + timeout
    for link in links:
        link.drain(deadline)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _log():
    from . import log

    return log


def _links(engine_index: int) -> "list[_EngineLink]":
    """Attach once, from the environment, to this engine's channels (one per frontend,
    in client-index order), and remove the variables (processes started later do not see
    them; workers started before carry them and ignore them: only an EngineCoreProc's IO
    threads read them). Closes the inherited handles of every other channel named there
    (a forked engine inherits its launcher's fds). [] when it was handed no channel. An
    attach that failed raises in its caller, and RuntimeError (from it) in every later
    one: the other IO thread must not fall back to vLLM's sockets."""
    global _state, _looked, _failed
    with _state_lock:
        if not _looked:
            _looked = True
            text = os.environ.pop(wire.ENV_SPEC, None)
            frontends = os.environ.pop(wire.ENV_FRONTEND_SPEC, None)
            links: list[_EngineLink] = []
            try:
                specs = wire.decode_specs(text, engine_index) if text else []
                before = open_fds()
                for spec in specs:
                    links.append(_EngineLink(spec))
            except BaseException as e:
                _failed = e
                for link in links:
                    link.close()
                raise
            _state = links
            close_inherited(wire.inherited_handles(text, frontends), before)
        if _failed is not None:
            error = RuntimeError(f"shmclient.vllm: this engine's channels could not be attached ({_failed!r})")
            raise error from _failed
        return _state or []


def drop_inherited_channels(keep_specs: bool) -> None:
    """At the entry of a process vLLM starts during a launch on the rings (an engine
    core, the DP coordinator): close every fd it inherited of the project's segments and
    of the pipes the specs in its environment name (``shm.drop_inherited``; a forked
    process inherits its launcher's, a spawned one nothing). An engine attaches its own
    channels later, through its launcher's /proc/<pid>/fd (``keep_specs``: the variables
    stay for it); the coordinator never does (they go). Never raises."""
    text = os.environ.get(wire.ENV_SPEC)
    frontends = os.environ.get(wire.ENV_FRONTEND_SPEC)
    if not keep_specs:
        os.environ.pop(wire.ENV_SPEC, None)
        os.environ.pop(wire.ENV_FRONTEND_SPEC, None)
    if text or frontends:
        drop_inherited(wire.inherited_handles(text, frontends))


def entry_dropping_inherited(stock, keep_specs: bool):
    """vLLM's process entry ``stock`` (a static method's function), calling
    ``drop_inherited_channels(keep_specs)`` first. It keeps vLLM's qualified name: a
    spawned process unpickles vLLM's own entry (and inherits nothing). Idempotent."""
    if getattr(stock, "_shmclient", False):
        return stock

    @functools.wraps(stock)
    def entry(*args, **kwargs):
        drop_inherited_channels(keep_specs)
        return stock(*args, **kwargs)

    entry._shmclient = True  # type: ignore[attr-defined]
    return entry
