"""The engine process's side of the protocol: ``main`` / ``run_process`` say ``Hello``,
take ``Start``, attach the channel the frontend created, build the core (an
``EngineCore``, the Protocol an engine implements to be served, from ``serve_loop``),
answer ``Ready`` and run the loop until the frontend says ``Shutdown``, closes its end or
dies; a fatal error is reported as ``EngineCoreDead`` (typed for a ``ConfigError`` or
``AuthenticationError``, which the frontend raises as such; no traceback here for those)
and the process exits with status 1, promptly (``exit_now``). Protocol layer, engine
side: imports shmclient's config, channel, control, control_sockets, messages, errors and
``waiting`` (it blocks only through it); never a client module and never an engine: the
core comes from the ``make_core`` it is given (an engine module's ``python -m
<engine_module>`` calls ``main(make_core=...)``, as ``shmclient_engine`` does). The loop
and what it does with a bad message: ``serve_loop``; a remote engine's handshake and
heartbeats: ``serve_remote``.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import time
import traceback
from typing import Callable, NoReturn, TypeVar

import msgspec
import zmq

from . import auth, control, control_sockets
from .channel import ShmChannel, ShmChannelSpec
from .channel_zmq import ZmqChannel, ZmqChannelSpec
from .config import EngineConfig
from .control import ControlMessageError
from .errors import AuthenticationError, ConfigError, PeerDeadError
from .gpus import local_gpu_uuids
from .messages import PROTOCOL_VERSION
from .serve_loop import Channel, EngineCore, EngineProc, MakeCore
from .serve_remote import FrontendLink, connect_and_hello as _connect_and_hello, parse_argv as _parse_argv

__all__ = ["EngineCore", "EngineProc", "MakeCore", "exit_now", "main", "run_process"]

_SLICE_S = 0.1
T = TypeVar("T")

log = logging.getLogger("shmclient_engine")


def _send_dead(ctl: zmq.Socket, error: BaseException, block: bool = True) -> None:
    try:
        control.send(ctl, control.EngineCoreDead.of(error), 0 if block else zmq.NOBLOCK)
    except zmq.ZMQError:
        pass


def _wait_for_start(ctl: zmq.Socket, parent_pid: int, wait_s: float) -> control.Start | None:
    """A local engine: ``Hello``, then ``Start`` (None: the frontend died first, or sent
    nothing for ``wait_s`` seconds: its start-up was abandoned, e.g. interrupted as it
    spawned this process, or it gave up itself). Raises ``ControlMessageError`` for
    anything else but ``Shutdown`` (``PeerDeadError``)."""
    control.send(ctl, control.Hello(pid=os.getpid(), protocol_version=PROTOCOL_VERSION))
    deadline = time.monotonic() + wait_s
    while True:
        if os.getppid() != parent_pid:
            return None
        if time.monotonic() >= deadline:
            log.error("the frontend (pid %d) sent no Start within %g s: its start-up was "
                      "abandoned; exiting", parent_pid, wait_s)
            return None
        msg = control.recv(ctl, _SLICE_S)
        if isinstance(msg, control.Start):
            return msg
        if isinstance(msg, control.Shutdown):
            raise PeerDeadError("the frontend said Shutdown before Start")
        if msg is not None:
            raise ControlMessageError.unexpected(msg, "from the frontend before Start")


def _decode(raw: msgspec.Raw, typ: type[T], field: str) -> T:
    """A field of ``Start`` the engine decodes itself: typed, or ``ControlMessageError``."""
    try:
        return msgspec.msgpack.decode(raw, type=typ)
    except msgspec.DecodeError as e:
        raise ControlMessageError(f"a Start control message with an invalid {field}: {e}") from None


def run_process(argv: list[str], *, make_core: MakeCore,
                on_config: Callable[[EngineConfig], None] | None = None) -> int:
    """The engine process's life from ``Hello`` to cleanup; returns the exit status (0: the
    frontend said ``Shutdown``, closed its end or died; 1: a fatal error, reported as
    ``EngineCoreDead``, a control message that is not the protocol's included; 143:
    SIGTERM; 130: SIGINT, which only a remote engine heeds). Blocks for the engine's whole life; raises nothing.

    ``argv``: ``[control address, frontend pid (, seconds to wait for Start)]``, or ``["--connect", address,
    ("--ready-timeout", S)]`` for a remote engine (exit status 1 also when no frontend
    sent ``Start`` in time, or the frontend said ``Shutdown`` before it). ``make_core(config, supports_wait=True)``
    builds the core (an ``EngineCore``). ``on_config(config)``, if
    given, runs once the config has arrived, before the core is built (an exception there
    is reported as a start-up failure; ``SystemExit`` exits with its code)."""
    address, parent_pid, wait_s, allowed_modules = _parse_argv(argv)
    if parent_pid is None:
        # A remote engine was started by hand, in a terminal of its own with no frontend in
        # its process group: Ctrl-C stops it, cleanly, as SIGTERM does.
        signal.signal(signal.SIGINT, lambda *_: sys.exit(130))
    else:
        # A local engine: Ctrl-C in a terminal goes to the whole process group, the
        # frontend's included; the frontend decides.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if parent_pid is None:
        # A remote engine without a secret (and without the explicit opt-in) refuses to
        # start, before it connects anywhere.
        try:
            secret = auth.require_secret("engine")
        except AuthenticationError as e:
            log.error("%s", e)
            return 1
        control.load_torch_before_heartbeats()  # its beats run from Hello on
    else:
        secret = None
    ctx = zmq.Context()
    ctl = control_sockets.engine_socket(ctx, address)
    proc: EngineProc | None = None
    link: FrontendLink | None = None
    channel: Channel | None = None
    code = 0
    try:
        if parent_pid is None:
            try:
                start = _connect_and_hello(ctl, address, wait_s, secret)
            except PeerDeadError as e:
                # Not a normal exit: this engine never served. Its operator is told why here.
                log.error("%s: it ended the start-up, refusing this engine (e.g. no shared "
                          "secret, another protocol version) or giving up its own start; see "
                          "its log. Exiting", e)
                return 1
            if start is None:
                log.error("no frontend sent Start at %s within %g s: exiting", address, wait_s)
                return 1
        else:
            start = _wait_for_start(ctl, parent_pid, wait_s)
            if start is None:
                return 0
        config = _decode(start.config, EngineConfig, "config")
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
        if not config.is_cuda:  # before the core: a model may load torch as it is built
            limit_torch_threads(max(1, config.cpu_threads))
        if start.transport == "shm":
            channel = ShmChannel.attach(_decode(start.channel, ShmChannelSpec, "channel"))
            if parent_pid is not None:
                channel.set_peer_pid(parent_pid)
        else:
            spec = _decode(start.channel, ZmqChannelSpec, "channel")
            reachable = control_sockets.reachable
            spec = ZmqChannelSpec(input_address=reachable(spec.input_address, address),
                                  output_address=reachable(spec.output_address, address),
                                  identity=spec.identity)
            channel = ZmqChannel.attach(ctx, spec)
        if channel.set_peer_gpus is not None:
            channel.set_peer_gpus(list(start.gpu_uuids))
        proc = EngineProc(ctl, parent_pid, config, channel, make_core, link=link)
        if not config.is_cuda:  # again: the exact count where building it loaded torch
            limit_torch_threads(max(1, config.cpu_threads))
        ready = control.Ready(
            pid=os.getpid(),
            num_gpu_blocks=proc.core.num_gpu_blocks,
            block_size=proc.core.block_size,
            max_model_len=proc.core.max_model_len,
            gpu_uuids=local_gpu_uuids(),
        )
        if link is not None:
            link.send(ready)
        else:
            control.send(ctl, ready)
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
        _send_dead(ctl, e, block=link is None)
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
            control_sockets.remove_orphaned_dir(address, parent_pid)
    return code


def limit_torch_threads(n: int) -> None:
    """Give torch ``n`` intra-op threads in this process: the engine process is the only
    compute here, and on a small host torch's thread pool spinning against the frontend
    costs more than it gains. Set at once where torch is loaded; else through the
    variables its OpenMP and MKL read when it loads (later, if at all: with a model that
    computes, or the first tensor; torch caps them at the host's cores), which processes
    this one starts inherit."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(n)
    else:
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(n)


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


def main(argv: list[str] | None = None, *, make_core: MakeCore,
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
