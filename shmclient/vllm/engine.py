"""Engine core side of the plug-in: vLLM's ``EngineCoreProc`` input/output on the channels.

Imports vLLM (its engine module), ``shmclient.waiting`` and the plug-in's ``wire``,
``engine_link`` (this engine's channels) and ``engine_outputs`` (its output side); nothing
of the frontend, no ring end. ``install()`` wraps two methods of ``EngineCoreProc``, the
targets of its two IO threads, ``process_input_sockets`` and ``process_output_sockets``,
its shutdown, and its process entry (``run_engine_core``: a forked engine core first
drops what it inherited of the launch's channels).
Its contract (what each wrapper does, output modes, fallback, the DP coordinator,
watching the frontends): docs/design.md, "Module notes", ``shmclient.vllm.engine``.
"""

from __future__ import annotations

import queue
import signal
import threading
from typing import Any

import msgspec
import zmq

from .. import waiting
from ..channel import BadMessage
from ..errors import ClientClosedError, PeerDeadError, PeerNotProducingError, ProtocolError
from . import wire
from .engine_link import _EngineLink, _links, _log, drain, entry_dropping_inherited
from .engine_outputs import _hook_adaptive, _inline_outputs, _prewake_before_outputs, _serve_outputs

_originals: dict[str, Any] = {}
#: How often (s) an idle request reader sends the frontend pending tensor releases.
RELEASE_FLUSH_S = 0.1


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
    entry = getattr(EngineCoreProc, "run_engine_core", None)
    if entry is not None:  # the process entry: before the executor forks any worker
        EngineCoreProc.run_engine_core = staticmethod(entry_dropping_inherited(entry, keep_specs=True))


def _shutdown(self) -> None:
    """vLLM's shutdown, then close this process's end of the channel (after up to
    ``engine_link.DRAIN_S`` for live frontends to take what their full rings held back):
    that wakes an IO thread waiting on a ring and waits for it to let go, so nothing is
    unmapped under it."""
    try:
        _originals["shutdown"](self)
    finally:
        links = getattr(self, "_shmclient_links", ())
        try:
            drain(links)  # live frontends take what their full rings held back
        finally:
            for link in links:
                link.close()
        inline = getattr(self, "_shmclient_inline", None)
        if inline is not None:
            _log().debug("shmclient.vllm: engine %d wrote %d output batches from its busy loop (%d of them "
                         "woke the frontend with the next step), %d from its output thread",
                         inline._engine_index, inline.inline, inline.deferred, inline.offloaded)


