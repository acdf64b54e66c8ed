"""The monitor thread of one engine: it sees the engine's death from the OS, not from
timeouts (a pidfd of the local engine process; for a remote engine, whose pid cannot be
watched across hosts, the heartbeats' silence), reads the control socket
(``EngineCoreDead``; anything else is logged and dropped) and, woken by the launcher's
shutdown, sends ``Shutdown``; it owns the control socket from the engine's ``Ready`` on
and closes it when it ends. Upper-middle layer, under ``launcher``: imports ``control``,
``engine_process`` and zmq; never a channel, a client or an engine.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
from typing import Callable

import zmq

from . import control, engine_process

__all__ = ["EngineMonitor", "send_shutdown"]

logger = logging.getLogger("shmclient")

_POLL_S = 0.1
#: How long closing a remote engine's control socket may take to get Shutdown out.
REMOTE_LINGER_MS = 500


def send_shutdown(ctl: zmq.Socket) -> None:
    """Send ``Shutdown`` without blocking (dropped when the socket cannot take it)."""
    try:
        control.send(ctl, control.Shutdown(), zmq.NOBLOCK)
    except zmq.ZMQError:
        pass


class EngineMonitor(threading.Thread):
    """Watches one engine until it dies (``mark_dead(reason)``, once) or ``wake_fd``
    becomes readable (the launcher's shutdown). ``proc``: the local engine process, or
    None for a remote engine, which ``clock`` watches; ``expected_exit()``: True once an
    exit of the engine is the client's doing (then it is not reported)."""

    def __init__(self, ctl: zmq.Socket, proc: subprocess.Popen | None,
                 clock: control.HeartbeatClock | None, wake_fd: int, *, pid: int,
                 address: str, rank: int, dead: threading.Event,
                 mark_dead: Callable[[str], None], expected_exit: Callable[[], bool]) -> None:
        super().__init__(name=f"shmclient-monitor-{pid}", daemon=True)
        assert proc is not None or clock is not None
        self.ctl = ctl
        self.proc = proc
        self.clock = clock
        self.wake_fd = wake_fd
        self.address = address
        self.rank = rank
        self.dead = dead
        self.mark_dead = mark_dead
        self.expected_exit = expected_exit

    def run(self) -> None:
        ctl, proc, hb = self.ctl, self.proc, self.clock
        poller = zmq.Poller()
        poller.register(ctl, zmq.POLLIN)
        poller.register(self.wake_fd, zmq.POLLIN)
        pidfd: int | None = None
        if proc is not None:
            try:
                pidfd = os.pidfd_open(proc.pid)
                poller.register(pidfd, zmq.POLLIN)
            except (AttributeError, OSError):  # pragma: no cover - old kernels
                pidfd = None
        try:
            self._watch(ctl, proc, hb, poller, pidfd)
        except Exception as e:  # a bug: nothing would watch the engine any more
            logger.exception("the watch of the engine at %s failed", self.address)
            if not self.expected_exit():
                self.mark_dead(f"The client's watch of the engine core failed: {e!r}")
        finally:
            if pidfd is not None:
                os.close(pidfd)
            # Over tcp the Shutdown needs a moment to leave (ctx.term() waits for it); a
            # remote engine that does not get it stops on the missing heartbeats.
            ctl.close(linger=REMOTE_LINGER_MS if hb is not None else 0)

    def _watch(self, ctl: zmq.Socket, proc: subprocess.Popen | None,
               hb: control.HeartbeatClock | None, poller: zmq.Poller, pidfd: int | None) -> None:
        """Until the engine is dead or the wake fd is readable (run's loop)."""
        while True:
            if hb is not None:
                wait: float | None = hb.poll_s() * 1000
            else:
                wait = None if pidfd is not None else _POLL_S * 1000
            events = dict(poller.poll(wait))
            if ctl in events:
                self._read_control()
            if self.wake_fd in events:
                if proc is None or proc.poll() is None:
                    send_shutdown(ctl)
                return
            if hb is not None:
                if self.dead.is_set():
                    # It reported its death (it is gone), or the client's shutdown
                    # began: that one's Shutdown goes now, whether or not its wake
                    # byte came yet (this return would otherwise drop it).
                    if self.expected_exit():
                        send_shutdown(ctl)
                    return
                hb.beat(ctl)
                if hb.expired():
                    self.mark_dead(
                        f"Remote engine core of data-parallel rank {self.rank} at "
                        f"{self.address} sent no heartbeat for {hb.silence_s():.1f} s: "
                        "it died, or the network to it is down.")
                    return
            elif (pidfd is not None and pidfd in events) or proc.poll() is not None:
                rc = proc.wait()
                if not self.expected_exit():
                    self.mark_dead(f"Engine core process {proc.pid} died unexpectedly "
                                   f"({engine_process.describe_exit(rc)}).")
                return

    def _read_control(self) -> None:
        """Take every queued control message. ``EngineCoreDead`` marks the engine dead;
        one that is not a message, or not one an engine sends after its start-up, is
        logged and dropped: it proves nothing about the engine's health."""
        while self.ctl.poll(0, zmq.POLLIN):
            if self.clock is not None:
                self.clock.heard()
            try:
                msg = control.decode(self.ctl.recv_multipart())
            except control.ControlMessageError as e:
                logger.warning("engine at %s: dropped a bad control message: %s",
                               self.address, e)
                continue
            if isinstance(msg, control.EngineCoreDead):
                self.mark_dead(f"Engine core process reported a fatal error: {msg.text()}")
            elif not isinstance(msg, control.Heartbeat):
                logger.warning("engine at %s: dropped an %s", self.address,
                               control.ControlMessageError.unexpected(msg, "after its start-up"))
