"""Engine core side of the plug-in: vLLM's ``EngineCoreProc`` input/output on the channel.

Imports vLLM (its engine module), ``shmclient.channel`` and ``shmclient.waiting`` and the
plug-in's ``wire``; nothing of the frontend, no ring end. ``install()`` wraps two methods
of ``EngineCoreProc``, the targets of its two IO threads:

* ``process_input_sockets``: still connects vLLM's DEALER socket to the frontend and sends
  the ready response on it (vLLM's handshake is unchanged), then reads the request ring
  (``waiting.recv``) instead of the socket and handles each request as vLLM's thread does
  (``_handle_request``: the same pre-processing, aborts also to ``aborts_queue``). A
  request that does not decode fails alone (vLLM's request-scoped error for an ADD).
* ``process_output_sockets``: still connects vLLM's PUSH socket, used only for
  ``ENGINE_CORE_DEAD``. Output mode ``inline`` (the default): ``output_queue`` is
  replaced (before the busy loop starts) by an object whose ``put_nowait`` encodes a
  small ``EngineCoreOutputs`` and writes it in the putting thread (the busy loop, or a
  utility's completion callback), skipping the hand-off to the IO thread; a big batch
  (more than ``SHMCLIENT_VLLM_INLINE_MAX_OUTPUTS`` outputs) and what follows it until it
  is written go to the IO thread, as in vLLM. Output mode ``thread``: the IO thread
  takes each output from ``output_queue`` and writes it.

Both wrappers fall back to vLLM's own method when this process was not handed a channel
(the environment variable ``SHMCLIENT_VLLM_SPEC`` holds none for its engine index) or
talks to several frontends. With data parallelism the DP coordinator's messages stay on
vLLM's ZMQ sockets: its requests (waves) are read by a thread of their own
(``_Coordinator``), and outputs for it (client index -1) go out from the output thread.
The engine watches its frontend: the request wait checks every 0.1 s that the frontend (its
parent process) is still there; when it is gone the engine asks for its own shutdown the
way vLLM's SIGTERM handler does, and outputs nobody can read are dropped. Idle, the request
reader wakes every 0.1 s also to send the frontend the releases of request tensors the
busy loop has dropped.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
from typing import Any

import msgspec
import zmq

from .. import waiting
from ..channel import BadMessage, ShmChannel
from ..errors import ClientClosedError, PeerDeadError, PeerNotProducingError
from ..shm import Segment
from . import wire

_state_lock = threading.Lock()
_state: "_EngineLink | None" = None
_looked = False  # whether the environment was read (once per process)
_originals: dict[str, Any] = {}
#: How often (s) an idle request reader sends the frontend pending tensor releases.
RELEASE_FLUSH_S = 0.1


class _EngineLink:
    """This engine core process's end of the channel to its frontend."""

    def __init__(self, spec: wire.EngineSpec) -> None:
        self.spec = spec
        self.framing: wire.VllmFraming | None = None

        def framing(tx, rx):
            self.framing = wire.VllmFraming(tx, rx, side="engine", tensor_min_bytes=spec.tensor_min_bytes,
                                            cuda_ipc=spec.channel.enable_cuda_ipc,
                                            arenas=spec.arenas)
            return self.framing

        self.channel = ShmChannel.attach(spec.channel, framing)
        self.channel.set_peer_pid(spec.frontend_pid)
        self.channel.set_peer_gpus(list(spec.frontend_gpus))
        self.frontend_pid = spec.frontend_pid
        self.frontend_gone = False
        self._parked: Segment | None = None
        self._parked_flag: Any = None
        try:
            if spec.parked:
                self._parked = Segment.attach(spec.parked)
                self._parked_flag = self._parked.buf
        except BaseException:
            self.close()
            raise
        self._inline: "_InlineOutputs | None" = None
        self._inline_lock = threading.Lock()

    def inline_outputs(self, engine) -> "_InlineOutputs":
        """The one _InlineOutputs of this engine (made by whichever IO thread asks first)."""
        with self._inline_lock:
            if self._inline is None:
                self._inline = _InlineOutputs(self, engine.engine_index, self.spec.inline_max_outputs)
            return self._inline

    def frontend_alive(self) -> bool:
        if os.getppid() != self.frontend_pid:
            self.frontend_gone = True
        return not self.frontend_gone

    def prewake(self) -> None:
        """Early wake-up: if the frontend's output task is parked, wake it now, before
        this step's outputs are built and encoded, so that its wake-up overlaps that work
        (it then spins for the outputs; see shmclient.vllm.frontend). One load when it is
        not parked; never blocks."""
        flag = self._parked_flag
        if flag is not None and flag[0]:
            flag[0] = 0
            self.channel.wake_peer()

    def close(self) -> None:
        self.frontend_gone = True
        self._parked_flag = None
        self.channel.close()
        if self._parked is not None:
            self._parked.close()

    def send(self, kind: int, frames) -> None:
        """Write one message; drop it once the frontend is gone. Waits while the ring is
        full (the frontend is slow), checking the frontend's liveness."""
        if self.frontend_gone:
            return
        rtype, payload = wire.message(kind, frames)
        try:
            waiting.send(self.channel, rtype, payload, timeout=None, alive=self.frontend_alive)
        except (PeerDeadError, ClientClosedError):
            self.frontend_gone = True

    def send_gpus(self) -> None:
        """The GPUS record: the GPUs this process has a CUDA context on (CUDA tensors
        from the frontend come by IPC handle only for those)."""
        gpus: list[str] = []
        try:
            import torch

            if torch.cuda.is_initialized():
                from ..tensors_cuda import local_gpu_uuids

                gpus = local_gpu_uuids()
        except ImportError:
            pass
        self.send(wire.GPUS, [msgspec.msgpack.encode(gpus)])