def _keep_signals_for_main_thread() -> None:
    """Block SIGTERM/SIGINT in this IO thread. vLLM's handlers run in the main thread,
    which sleeps in ``input_queue.get()``; only a signal delivered to that thread wakes
    it. An IO thread that wakes every liveness slice could otherwise take the signal
    and leave the engine asleep until the frontend's SIGKILL (seen here)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})


def _engine_links(engine_index: int, addresses) -> "list[_EngineLink]":
    """This engine's channels, one per frontend address vLLM gave it; [] for none (vLLM's
    own sockets then). RuntimeError when the launcher made channels for a different
    number of frontends than vLLM connects this engine to."""
    links = _links(engine_index)
    if links and len(links) != len(addresses):
        raise RuntimeError(f"shmclient.vllm: engine {engine_index} was handed channels for {len(links)} "
                           f"frontends, vLLM connects it to {len(addresses)}")
    return links


def _process_input_sockets(self, input_addresses, coord_input_address, identity, ready_event):
    links = _engine_links(int.from_bytes(identity, "little"), input_addresses)
    if not links:
        return _originals["in"](self, input_addresses, coord_input_address, identity, ready_event)
    _keep_signals_for_main_thread()
    self._shmclient_links = links
    _fatal_if_raises(self, "request", _serve_requests, self, links, input_addresses, coord_input_address,
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


def _serve_requests(self, links: "list[_EngineLink]", input_addresses: list, coord_address: str | None,
                    identity: bytes, ready_event) -> None:
    from contextlib import ExitStack

    from vllm.utils.network_utils import make_zmq_socket
    from vllm.v1.engine import EngineCoreRequestType

    for link in links:
        link.framing.set_fallback(self.tensor_ipc_receiver)
    types = {t.value[0]: t for t in EngineCoreRequestType}
    with ExitStack() as stack, zmq.Context() as ctx:
        handshakes = [stack.enter_context(make_zmq_socket(ctx, address, zmq.DEALER, identity=identity, bind=False))
                      for address in input_addresses]
        coordinator = None
        if coord_address is not None:
            # The DP coordinator's messages (waves, scale-out) stay on its ZMQ socket,
            # read by their own thread; it subscribes now, as vLLM's input thread does.
            coordinator = _Coordinator(self, coord_address, identity)
        try:
            if links[0].spec.output_mode != "thread":
                # Swap before the busy loop starts (it waits for ready_event): no output can
                # then go to the old queue after it was emptied.
                inline = _inline_outputs(self, links)
                if links[0].spec.output_mode == "adaptive":
                    _hook_adaptive(self, inline)
                old, self.output_queue = self.output_queue, inline
                while True:
                    try:
                        inline.put_nowait(old.get_nowait())
                    except queue.Empty:
                        break
            self._shmclient_add_checks = _AddChecks(self)
            if any(link._parked_flag is not None for link in links):
                _prewake_before_outputs(self, links)
            for link in links:
                link.greet()
            # vLLM's frontends wait for this on their ROUTER sockets before they send anything.
            ready = msgspec.msgpack.encode(self._make_ready_response())
            for handshake in handshakes:
                handshake.send(ready)
            if coordinator is not None:
                coordinator.wait_ready()  # vLLM's handshake completes only after the coordinator's READY
                coordinator.start()
            ready_event.set()
            del ready_event
            if len(links) == 1:
                _read_requests(self, links[0], types)
                return
            # One reader a frontend, each waiting on its own ring; requests are handled
            # one at a time, as vLLM's one input thread handles them.
            readers = [threading.Thread(target=_fatal_if_raises, args=(self, "request", _read_requests, self, link,
                                                                     types), name=f"ShmEngineRequests_{i}",
                                        daemon=True) for i, link in enumerate(links)]
            for reader in readers:
                reader.start()
            for reader in readers:
                reader.join()
        finally:
            if coordinator is not None:
                coordinator.stop()


_handling = threading.Lock()  # requests are handled one at a time, as by vLLM's one input thread


def _read_requests(self, link: _EngineLink, types) -> None:
    """Read one frontend's request ring until the frontend or this engine is gone."""
    from vllm.v1.engine import EngineCoreRequestType

    channel = link.channel
    while True:
        try:
            # Wakes every RELEASE_FLUSH_S when idle to send the frontend the releases
            # of request tensors the busy loop has dropped since. Never spins: a spin
            # holds the GIL, which the busy loop needs, and the busy loop takes
            # requests only between steps anyway.
            try:
                messages = waiting.recv(channel, timeout=RELEASE_FLUSH_S, alive=link.frontend_alive, spin=0.0)
            except PeerNotProducingError:
                channel.flush_releases()
                continue
        except (PeerDeadError, ClientClosedError, ProtocolError) as e:
            if isinstance(e, ProtocolError):
                link.broken(e)  # as its death: the other frontends are served on
            link.frontend_gone = True
            if link.ends_engine:
                # What vLLM's SIGTERM handler does: finish and leave the busy loop. Abort
                # the running requests whatever --shutdown-timeout says: a drain would
                # generate for nobody (the frontend that would read it is gone) for up to
                # that timeout.
                from vllm.v1.engine.core import EngineShutdownState

                try:
                    self.vllm_config.shutdown_timeout = 0
                except Exception:  # noqa: BLE001 (a vLLM whose config refuses it drains, as before)
                    _log().warning("shmclient.vllm: the engine drains its requests before it ends "
                                   "(its shutdown timeout could not be set to 0)", exc_info=True)
                self.shutdown_state = EngineShutdownState.REQUESTED
                self.input_queue.put_nowait((EngineCoreRequestType.WAKEUP, None))
            return
        with _handling:
            for rtype, request in messages:
                if rtype == wire.HELLO:
                    link.on_hello(request)
                    continue
                request_type = types.get(wire.kind_of(rtype))
                if request_type is None:  # the channel's framing decodes only these
                    continue
                if isinstance(request, BadMessage):
                    _refuse(self, link, request_type, f"it did not decode: {request.error}",
                            request.raw, request.field("request_id"))
                    continue
                problem = _malformed(link, request_type, request, getattr(self, "_shmclient_add_checks", None))
                if problem is not None:
                    _refuse(self, link, request_type, problem, request,
                            getattr(request, "request_id", None))
                    continue
                try:
                    _handle_request(self, request_type, request)
                except Exception as e:  # one request fails alone, the engine keeps serving
                    _log().exception("shmclient.vllm: handling a %s request from frontend %d failed",
                                     request_type.name, link.client_index)
                    _refuse(self, link, request_type, f"handling it failed: {e!r}", request,
                            getattr(request, "request_id", None))
        # Hold no request here: its tensors' arena blocks are released when the
        # busy loop drops it.
        messages = request = None


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
            request_type, request = types(bytes(type_frame.buffer)), self._decoder.decode(data)
            with _handling:
                _handle_request(engine, request_type, request)


