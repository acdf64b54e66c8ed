"""Engine core side of the plug-in: vLLM's ``EngineCoreProc`` input/output moved to rings.

Imports vLLM (its engine module) and the plug-in's ``wire`` and ``oob``; nothing of the
frontend.
``install()`` wraps two methods of ``EngineCoreProc``, the targets of its two IO threads:

* ``process_input_sockets``: still connects vLLM's DEALER socket to the frontend and sends
  the ready response on it (vLLM's handshake is unchanged), then reads the request ring
  instead of the socket, decodes with vLLM's ``MsgpackDecoder`` and feeds ``input_queue``
  exactly as vLLM's thread does (same pre-processing, aborts also to ``aborts_queue``).
* ``process_output_sockets``: still connects vLLM's PUSH socket, used only for
  ``ENGINE_CORE_DEAD``. Output mode ``inline`` (the default): ``output_queue`` is
  replaced (before the busy loop starts) by an object whose ``put_nowait`` encodes the
  ``EngineCoreOutputs`` with vLLM's ``MsgpackEncoder`` and writes it to the ring in the
  putting thread (the busy loop, or a utility's completion callback), so an output skips
  the queue hand-off to the IO thread; the IO thread only waits for ``ENGINE_CORE_DEAD``.
  Output mode ``thread``: the IO thread takes each output from ``output_queue`` and
  writes it, as vLLM's thread does with its socket.

Both wrappers fall back to vLLM's own method when this process was not given rings (the
environment variable ``SHMCLIENT_VLLM_SPEC``) or when a DP coordinator is involved.

Tensors (``oob``): the request decoders read arena handles (anything else goes to vLLM's
own tensor provider), the output encoders write large tensors to the output arena. The
request reader frees output blocks named in the frontend's ``RELEASES`` records, and sends
the releases of request tensors the busy loop has dropped with each output and, when
idle, every 0.1 s (its liveness slice). Early wake-up: when the frontend's async task is
parked (its flag in shared memory), ``Scheduler.update_from_output`` writes the wake
byte first (see ``frontend``).
The engine watches its frontend: the request ring's wait checks every 0.1 s that the
frontend (its parent process) is still there; when it is gone the engine requests its own
shutdown the way vLLM's SIGTERM handler does, and outputs nobody can read are dropped.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
from typing import Any

import msgspec
import zmq

from ..errors import ClientClosedError, PeerDeadError, PeerNotConsumingError, PeerNotProducingError, PeerTimeoutError
from ..ring import Ring
from ..shm import Segment, open_handle
from ..tensors import ShmTensorReceiver, ShmTensorSender
from . import wire

_state_lock = threading.Lock()
_state: "_EngineRings | None" = None
_originals: dict[str, Any] = {}
#: How often (s) an idle request reader sends the frontend pending tensor releases.
RELEASE_FLUSH_S = 0.1


class _EngineRings:
    """This engine core process's ends of the two rings."""

    def __init__(self, text: str) -> None:
        spec, req_spec, out_spec = wire.decode_spec(text)
        self.spec = spec
        self.requests = Ring.attach(req_spec, "consumer", spin_us=spec.spin_us)
        try:
            self.outputs = Ring.attach(out_spec, "producer", spin_us=spec.spin_us)
        except BaseException:
            self.requests.close()
            raise
        self.frontend_pid = spec.frontend_pid
        self.frontend_gone = False
        self._parked = self._parked_flag = None
        self._wake_fd = -1
        self.tensors_in: ShmTensorReceiver | None = None  # requests' tensors
        self.tensors_out: ShmTensorSender | None = None  # outputs' tensors
        try:
            if spec.parked and out_spec.wake_pipe:
                self._parked = Segment.attach(spec.parked)
                self._parked_flag = self._parked.buf
                self._wake_fd = open_handle(out_spec.wake_pipe, os.O_WRONLY | os.O_NONBLOCK)
            if spec.request_arena and spec.output_arena:
                self.tensors_in = ShmTensorReceiver(Segment.attach(spec.request_arena))
                self.tensors_out = ShmTensorSender(
                    Segment.attach(spec.output_arena), enable_cuda_ipc=spec.cuda_ipc,
                    peer_gpu_uuids=list(spec.frontend_gpus),
                )
        except BaseException:
            self.close()
            raise
        self._inline: "_InlineOutputs | None" = None
        self._inline_lock = threading.Lock()

    def inline_outputs(self, engine) -> "_InlineOutputs":
        """The one _InlineOutputs of this engine (made by whichever IO thread asks first)."""
        with self._inline_lock:
            if self._inline is None:
                self._inline = _InlineOutputs(self, engine.engine_index, type(engine).ENGINE_CORE_DEAD)
            return self._inline

    def frontend_alive(self) -> bool:
        if os.getppid() != self.frontend_pid:
            self.frontend_gone = True
        return not self.frontend_gone

    def prewake(self) -> None:
        """Early wake-up: if the frontend's output task is parked, write its wake byte now,
        before this step's outputs are built and encoded, so that its wake-up overlaps
        that work (it then spins for the outputs; see shmclient.vllm.frontend). One load
        when it is not parked; never blocks."""
        flag = self._parked_flag
        if flag is not None and flag[0]:
            flag[0] = 0
            try:
                os.write(self._wake_fd, b"\1")
            except OSError:  # full (already readable) or the frontend is gone
                pass

    def close(self) -> None:
        self.frontend_gone = True
        self.requests.close()
        self.outputs.close()
        self._parked_flag = None
        for end in (self.tensors_in, self.tensors_out):
            if end is not None:
                end.close()
        if self._wake_fd >= 0:
            os.close(self._wake_fd)
            self._wake_fd = -1
        if self._parked is not None:
            self._parked.close()

    def send(self, kind: int, frames) -> None:
        """Write one message; drop it once the frontend is gone. Blocks while the ring is
        full (the frontend is slow), checking the frontend's liveness."""
        if self.frontend_gone:
            return
        self.flush_releases()
        try:
            if len(frames) == 1:
                self.outputs.send(kind, frames[0], timeout=None, alive=self.frontend_alive)
            else:
                self.outputs.send_batch(wire.frames_to_records(kind, frames), timeout=None, alive=self.frontend_alive)
        except (PeerDeadError, ClientClosedError):
            self.frontend_gone = True


    def flush_releases(self) -> None:
        """Tell the frontend which request tensors this side is done with (they die with
        vLLM's Request objects, in any thread). Never blocks: a full ring keeps them for
        the next flush."""
        receiver = self.tensors_in
        if receiver is None or not receiver.pending or self.frontend_gone:
            return
        payload = receiver.take_releases()
        if payload is not None:
            try:
                self.outputs.send(wire.RELEASES, payload, timeout=0.0)
            except (PeerNotConsumingError, PeerDeadError, ClientClosedError):
                pass

    def on_release(self, payload) -> None:
        if self.tensors_out is not None:
            self.tensors_out.on_release(bytes(payload))

    def provider(self, fallback):
        """vLLM's oob_tensor_provider for requests: the arena, else ``fallback``."""
        if self.tensors_in is None:
            return fallback
        from .oob import ArenaProvider

        return ArenaProvider(self.tensors_in, fallback)

    def consumer(self):
        """vLLM's oob_tensor_consumer for outputs (None: vLLM's own frames)."""
        if self.tensors_out is None:
            return None
        from .oob import ArenaTensors

        return ArenaTensors(self.tensors_out, self.spec.tensor_min_bytes, self.spec.cuda_ipc)

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