def _link(engine_index: int) -> "_EngineLink | None":
    """Attach once, from the environment, to this engine's channel (the spec naming
    ``engine_index``), and remove the variable (processes started later do not see it;
    workers started before carry it and ignore it: only an EngineCoreProc's IO threads
    read it). None when the frontend handed this engine no channel."""
    global _state, _looked
    with _state_lock:
        if not _looked:
            _looked = True
            text = os.environ.pop(wire.ENV_SPEC, None)
            spec = wire.decode_spec(text, engine_index) if text else None
            if spec is not None:
                _state = _EngineLink(spec)
        return _state


def install() -> None:
    """Wrap EngineCoreProc's IO thread targets (idempotent)."""
    from vllm.v1.engine.core import EngineCoreProc

    if _originals:
        return
    _originals["in"] = EngineCoreProc.process_input_sockets
    _originals["out"] = EngineCoreProc.process_output_sockets
    _originals["shutdown"] = EngineCoreProc.shutdown
    EngineCoreProc.process_input_sockets = _process_input_sockets
    EngineCoreProc.process_output_sockets = _process_output_sockets
    EngineCoreProc.shutdown = _shutdown


def _shutdown(self) -> None:
    """vLLM's shutdown, then close this process's end of the channel: that wakes an IO
    thread waiting on a ring and waits for it to let go, so nothing is unmapped under it."""
    try:
        _originals["shutdown"](self)
    finally:
        link = getattr(self, "_shmclient_link", None)
        if link is not None:
            link.close()