#: What a frontend sends on its request ring. START_DP_WAVE comes from the DP
#: coordinator's own socket; EXECUTOR_FAILED and WAKEUP are the engine's own sentinels.
_FROM_FRONTEND = ("ADD", "ABORT", "UTILITY")


class _AddChecks:
    """What vLLM's engine core dies on in an ADD that decodes (its frontends check these
    first; a peer that does not would take the engine down, for every API server): a
    pooling task the model does not support (ValueError in the busy loop), a prompt
    token id outside the model's vocabulary (the embedding lookup fails in the worker;
    on a GPU a device-side assert). Read once, before the busy loop runs (its
    collective call is not made concurrently)."""

    __slots__ = ("pooling_tasks", "vocab_size")

    def __init__(self, engine) -> None:
        try:
            from vllm.tasks import POOLING_TASKS

            tasks = engine.model_executor.supported_tasks
            self.pooling_tasks: frozenset | None = frozenset(t for t in tasks if t in POOLING_TASKS)
        except Exception:  # noqa: BLE001 - a vLLM without them: not checked here
            self.pooling_tasks = None
        try:
            self.vocab_size: int | None = int(engine.vllm_config.model_config.get_vocab_size())
        except Exception:  # noqa: BLE001
            self.vocab_size = None

    def problem(self, request) -> str | None:
        params = request.pooling_params
        if params is not None and self.pooling_tasks is not None and params.task not in self.pooling_tasks:
            return f"its pooling task {params.task!r} is not one this model supports ({sorted(self.pooling_tasks)})"
        ids = request.prompt_token_ids
        # (multimodal placeholders may lie beyond the model's vocabulary: not checked)
        if ids and self.vocab_size is not None and not request.mm_features:
            low, high = min(ids), max(ids)
            if low < 0 or high >= self.vocab_size:
                bad = low if low < 0 else high
                return f"its prompt token id {bad} is outside the model's vocabulary of {self.vocab_size}"
        return None


def _malformed(link: _EngineLink, request_type, request, checks: "_AddChecks | None" = None) -> str | None:
    """Why a decoded request from ``link``'s frontend cannot be handled, or None. vLLM
    decodes only ADD with a type; the other kinds arrive as whatever msgpack held, and
    its input thread or busy loop would die on a wrong shape. A request's client index must be its frontend's: the
    outputs go back on the ring it came by. An ADD is checked further by ``checks``."""
    name = request_type.name
    if name not in _FROM_FRONTEND:
        return f"a frontend does not send {name}"
    if name == "ADD":
        if request.client_index != link.client_index:
            return f"its client_index {request.client_index!r} is not its frontend's ({link.client_index})"
        if checks is not None:
            return checks.problem(request)
    elif name == "ABORT":
        if type(request) is not list or any(type(rid) is not str for rid in request):
            return "an ABORT must be a list of request id strings"
    elif (type(request) is not list or len(request) != 4 or type(request[0]) is not int
          or type(request[1]) is not int or type(request[2]) is not str or type(request[3]) not in (list, tuple)):
        return "a UTILITY must be [client_index, call_id, method name, args]"
    elif request[0] != link.client_index:
        return f"its client_index {request[0]!r} is not its frontend's ({link.client_index})"
    return None


def _refuse(self, link: _EngineLink, request_type, why: str, raw: Any, request_id: Any) -> None:
    """A request that cannot be handled fails alone (stock vLLM's input thread or busy
    loop would die): an ADD whose request id can still be read gets vLLM's
    request-scoped error output, a utility call whose call id can be read its failure
    reply, both on ``link``'s ring (whatever client index the message claims); the rest
    is logged and dropped."""
    from vllm.v1.engine import EngineCoreOutputs, EngineCoreRequestType, UtilityOutput

    client = link.client_index
    _log().error("shmclient.vllm: a %s request from frontend %d is refused: %s", request_type.name, client, why)
    if request_type == EngineCoreRequestType.ADD:
        if type(request_id) is str:
            self._send_error_outputs_to_client([request_id], client)
    elif request_type == EngineCoreRequestType.UTILITY and type(raw) is list and len(raw) == 4:
        call_id, method = raw[1], raw[2]
        if type(call_id) is int:
            failure = f"Call to {method!r} method failed: the request was refused: {why}"
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


def _process_output_sockets(self, output_paths, coord_output_path, engine_index):
    links: list = []
    # A failed attach fails the engine (ENGINE_CORE_DEAD), not this thread alone.
    _fatal_if_raises(self, "output", lambda: links.extend(_engine_links(engine_index, output_paths)))
    if not links:
        return _originals["out"](self, output_paths, coord_output_path, engine_index)
    _keep_signals_for_main_thread()
    _fatal_if_raises(self, "output", _serve_outputs, self, links, output_paths, coord_output_path, engine_index)