def _rings() -> "_EngineRings | None":
    """Attach once, from the environment, and remove the variable (processes started
    later do not see it; workers started before carry it and ignore it: only an
    EngineCoreProc's IO threads read it)."""
    global _state
    with _state_lock:
        if _state is None:
            text = os.environ.pop(wire.ENV_SPEC, None)
            if text:
                _state = _EngineRings(text)
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
    """vLLM's shutdown, then close this process's ring ends: that wakes an IO thread
    blocked on a ring and waits for it to let go, so nothing is unmapped under it."""
    try:
        _originals["shutdown"](self)
    finally:
        rings = getattr(self, "_shmclient_rings", None)
        if rings is not None:
            rings.close()


def _keep_signals_for_main_thread() -> None:
    """Block SIGTERM/SIGINT in this IO thread. vLLM's handlers run in the main thread,
    which sleeps in ``input_queue.get()``; only a signal delivered to that thread wakes
    it. An IO thread that wakes every liveness slice could otherwise take the signal
    and leave the engine asleep until the frontend's SIGKILL (seen here)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})


def _process_input_sockets(self, input_addresses, coord_input_address, identity, ready_event):
    rings = _rings() if coord_input_address is None and len(input_addresses) == 1 else None
    if rings is None:
        return _originals["in"](self, input_addresses, coord_input_address, identity, ready_event)
    _keep_signals_for_main_thread()
    self._shmclient_rings = rings
    _fatal_if_raises(self, "request", _serve_requests, self, rings, input_addresses[0], identity, ready_event)


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


def _serve_requests(self, rings: _EngineRings, input_address: str, identity: bytes, ready_event) -> None:
    from vllm.multimodal.cache import MultiModalCacheMissError
    from vllm.utils.network_utils import make_zmq_socket
    from vllm.v1.engine import EngineCoreRequest, EngineCoreRequestType
    from vllm.v1.engine.core import EngineShutdownState
    from vllm.v1.fault_tolerance.engine_core_sentinel import FT_UTILITY_METHOD
    from vllm.v1.serial_utils import MsgpackDecoder

    provider = rings.provider(self.tensor_ipc_receiver)
    add_decoder = MsgpackDecoder(EngineCoreRequest, oob_tensor_provider=provider)
    generic_decoder = MsgpackDecoder(oob_tensor_provider=provider)
    types = {t.value[0]: t for t in EngineCoreRequestType}
    ring = rings.requests
    partial: list = []
    req = request = None
    with zmq.Context() as ctx, make_zmq_socket(
        ctx, input_address, zmq.DEALER, identity=identity, bind=False
    ) as handshake:
        if rings.spec.output_mode == "inline":
            # Swap before the busy loop starts (it waits for ready_event): no output can
            # then go to the old queue after it was emptied.
            inline = rings.inline_outputs(self)
            old, self.output_queue = self.output_queue, inline
            while True:
                try:
                    inline.put_nowait(old.get_nowait())
                except queue.Empty:
                    break
        if rings._parked_flag is not None:
            _prewake_before_outputs(self, rings)
        if rings.tensors_out is not None:
            rings.send_gpus()
        # vLLM's frontend waits for this on its ROUTER socket before it sends anything.
        handshake.send(msgspec.msgpack.encode(self._make_ready_response()))
        ready_event.set()
        del ready_event
        while True:
            try:
                # Wakes every RELEASE_FLUSH_S when idle to send the frontend the releases
                # of request tensors the busy loop has dropped since.
                records = ring.recv(timeout=RELEASE_FLUSH_S, alive=rings.frontend_alive)
            except PeerNotProducingError:
                rings.flush_releases()
                continue
            except (PeerDeadError, ClientClosedError, PeerTimeoutError):
                rings.frontend_gone = True
                # What vLLM's SIGTERM handler does: finish (abort) and leave the busy loop.
                self.shutdown_state = EngineShutdownState.REQUESTED
                self.input_queue.put_nowait((EngineCoreRequestType.WAKEUP, None))
                return
            for code, frames in wire.split_messages(records, partial):
                if code == wire.RELEASES:
                    rings.on_release(frames[0])
                    continue
                if len(frames) > 1:
                    frames = [frames[0], *(bytearray(f) for f in frames[1:])]
                request_type = types[code]
                request: Any
                if request_type == EngineCoreRequestType.ADD:
                    req = add_decoder.decode(frames)
                    try:
                        request = self.preprocess_add_request(req)
                    except MultiModalCacheMissError as e:
                        self._handle_mm_cache_miss(req, e)
                        continue
                    except Exception:
                        self._handle_request_preproc_error(req)
                        continue
                elif request_type == EngineCoreRequestType.UTILITY:
                    request = generic_decoder.decode(frames)
                    client_idx, call_id, method, args = request
                    if method == FT_UTILITY_METHOD:
                        self.ft_sentinel.handle_command(client_idx, call_id, args[0])
                        continue
                else:
                    request = generic_decoder.decode(frames)
                    if request_type == EngineCoreRequestType.ABORT:
                        self.aborts_queue.put_nowait(request)
                self.input_queue.put_nowait((request_type, request))
            # Hold no request here: its tensors' arena blocks are released when the
            # busy loop drops it.
            req = request = frames = records = None


def _prewake_before_outputs(self, rings: _EngineRings) -> None:
    """Ring the parked frontend when the scheduler starts turning a step's model output
    into EngineCoreOutputs (measured ~15 us before they are stamped, ~35 us before they
    are published on this machine)."""
    scheduler = self.scheduler
    update = scheduler.update_from_output
    prewake = rings.prewake

    def update_from_output(*args, **kwargs):
        prewake()
        return update(*args, **kwargs)

    scheduler.update_from_output = update_from_output


class _InlineOutputs:
    """Stands in for ``EngineCoreProc.output_queue``: ``put_nowait`` encodes and writes
    the outputs to the ring in the calling thread; ENGINE_CORE_DEAD goes to ``dead``."""

    def __init__(self, rings: _EngineRings, engine_index: int, dead_marker: bytes) -> None:
        from vllm.v1.serial_utils import MsgpackEncoder

        self._rings = rings
        self._engine_index = engine_index
        self._dead_marker = dead_marker
        self._encoder = MsgpackEncoder(oob_tensor_consumer=rings.consumer())
        self._buffer = bytearray()
        self._lock = threading.Lock()  # MsgpackEncoder is not thread-safe
        self.dead: queue.SimpleQueue = queue.SimpleQueue()

    def put_nowait(self, item) -> None:
        if isinstance(item, bytes):
            self.dead.put(item)
            return
        _, outputs = item
        outputs.engine_index = self._engine_index
        with self._lock:
            frames = self._encoder.encode_into(outputs, self._buffer)
            self._rings.send(wire.OUTPUTS, frames)

    put = put_nowait

    def empty(self) -> bool:
        return True


def _process_output_sockets(self, output_paths, coord_output_path, engine_index):
    rings = _rings() if coord_output_path is None and len(output_paths) == 1 else None
    if rings is None:
        return _originals["out"](self, output_paths, coord_output_path, engine_index)
    _keep_signals_for_main_thread()
    _fatal_if_raises(self, "output", _serve_outputs, self, rings, output_paths[0], engine_index)


def _serve_outputs(self, rings: _EngineRings, output_path: str, engine_index: int) -> None:
    from vllm.utils.network_utils import make_zmq_socket
    from vllm.v1.engine.core import EngineCoreProc
    from vllm.v1.serial_utils import MsgpackEncoder

    dead = EngineCoreProc.ENGINE_CORE_DEAD
    with zmq.Context() as ctx, make_zmq_socket(ctx, output_path, zmq.PUSH, linger=4000) as dead_socket:
        if rings.spec.output_mode == "inline":
            # The input thread put the inline object in place of output_queue.
            dead_socket.send(rings.inline_outputs(self).dead.get())
            return
        encoder = MsgpackEncoder(oob_tensor_consumer=rings.consumer())
        buffer = bytearray()  # the ring copies it: reusable at once
        while True:
            output = self.output_queue.get()
            if output == dead:
                dead_socket.send(output)
                return
            _, outputs = output
            outputs.engine_index = engine_index
            rings.send(wire.OUTPUTS, encoder.encode_into(outputs, buffer))