def _keep_signals_for_main_thread() -> None:
    """Block SIGTERM/SIGINT in this IO thread. vLLM's handlers run in the main thread,
    which sleeps in ``input_queue.get()``; only a signal delivered to that thread wakes
    it. An IO thread that wakes every liveness slice could otherwise take the signal
    and leave the engine asleep until the frontend's SIGKILL (seen here)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})


def _process_input_sockets(self, input_addresses, coord_input_address, identity, ready_event):
    link = _link(int.from_bytes(identity, "little")) if len(input_addresses) == 1 else None
    if link is None:
        return _originals["in"](self, input_addresses, coord_input_address, identity, ready_event)
    _keep_signals_for_main_thread()
    self._shmclient_link = link
    _fatal_if_raises(self, "request", _serve_requests, self, link, input_addresses[0], coord_input_address,
                     identity, ready_event)


def _fatal_if_raises(self, what: str, fn, *args) -> None:
    """Run an IO thread's body; if it raises, log it and fail the engine the way an
    executor failure does (ENGINE_CORE_DEAD to the frontend) instead of leaving the busy
    loop waiting for input that will never come."""
    try:
        fn(*args)
    except BaseException:
        from vllm.logger import init_logger
        from vllm.v1.engine import EngineCoreRequestType

        init_logger(__name__).exception("shmclient.vllm: the %s ring's IO thread failed", what)
        self.input_queue.put_nowait((EngineCoreRequestType.EXECUTOR_FAILED, b""))
        raise


def _serve_requests(self, link: _EngineLink, input_address: str, coord_address: str | None, identity: bytes,
                    ready_event) -> None:
    from vllm.utils.network_utils import make_zmq_socket
    from vllm.v1.engine import EngineCoreRequestType

    link.framing.set_fallback(self.tensor_ipc_receiver)
    types = {t.value[0]: t for t in EngineCoreRequestType}
    channel = link.channel
    with zmq.Context() as ctx, make_zmq_socket(
        ctx, input_address, zmq.DEALER, identity=identity, bind=False
    ) as handshake:
        coordinator = None
        if coord_address is not None:
            # The DP coordinator's messages (waves, scale-out) stay on its ZMQ socket,
            # read by their own thread; it subscribes now, as vLLM's input thread does.
            coordinator = _Coordinator(self, coord_address, identity)
        try:
            if link.spec.output_mode == "inline":
                # Swap before the busy loop starts (it waits for ready_event): no output can
                # then go to the old queue after it was emptied.
                inline = link.inline_outputs(self)
                old, self.output_queue = self.output_queue, inline
                while True:
                    try:
                        inline.put_nowait(old.get_nowait())
                    except queue.Empty:
                        break
            if link._parked_flag is not None:
                _prewake_before_outputs(self, link)
            if link.spec.arenas:
                link.send_gpus()
            # vLLM's frontend waits for this on its ROUTER socket before it sends anything.
            handshake.send(msgspec.msgpack.encode(self._make_ready_response()))
            if coordinator is not None:
                coordinator.wait_ready()  # vLLM's handshake completes only after the coordinator's READY
                coordinator.start()
            ready_event.set()
            del ready_event
            while True:
                try:
                    # Wakes every RELEASE_FLUSH_S when idle to send the frontend the releases
                    # of request tensors the busy loop has dropped since. Never spins: a spin
                    # holds the GIL, which the busy loop needs, and the busy loop takes
                    # requests only between steps anyway.
                    messages = waiting.recv(channel, timeout=RELEASE_FLUSH_S, alive=link.frontend_alive, spin=0.0)
                except PeerNotProducingError:
                    channel.flush_releases()
                    continue
                except (PeerDeadError, ClientClosedError):
                    link.frontend_gone = True
                    # What vLLM's SIGTERM handler does: finish (abort) and leave the busy loop.
                    from vllm.v1.engine.core import EngineShutdownState

                    self.shutdown_state = EngineShutdownState.REQUESTED
                    self.input_queue.put_nowait((EngineCoreRequestType.WAKEUP, None))
                    return
                for rtype, request in messages:
                    request_type = types[rtype & ~wire.MULTI]
                    if isinstance(request, BadMessage):
                        _refuse(self, request_type, request)
                        continue
                    _handle_request(self, request_type, request)
                # Hold no request here: its tensors' arena blocks are released when the
                # busy loop drops it.
                messages = request = None
        finally:
            if coordinator is not None:
                coordinator.stop()


class _Coordinator:
    """The DP coordinator's messages to this engine: vLLM's XSUB socket, subscribed and
    read as vLLM's input thread reads it, in a thread of its own (the request reader
    waits on the ring), with a ZMQ context of its own. Each message is handled as vLLM
    handles it (``_handle_request``). ``stop`` ends the thread within ``POLL_S``."""

    POLL_S = 0.1

    def __init__(self, engine, address: str, identity: bytes) -> None:
        from vllm.utils.network_utils import make_zmq_socket
        from vllm.v1.serial_utils import MsgpackDecoder

        self._engine = engine
        self._decoder = MsgpackDecoder(oob_tensor_provider=engine.tensor_ipc_receiver)
        self._ctx = zmq.Context()
        self.socket = make_zmq_socket(self._ctx, address, zmq.XSUB, identity=identity, bind=False)
        self.socket.send(b"\x01")  # the subscription
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ShmEngineCoordinatorInput", daemon=True)

    def wait_ready(self) -> None:
        if self.socket.recv() != b"READY":
            raise RuntimeError("shmclient.vllm: the DP coordinator's first message was not READY")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.ident is None:
            self._close()

    def _close(self) -> None:
        self.socket.close(linger=0)
        self._ctx.term()

    def _run(self) -> None:
        from vllm.v1.engine import EngineCoreRequestType

        _keep_signals_for_main_thread()
        try:
            _fatal_if_raises(self._engine, "coordinator", self._read, EngineCoreRequestType)
        finally:
            self._close()

    def _read(self, types) -> None:
        socket, engine, stopped = self.socket, self._engine, self._stopped
        timeout_ms = int(self.POLL_S * 1000)
        while not stopped.is_set():
            if not socket.poll(timeout_ms):
                continue
            type_frame, *data = socket.recv_multipart(copy=False)
            if type_frame.buffer == b"READY":  # vLLM's notice to newly started engines
                continue
            _handle_request(engine, types(bytes(type_frame.buffer)), self._decoder.decode(data))


def _refuse(self, request_type, bad: BadMessage) -> None:
    """A request that did not decode fails alone (stock vLLM's input thread would die):
    an ADD whose request id can still be read gets vLLM's request-scoped error output,
    a utility call its failure reply; the rest is logged and dropped."""
    from vllm.logger import init_logger
    from vllm.v1.engine import EngineCoreOutputs, EngineCoreRequestType, UtilityOutput

    log = init_logger(__name__)
    log.error("shmclient.vllm: a %s request did not decode and is dropped: %s", request_type.name, bad.error)
    raw = bad.raw if isinstance(bad.raw, list) else None
    if request_type == EngineCoreRequestType.ADD:
        rid, client = bad.field("request_id"), bad.field("client_index")
        if isinstance(rid, str):
            self._send_error_outputs_to_client([rid], client if isinstance(client, int) else 0)
    elif request_type == EngineCoreRequestType.UTILITY and raw is not None and len(raw) == 4:
        client, call_id = raw[0], raw[1]
        if isinstance(client, int) and isinstance(call_id, int):
            failure = f"Call to {raw[2]!r} method failed: the request did not decode: {bad.error}"
            self.output_queue.put_nowait(
                (client, EngineCoreOutputs(utility_output=UtilityOutput(call_id, failure_message=failure))))


def _handle_request(self, request_type, request) -> None:
    """One decoded request, handled as vLLM's input thread handles it: this mirrors the
    loop body of ``EngineCoreProc.process_input_sockets`` after its decode (``versions``
    checks at registration that the running vLLM's loop is one this was written against).
    vLLM 0.33 answers a request that fails validation with a request-scoped error
    (``_handle_request_validation_error``); with a vLLM that has that handler, so does
    this."""
    from vllm.multimodal.cache import MultiModalCacheMissError
    from vllm.v1.engine import EngineCoreRequestType
    from vllm.v1.fault_tolerance.engine_core_sentinel import FT_UTILITY_METHOD

    if request_type == EngineCoreRequestType.ADD:
        req = request
        try:
            request = self.preprocess_add_request(req)
        except MultiModalCacheMissError as e:
            self._handle_mm_cache_miss(req, e)
            return
        except Exception as e:
            validation = _validation_error()
            if validation is not None and isinstance(e, validation):
                self._handle_request_validation_error(req, e)
            else:
                self._handle_request_preproc_error(req)
            return
    elif request_type == EngineCoreRequestType.UTILITY:
        client_idx, call_id, method, args = request
        if method == FT_UTILITY_METHOD:
            self.ft_sentinel.handle_command(client_idx, call_id, args[0])
            return
    elif request_type == EngineCoreRequestType.ABORT:
        # Aborts go to both queues, as vLLM's (eager, and in order with the adds).
        self.aborts_queue.put_nowait(request)
    self.input_queue.put_nowait((request_type, request))


def _validation_error() -> type | None:
    """vLLM's ``VLLMValidationError`` when its engine answers it per request (0.33 on),
    else None (an older engine treats it as any other pre-processing error)."""
    from vllm.v1.engine.core import EngineCoreProc

    if not hasattr(EngineCoreProc, "_handle_request_validation_error"):
        return None
    try:
        from vllm.exceptions import VLLMValidationError
    except ImportError:
        return None
    return VLLMValidationError


def _prewake_before_outputs(self, link: _EngineLink) -> None:
    """Wake the parked frontend when the scheduler starts turning a step's model output
    into EngineCoreOutputs (measured ~15 us before they are stamped, ~35 us before they
    are published on this machine)."""
    scheduler = self.scheduler
    update = scheduler.update_from_output
    prewake = link.prewake

    def update_from_output(*args, **kwargs):
        prewake()
        return update(*args, **kwargs)

    scheduler.update_from_output = update_from_output


class _InlineOutputs:
    """Stands in for ``EngineCoreProc.output_queue``. ``put_nowait`` encodes the outputs
    and writes them to the ring in the calling thread (the busy loop, or a utility's
    completion callback) when that is cheap: a batch of at most ``inline_max`` outputs
    while the output thread has nothing queued. A bigger batch, everything after it until
    the output thread has written it, and ENGINE_CORE_DEAD go to ``queue`` for the output
    thread (``serve_queued``): the busy loop never encodes a large batch on its critical
    path, and nothing overtakes what is queued."""

    def __init__(self, link: _EngineLink, engine_index: int, inline_max: int) -> None:
        self._link = link
        self._engine_index = engine_index
        self._inline_max = inline_max
        self._buffer = bytearray()  # the ring copies it: reusable at once
        self._send_lock = threading.Lock()  # vLLM's encoder is not thread-safe
        self._count_lock = threading.Lock()
        self._queued = 0  # output batches put in ``queue`` and not yet written
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.inline = self.offloaded = 0  # batches written each way

    def put_nowait(self, item) -> None:
        if isinstance(item, bytes):  # ENGINE_CORE_DEAD: after what is queued
            self.queue.put(item)
            return
        client_index, outputs = item
        if client_index == -1:
            # For the DP coordinator (its ZMQ socket, owned by the output thread); no
            # order to keep with the frontend's outputs, so it holds none of them back.
            outputs.engine_index = self._engine_index
            self.queue.put(_ForCoordinator(outputs))
            return
        with self._count_lock:
            offload = self._queued > 0 or len(outputs.outputs) > self._inline_max
            if offload:
                self._queued += 1
        if offload:
            self.queue.put(outputs)
        else:
            self.send(outputs)

    put = put_nowait

    def send(self, outputs, *, queued: bool = False) -> None:
        """Encode and write one EngineCoreOutputs in this thread."""
        outputs.engine_index = self._engine_index
        link = self._link
        with self._send_lock:
            link.send(wire.OUTPUTS, link.framing.encoder.encode_into(outputs, self._buffer))
            if queued:
                self.offloaded += 1
            else:
                self.inline += 1

    def serve_queued(self, dead_socket, coordinator=None) -> None:
        """The output thread's loop: write what ``put_nowait`` queued, in order, until
        ENGINE_CORE_DEAD, which goes on ``dead_socket``; messages for the DP coordinator
        go to ``coordinator`` (a callable)."""
        while True:
            item = self.queue.get()
            if isinstance(item, bytes):
                dead_socket.send(item)
                return
            if isinstance(item, _ForCoordinator):
                coordinator(item.outputs)
                continue
            try:
                self.send(item, queued=True)
            finally:
                with self._count_lock:
                    self._queued -= 1

    def empty(self) -> bool:
        return not self._queued


class _ForCoordinator:
    """An output for the DP coordinator in the output thread's queue."""

    __slots__ = ("outputs",)

    def __init__(self, outputs) -> None:
        self.outputs = outputs


def _process_output_sockets(self, output_paths, coord_output_path, engine_index):
    link = _link(engine_index) if len(output_paths) == 1 else None
    if link is None:
        return _originals["out"](self, output_paths, coord_output_path, engine_index)
    _keep_signals_for_main_thread()
    _fatal_if_raises(self, "output", _serve_outputs, self, link, output_paths[0], coord_output_path, engine_index)


def _serve_outputs(self, link: _EngineLink, output_path: str, coord_path: str | None, engine_index: int) -> None:
    from contextlib import ExitStack

    from vllm.utils.network_utils import make_zmq_socket
    from vllm.v1.engine.core import EngineCoreProc
    from vllm.v1.serial_utils import MsgpackEncoder

    dead = EngineCoreProc.ENGINE_CORE_DEAD
    with ExitStack() as stack, zmq.Context() as ctx:
        dead_socket = stack.enter_context(make_zmq_socket(ctx, output_path, zmq.PUSH, linger=4000))
        to_coordinator = None
        if coord_path is not None:
            # The DP coordinator's stats and wave notices stay on its ZMQ socket, as vLLM's.
            coord_socket = stack.enter_context(make_zmq_socket(ctx, coord_path, zmq.PUSH, bind=False, linger=4000))
            encoder = MsgpackEncoder()
            to_coordinator = lambda outputs: coord_socket.send_multipart(encoder.encode(outputs))  # noqa: E731

        inline = link.inline_outputs(self)
        if link.spec.output_mode == "inline":
            # The input thread put the inline object in place of output_queue.
            inline.serve_queued(dead_socket, to_coordinator)
            return
        while True:
            output = self.output_queue.get()
            if output == dead:
                dead_socket.send(output)
                return
            client_index, outputs = output
            if client_index == -1:
                outputs.engine_index = engine_index
                to_coordinator(outputs)
                continue
            inline.send(outputs)
