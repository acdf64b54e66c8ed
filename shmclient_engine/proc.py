"""Engine process main: ``python -m shmclient_engine <control address> <frontend pid>``
(launched by the frontend), or ``python -m shmclient_engine --connect tcp://HOST:PORT``
(a remote engine, started apart, possibly on another host).

Top of the engine side: imports shmclient's config, channel, control and messages (never
the client classes), and the core only through the ``make_core`` it is given (this
engine's by default). The process attaches the channel the frontend
created, builds the EngineCore, answers READY and runs the busy loop:

    drain every request available → one step → write the outputs → repeat;
    with nothing to do, block on the request ring's doorbell (after its spin budget).

It exits when the frontend says SHUTDOWN, closes its end of the channel, or dies (the
parent pid changes: checked at every blocking-wait slice and every 0.1 s while busy, so a
SIGKILLed frontend is noticed within about 0.1 s). An exception in the loop is sent as
ENGINE_CORE_DEAD with its text, flushed, and the process exits with status 1.

Exit is prompt: ``main`` closes the core, the channel and the control socket (the
cleanup that matters: nothing named is left behind, the death notice is delivered), runs
the ``atexit`` handlers, flushes logging and stdio, then leaves with ``os._exit``. The
interpreter's own teardown is skipped: with torch loaded it took ~0.35 s, most of the time
from a frontend's SIGKILL to the engine's exit (measured 0.40-0.65 s before, 0.05-0.18 s
after, on a 2-core host).

A remote engine (``--connect``) has no parent to watch: it connects to the frontend's
control socket (retrying until the frontend listens, up to ``--ready-timeout`` seconds,
600 by default, for the START message), and from START on a ``FrontendLink`` thread owns
that socket: it sends a heartbeat every ``EngineConfig.heartbeat_interval_s`` and stops
the engine (exit status 0) on SHUTDOWN or after ``heartbeat_timeout_s`` without a word
from the frontend (its heartbeats or anything else), i.e. a dead frontend, or a network
that is down, stops the engine within about that time plus one 0.1 s slice. Data
addresses the frontend bound on a wildcard host are reached at the host of
``--connect``.

Extension points for an engine module that wraps this one (see ``shmclient_engine``):
``main(argv, make_core=..., on_config=...)``.

One bad message never stops the engine. A request the core refuses, or one that does not
decode (the channel hands it up as ``BadMessage``), finishes at once with
``FinishReason.ERROR`` and the reason in ``stop_reason``; a utility call that does not
decode fails with the decoder's message; an abort that does not decode is dropped with a
log line; a message whose request id cannot be read cannot be answered and is logged.
Those outputs are queued and sent by the loop, never from inside ``handle`` (which runs
while ``send`` waits for room). Only a broken channel (``ProtocolError``) is fatal.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections import deque
from typing import Any, Callable, NoReturn

import msgspec
import zmq

from shmclient import auth, control, waiting
from shmclient.channel_zmq import ZmqChannel, ZmqChannelSpec
from shmclient.channel import (
    REC_OUTPUTS,
    BadMessage,
    REQ_ABORT,
    REQ_ADD,
    REQ_UTILITY,
    ShmChannel,
    ShmChannelSpec,
)
from shmclient.errors import (
    AuthenticationError,
    ConfigError,
    PeerDeadError,
    PeerNotConsumingError,
    PeerNotProducingError,
    ProtocolError,
)
from shmclient.tensors_cuda import local_gpu_uuids
from shmclient.messages import (
    PROTOCOL_VERSION,
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    UtilityOutput,
    UtilityRequest,
)

from shmclient.config import EngineConfig

_SLICE_S = 0.1

#: ``make_core(config, *, supports_wait)``: builds the engine core (see ``shmclient_engine``).
MakeCore = Callable[..., Any]

log = logging.getLogger("shmclient_engine")


class EngineProc:
    """The loop around one EngineCore. Single-threaded; utility futures may complete on
    other threads and hand their replies over through a deque."""

    def __init__(self, ctl: zmq.Socket, parent_pid: int | None, config: EngineConfig,
                 channel: Any, make_core: MakeCore | None = None, *,
                 link: "FrontendLink | None" = None):
        """Builds the core with ``make_core(config, supports_wait=True)`` (this engine's
        ``shmclient_engine.make_core`` by default); blocks while the model loads and raises
        what that raises (``ConfigError`` for a config it cannot run). ``link``: a remote
        engine's control thread (then ``parent_pid`` is None and ``ctl`` is the link's)."""
        if make_core is None:
            from . import make_core

        self.ctl = ctl
        self.parent_pid = parent_pid
        self.link = link
        self.config = config
        self.channel = channel
        # This loop keeps stepping while a pause or sleep in mode "wait" drains.
        self.core = make_core(config, supports_wait=True)
        self.replies: deque[EngineCoreOutputs] = deque()
        #: Outputs of refused requests, per client, sent by the loop (never by handle).
        self.rejected: dict[int, list[EngineCoreOutput]] = {}
        self.steps = 0
        self._last_check = 0.0
        self._stop = False

    # -- liveness ---------------------------------------------------------------------
    def alive(self) -> bool:
        """Checked by every blocking wait: frontend alive and no SHUTDOWN received."""
        if self.link is not None:
            if self.link.stopped:
                self._stop = True
        elif os.getppid() != self.parent_pid:
            self._stop = True
        elif self.ctl.poll(0, zmq.POLLIN):
            msg = self.ctl.recv_multipart()
            if msg and msg[0] == control.SHUTDOWN:
                self._stop = True
        return not self._stop

    # -- requests ---------------------------------------------------------------------
    def handle(self, rtype: int, obj: Any) -> None:
        """Act on one message. Never sends (replies and rejections are queued for the
        loop); raises only ``ProtocolError`` (a message type the engine never takes)."""
        if type(obj) is BadMessage:
            self.bad_message(rtype, obj)
        elif rtype == REQ_ADD:
            try:
                self.core.add_request(obj)
            except Exception as e:  # noqa: BLE001 - a refused request changes nothing
                self.reject(obj.client_index, obj.request_id, str(e))
        elif rtype == REQ_ABORT:
            self.core.abort_requests(obj)
        elif rtype == REQ_UTILITY:
            self.utility(obj)
        else:
            raise ProtocolError(f"unexpected message type 0x{rtype:02x} on the request channel")

    def reject(self, client_index: Any, request_id: str, reason: str) -> None:
        """Finish a request the engine did not take with ERROR (queued for the loop)."""
        if type(client_index) is not int or client_index < 0:
            client_index = 0
        out = EngineCoreOutput(
            request_id=request_id, finish_reason=FinishReason.ERROR, stop_reason=reason
        )
        self.rejected.setdefault(client_index, []).append(out)

    def bad_message(self, rtype: int, bad: BadMessage) -> None:
        """Answer a message that did not decode, if it can be matched to its sender."""
        if rtype == REQ_ADD:
            rid = bad.field("request_id")
            if type(rid) is str and rid:
                self.reject(bad.field("client_index"), rid,
                            f"the engine could not decode this request: {bad.error}")
            else:
                log.warning("dropped a request that does not decode and whose request_id "
                            "cannot be read, so it cannot be answered: %s", bad.error)
        elif rtype == REQ_UTILITY:
            call_id = bad.field("call_id")
            if type(call_id) is int:
                out = UtilityOutput(call_id=call_id,
                                    failure_message=f"the engine could not decode the call: "
                                                    f"{bad.error}")
                self.replies.append(EngineCoreOutputs(utility_output=out))
            else:
                log.warning("dropped a utility call that does not decode and whose call_id "
                            "cannot be read, so it cannot be answered: %s", bad.error)
        elif rtype == REQ_ABORT:
            log.warning("dropped an abort whose request ids do not decode: %s", bad.error)
        else:
            raise ProtocolError(f"unexpected message type 0x{rtype:02x} on the request channel")

    def flush_rejected(self) -> None:
        """Send the queued ERROR outputs, one batch per client."""
        while self.rejected:
            client_index, outs = self.rejected.popitem()
            self.send(client_index, EngineCoreOutputs(
                outputs=outs, finished_requests={o.request_id for o in outs}))

    def utility(self, req: UtilityRequest) -> None:
        def reply(result: Any = None, failure: str | None = None) -> None:
            out = UtilityOutput(call_id=req.call_id, failure_message=failure, result=result)
            self.replies.append(EngineCoreOutputs(utility_output=out))

        try:
            # A pause or sleep in mode "wait" returns a Future that core.step() completes
            # once the requests that came before it have finished: answered then.
            result = self.core.call_utility(req.method, tuple(req.args))
        except Exception as e:
            reply(failure=str(e))  # read as "Call to <method> method failed: <e>", as vLLM
            return
        if isinstance(result, concurrent.futures.Future):
            result.add_done_callback(lambda f: _reply_future(f, reply))
        else:
            reply(result)

    def send(self, client_index: int, outputs: EngineCoreOutputs) -> None:
        """Send one batch. While the output ring is full (the frontend is not reading),
        keep taking requests, so that a frontend blocked on a full request ring always
        gets room and the two processes can never wait on each other. ``handle`` only
        queues, so this never recurses."""
        channel = self.channel
        payload = channel.encode(outputs)
        while True:
            try:
                waiting.send(channel, REC_OUTPUTS, payload, timeout=_SLICE_S, alive=self.alive)
                return
            except PeerNotConsumingError:
                for rtype, obj in channel.try_recv():
                    self.handle(rtype, obj)
                if self._stop:
                    raise PeerDeadError("the frontend is gone") from None

    # -- loop -------------------------------------------------------------------------
    def run(self) -> None:
        core = self.core
        while not self._stop:
            # A sleeping or paused engine schedules nothing (has_work says so): it waits
            # like an idle one.
            if core.has_work():
                got = self.channel.try_recv()
                now = time.monotonic()
                if now - self._last_check > _SLICE_S:
                    self._last_check = now
                    self.alive()
            else:
                try:
                    got = waiting.recv(self.channel, timeout=_SLICE_S, alive=self.alive)
                except PeerNotProducingError:
                    got = []
            for rtype, obj in got:
                self.handle(rtype, obj)
            if self.rejected:
                self.flush_rejected()
            if core.has_work():
                self.steps += 1
                for client_index, outputs in core.step().items():
                    self.send(client_index, outputs)
            while self.replies or self.rejected:
                if self.rejected:
                    self.flush_rejected()
                if self.replies:
                    self.send(0, self.replies.popleft())


class FrontendLink:
    """A remote engine's control socket from START on (see the module docstring): a
    thread reads it (SHUTDOWN, heartbeats) and beats every interval; the main thread
    sends through ``send``. The socket is used under one lock by both; never blocks for
    longer than one non-blocking socket call."""

    def __init__(self, ctl: zmq.Socket, interval_s: float, timeout_s: float) -> None:
        self.ctl = ctl
        #: Why the engine must stop (None while the frontend is there).
        self.stop_reason: str | None = None
        self._hb = control.Heartbeat(interval_s, timeout_s)
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shmclient-engine-link",
                                        daemon=True)
        self._thread.start()

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    def send(self, frames: list[bytes]) -> bool:
        """Queue one message for the frontend; False when the socket cannot take it (no
        frontend connected). Never blocks."""
        with self._lock:
            try:
                self.ctl.send_multipart(frames, zmq.NOBLOCK)
                return True
            except zmq.ZMQError:
                return False

    def _run(self) -> None:
        hb = self._hb
        while not self._done.wait(hb.poll_s()):
            with self._lock:
                while self.ctl.poll(0, zmq.POLLIN):
                    msg = self.ctl.recv_multipart()
                    hb.heard()
                    if msg and msg[0] == control.SHUTDOWN:
                        self.stop_reason = "the frontend said SHUTDOWN"
                if self.stop_reason is None:
                    hb.beat(self.ctl)
                    if hb.expired():
                        self.stop_reason = (f"the frontend sent nothing for {hb.silence_s():.1f} "
                                            "s: it died, or the network to it is down")
                        log.warning("remote engine stops: %s", self.stop_reason)
            if self.stop_reason is not None:
                return

    def close(self) -> None:
        """Stop the thread (waits for it, at most one interval and a bit)."""
        self._done.set()
        self._thread.join(timeout=5.0)


def _parse_argv(argv: list[str]) -> tuple[str, int | None, float]:
    """``[address, frontend pid]`` or ``--connect ADDRESS [--ready-timeout S]``: the
    control address, the frontend's pid (None when remote) and how long a remote engine
    waits for START. Raises ``SystemExit`` (usage) for anything else."""
    if argv and not argv[0].startswith("-"):
        if len(argv) != 2:
            raise SystemExit("usage: python -m shmclient_engine <control address> <frontend pid>"
                             " | --connect tcp://HOST:PORT [--ready-timeout S]")
        return argv[0], int(argv[1]), 0.0, ()
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
    if not args.connect.startswith("tcp://"):
        p.error(f"--connect {args.connect!r}: expected tcp://HOST:PORT")
    wait = args.ready_timeout
    if wait is None:
        wait = float(os.environ.get("SHMCLIENT_ENGINE_READY_TIMEOUT_S", "600"))
    if not wait > 0:
        p.error(f"--ready-timeout {wait!r}: must be > 0")
    return args.connect, None, wait, tuple(args.allow_module)


def _connect_and_hello(ctl: zmq.Socket, address: str, wait_s: float,
                       secret: bytes | None = None) -> list[bytes] | None:
    """Remote engine: say HELLO once the frontend listens, then wait for START; None if
    either takes longer than ``wait_s`` in all. With a ``secret``, the frontend's AUTH
    challenge is answered first; ``AuthenticationError`` for a frontend that cannot prove
    it knows the secret (or sends START without trying): nothing it sent is decoded, no
    module it names is imported."""
    deadline = time.monotonic() + wait_s
    nonce_e = auth.nonce() if secret is not None else b""
    hello = [control.HELLO, str(os.getpid()).encode(), nonce_e]
    while True:
        try:
            ctl.send_multipart(hello, zmq.NOBLOCK)
            break
        except zmq.Again:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ctl.poll(int(min(_SLICE_S, left) * 1000) + 1, zmq.POLLOUT)
    authenticated = secret is None
    while True:
        msg = control.recv(ctl, min(_SLICE_S, max(0.0, deadline - time.monotonic())))
        if msg is not None and msg[0] == control.AUTH and not authenticated:
            if len(msg) != 3 or len(msg[1]) != auth.NONCE_BYTES or not auth.verify(
                    secret, b"frontend", nonce_e, msg[1], msg[2]):
                raise AuthenticationError(
                    f"the frontend at {address} could not prove it knows the shared secret: "
                    "it is not the frontend this engine was started for, or its "
                    f"{auth.SECRET_FILE_ENV} / {auth.SECRET_ENV} differs")
            authenticated = True
            ctl.send_multipart([control.AUTH, auth.proof(secret, b"engine", msg[1], nonce_e)])
            continue
        if msg is not None and msg[0] == control.START:
            if not authenticated:
                raise AuthenticationError(
                    f"the frontend at {address} sent START without authenticating (it has "
                    f"no shared secret): give it the same {auth.SECRET_FILE_ENV} or "
                    f"{auth.SECRET_ENV} as this engine")
            return msg
        if msg is None and time.monotonic() >= deadline:
            return None


def _reply_future(fut: concurrent.futures.Future, reply: Any) -> None:
    try:
        reply(fut.result())
    except Exception as e:
        reply(failure=str(e))


def _send_dead(ctl: zmq.Socket, text: str, block: bool = True) -> None:
    try:
        ctl.send_multipart([control.ENGINE_CORE_DEAD, text.encode(errors="replace")],
                           0 if block else zmq.NOBLOCK)
    except zmq.ZMQError:
        pass


def run_process(argv: list[str], *, make_core: MakeCore | None = None,
                on_config: Callable[[EngineConfig], None] | None = None) -> int:
    """The engine process's life from HELLO to cleanup; returns the exit status (0: the
    frontend said SHUTDOWN, closed its end or died; 1: a fatal error, reported as
    ENGINE_CORE_DEAD; 143: SIGTERM). Blocks for the engine's whole life; raises nothing.

    ``argv``: ``[control address, frontend pid]``, or ``["--connect", address,
    ("--ready-timeout", S)]`` for a remote engine (exit status 1 also when no frontend
    sent START in time). ``make_core(config, supports_wait=True)``
    builds the core (``shmclient_engine.make_core`` by default). ``on_config(config)``, if
    given, runs once the config has arrived, before the core is built (an exception there
    is reported as a start-up failure; ``SystemExit`` exits with its code)."""
    address, parent_pid, wait_s, allowed_modules = _parse_argv(argv)
    if parent_pid is None:
        # A remote engine without a secret (and without the explicit opt-in) refuses to
        # start, before it connects anywhere.
        try:
            secret = auth.require_secret("engine")
        except AuthenticationError as e:
            log.error("%s", e)
            return 1
    else:
        secret = None
    # Ctrl-C in a terminal goes to the whole process group; the frontend decides.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ctx = zmq.Context()
    ctl = control.engine_socket(ctx, address)
    proc: EngineProc | None = None
    link: FrontendLink | None = None
    channel: Any = None
    code = 0
    try:
        if parent_pid is None:
            msg = _connect_and_hello(ctl, address, wait_s, secret)
            if msg is None:
                log.error("no frontend sent START at %s within %g s: exiting", address, wait_s)
                return 1
        else:
            ctl.send_multipart([control.HELLO, str(os.getpid()).encode()])
            msg = None
            while msg is None:
                if os.getppid() != parent_pid:
                    return 0
                msg = control.recv(ctl, _SLICE_S)
        _, raw_config, transport, raw_spec, raw_gpus = msg
        config = msgspec.msgpack.decode(raw_config, type=EngineConfig)
        if parent_pid is None:
            refused = [m for m in config.utility_modules if m not in allowed_modules]
            if refused:
                raise AuthenticationError(
                    f"the frontend asks this remote engine to import {refused} "
                    "(EngineConfig.utility_modules), which its command line does not allow: "
                    "start it with --allow-module NAME for each module it may import")
        if parent_pid is None:
            link = FrontendLink(ctl, config.heartbeat_interval_s, config.heartbeat_timeout_s)
        if on_config is not None:
            on_config(config)
        if not config.is_cuda:
            # The engine process is the only compute here, and on a small host torch's
            # thread pool spinning against the frontend costs more than it gains.
            import torch

            torch.set_num_threads(max(1, config.cpu_threads))
        if transport == b"shm":
            channel = ShmChannel.attach(msgspec.msgpack.decode(raw_spec, type=ShmChannelSpec))
            if parent_pid is not None:
                channel.set_peer_pid(parent_pid)
        else:
            spec = msgspec.msgpack.decode(raw_spec, type=ZmqChannelSpec)
            spec = ZmqChannelSpec(input_address=control.reachable(spec.input_address, address),
                                  output_address=control.reachable(spec.output_address, address))
            channel = ZmqChannel.attach(ctx, spec)
        channel.set_peer_gpus(msgspec.msgpack.decode(raw_gpus, type=list[str]))
        proc = EngineProc(ctl, parent_pid, config, channel, make_core, link=link)
        info = control.ReadyInfo(
            pid=os.getpid(),
            num_gpu_blocks=proc.core.num_gpu_blocks,
            block_size=proc.core.block_size,
            max_model_len=proc.core.max_model_len,
            protocol_version=PROTOCOL_VERSION,
            gpu_uuids=local_gpu_uuids(),
        )
        ready = [control.READY, msgspec.msgpack.encode(info)]
        if link is not None:
            link.send(ready)
        else:
            ctl.send_multipart(ready)
        proc.run()
    except PeerDeadError:
        code = 0  # the frontend closed its end or went away: a normal exit
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException as e:  # noqa: BLE001 - everything else is fatal and reported
        if not isinstance(e, ConfigError):
            # a ConfigError (a setting this engine cannot run with) is the frontend's to
            # raise, typed, with this text; anything else is a bug whose stack is here only
            traceback.print_exc()
        if link is not None:
            link.close()
        _send_dead(ctl, f"{type(e).__name__}: {e}", block=link is None)
        code = 1
    finally:
        if link is not None:
            link.close()
        if proc is not None:
            try:
                proc.core.shutdown()
            except Exception:  # pragma: no cover
                traceback.print_exc()
        if channel is not None:
            channel.close()
        ctl.close(linger=2000 if code else 0)
        ctx.term()
        if parent_pid is not None and os.getppid() != parent_pid:
            # the frontend died, maybe before it removed its private socket directory
            control.remove_orphaned_dir(address, parent_pid)
    return code


def exit_now(code: int) -> NoReturn:
    """Leave the process at once: ``atexit`` handlers, logging and stdio flushed, then
    ``os._exit(code)``, skipping the interpreter's teardown (module and object
    finalisation, ~0.35 s with torch loaded), so that the engine is gone within a few ms
    of its cleanup."""
    try:
        atexit._run_exitfuncs()
        logging.shutdown()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed or broken stream cannot stop the exit
                pass
        os._exit(code)


def main(argv: list[str] | None = None, *, make_core: MakeCore | None = None,
         on_config: Callable[[EngineConfig], None] | None = None) -> NoReturn:
    """Entry point of ``python -m <engine module>``: ``run_process`` (arguments as there;
    ``argv`` defaults to ``sys.argv[1:]``), then ``exit_now`` with its status. Never
    returns."""
    try:
        code = run_process(sys.argv[1:] if argv is None else argv,
                           make_core=make_core, on_config=on_config)
    except SystemExit as e:  # SIGTERM before the loop started, or a usage error
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - bad arguments: say why, then exit
        traceback.print_exc()
        code = 1
    exit_now(code)


if __name__ == "__main__":
    main()
