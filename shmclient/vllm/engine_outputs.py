"""The engine core's output side: where its ``EngineCoreOutputs`` are written.

Imports ``zmq``, vLLM (inside functions), the process's spin gate (``channel.SPIN_GATE``)
and the plug-in's ``wire``, ``engine_link`` and ``versions`` (which busy loops output mode
"adaptive" hooks). ``_InlineOutputs`` stands in for ``EngineCoreProc.output_queue`` in
output modes "inline" and "adaptive" (see its docstring); ``_serve_outputs`` is the output
IO thread's body: vLLM's PUSH sockets only for ENGINE_CORE_DEAD (one per frontend), the DP
coordinator's socket for its messages, every output batch to the ring of the frontend it
belongs to (vLLM's client index). ``_prewake_before_outputs`` wakes parked frontends as
the scheduler starts building a step's outputs.
"""

from __future__ import annotations

import queue
import threading
import time

import zmq

from ..channel import SPIN_GATE
from . import wire
from .engine_link import _EngineLink, _log, drain


def _prewake_before_outputs(self, links: "list[_EngineLink]") -> None:
    """Wake the parked frontends when the scheduler starts turning a step's model output
    into EngineCoreOutputs (measured ~15 us before they are stamped, ~35 us before they
    are published on this machine)."""
    scheduler = self.scheduler
    update = scheduler.update_from_output
    inline = getattr(self, "_shmclient_inline", None)
    # Output mode "adaptive" with its deferred wake-ups: no early wake while no CPU is free
    # (the outputs' own wake-up then waits for the next step, see _defer_wakes).
    free_cpu = inline._free_cpu if inline is not None and inline.step_follows is not None else None
    if len(links) == 1:
        prewake = links[0].prewake

        def update_from_output(*args, **kwargs):
            if free_cpu is None or free_cpu(time.monotonic()):
                prewake()
            return update(*args, **kwargs)
    else:
        # Several frontends: wake only those this engine sent outputs to since the last
        # step (their requests are running); a frontend whose requests have all finished
        # would spin for nothing. A request's first output wakes its frontend on publish.
        def update_from_output(*args, **kwargs):
            if free_cpu is None or free_cpu(time.monotonic()):
                for link in links:
                    if link.active:
                        link.active = False
                        link.prewake()
            return update(*args, **kwargs)

    scheduler.update_from_output = update_from_output


def _defer_wakes(engine, inline: "_InlineOutputs") -> bool:
    """Hook the busy loop so that ``inline`` may hold a batch's wake-up back until the
    next step is on its way (output mode "adaptive" on a host without a free CPU): the
    frontend then takes its CPU time while the busy loop waits for vLLM's worker, not
    while the busy loop builds the step the worker waits for. With vLLM's multiprocess
    executor the owed wake-ups go once ``execute_model`` has handed the step over (it
    returns a future at once); with another executor (which may run the step in the
    call), just before it. The busy loop gives them too before it may block for input
    (nothing to step). False (nothing hooked: ``inline`` then sends such batches to the
    output thread) when this vLLM lacks what the hooks need, or steps through a batch
    queue (several steps in flight: a step need not start after each output)."""
    executor = getattr(engine, "model_executor", None)
    execute = getattr(executor, "execute_model", None)
    process_input = getattr(engine, "_process_input_queue", None)
    has_work = getattr(engine, "has_work", None)
    has_requests = getattr(getattr(engine, "scheduler", None), "has_requests", None)
    if (execute is None or process_input is None or has_work is None or has_requests is None
            or getattr(engine, "batch_queue", None) is not None):
        return False
    wake_owed = inline.wake_owed
    if hasattr(executor, "rpc_broadcast_mq"):
        def execute_model(*args, **kwargs):
            try:
                return execute(*args, **kwargs)
            finally:
                wake_owed()
    else:
        def execute_model(*args, **kwargs):
            wake_owed()
            return execute(*args, **kwargs)

    def _process_input_queue(*args, **kwargs):
        inline.loop_thread = threading.get_ident()  # the busy loop's (it starts here)
        if inline.owing and not has_work():
            wake_owed()  # no step to hand over: the loop may block for input now
        return process_input(*args, **kwargs)

    executor.execute_model = execute_model
    engine._process_input_queue = _process_input_queue
    inline.step_follows = has_requests
    return True


def _hook_adaptive(engine, inline: "_InlineOutputs", verdict=None) -> bool:
    """``_defer_wakes`` where this vLLM's busy loop is one its hooks were written against
    (``versions.check_adaptive``, or ``verdict``); otherwise one WARNING naming what
    differs, and nothing hooked: output mode "adaptive" then sends the batches it would
    hold a wake-up for to the output thread (a vLLM whose loop could step without
    handing the hooks a chance to give the wake-up would otherwise leave a frontend
    parked until the next step or input). An engine core that steps through a batch
    queue is not hooked either: its batches are written and wake at once (``inline``).
    True when hooked."""
    if verdict is None:
        from .versions import Verdict, check_adaptive

        try:
            from vllm import __version__

            verdict = check_adaptive(__version__)
        except Exception as e:  # the check must not take the engine down: no hooks then
            verdict = Verdict(False, None, [repr(e)], f"vLLM's busy loop could not be checked ({e!r})")
    if not verdict.ok:
        _log().warning("shmclient.vllm: %s: output mode adaptive holds no wake-up back (while no CPU is free, "
                       "its output batches go through the output thread)", verdict.message)
        return False
    if getattr(engine, "batch_queue", None) is not None:
        # vLLM's step_with_batch_queue puts a step's outputs after it has handed the
        # worker the next step (or found none to hand over): what adaptive waits for has
        # happened by then, so the write wakes at once.
        inline.wake_at_once()
        _log().info("shmclient.vllm: output mode adaptive: this engine core steps through a batch queue (vLLM's "
                    "async scheduling or pipeline parallelism), so its next step is on its way when a step's "
                    "outputs are put: they wake the frontend at once, as with output mode inline")
        return False
    if _defer_wakes(engine, inline):
        _log().info("shmclient.vllm: output mode adaptive: while no CPU is free, an output batch's wake-up waits "
                    "for the next step (%s)", verdict.message)
        return True
    _log().warning("shmclient.vllm: output mode adaptive: this engine core lacks what its hooks need: while no CPU "
                   "is free, its output batches go through the output thread")
    return False


_inline_lock = threading.Lock()


def _inline_outputs(engine, links: "list[_EngineLink]") -> "_InlineOutputs":
    """The one _InlineOutputs of this engine (made by whichever IO thread asks first)."""
    with _inline_lock:
        inline = getattr(engine, "_shmclient_inline", None)
        if inline is None:
            spec = links[0].spec
            inline = engine._shmclient_inline = _InlineOutputs(links, engine.engine_index, spec.inline_max_outputs,
                                                               adaptive=spec.output_mode == "adaptive")
        return inline


class _InlineOutputs:
    """Stands in for ``EngineCoreProc.output_queue``. ``put_nowait`` encodes the outputs
    and writes them to their frontend's ring (vLLM's client index) in the calling thread
    (the busy loop, or a utility's completion callback) when that is cheap: a batch of
    at most ``inline_max`` outputs while the output thread has nothing queued. A bigger
    batch, everything after it until the output thread has written it, and
    ENGINE_CORE_DEAD go to ``queue`` for the output thread (``serve_queued``): the busy
    loop never encodes a large batch on its critical path, and nothing overtakes what is
    queued.

    ``adaptive``: a batch is written with its wake-up at once only while ``gate`` (the
    process's spin gate, ``channel.SPIN_GATE``) finds a CPU free for the frontend it wakes. On a
    host without one, a frontend woken from the busy loop competes with the busy loop for
    a CPU before it has handed vLLM the next step: a served vLLM's streamed tokens came
    5-10 ms apart (p50) against stock's 3-4 at 20 requests/s on a busy 2-CPU host,
    3.2-4.0 ms with every batch written by the output thread (measured 2026-12-04; the
    README's "Measured" section has the later runs). So then, once ``_defer_wakes`` has
    hooked the busy loop (``step_follows`` set), the batch is still written here but its
    wake-up waits until the busy loop has handed the next step to vLLM's executor
    (``wake_owed``), or comes at once when no step follows or a thread other than the
    busy loop puts the batch (``loop_thread``); without the hooks the batch goes to the
    output thread, and on an engine core with a batch queue it is written and wakes at
    once (``wake_at_once``, see ``_hook_adaptive``)."""

    def __init__(self, links: "list[_EngineLink]", engine_index: int, inline_max: int, *,
                 adaptive: bool = False, gate=None) -> None:
        self._links = links
        self._engine_index = engine_index
        self._inline_max = inline_max
        self._free_cpu = (SPIN_GATE if gate is None else gate).free_cpu if adaptive else None
        #: Set by _defer_wakes: whether the busy loop will hand another step to the
        #: executor (and so call wake_owed) before it can block.
        self.step_follows = None
        #: The busy loop's thread (set by _defer_wakes' hook): only its batches may hold
        #: their wake-up back; another thread's (the input thread's error outputs) may
        #: come while the busy loop is blocked for input, with no wake_owed to follow.
        self.loop_thread: int | None = None
        self.owing = False  # a batch was written without its wake-up, not yet given
        self._buffers = [bytearray() for _ in links]  # the ring copies it: reusable unless kept
        self._send_locks = [threading.Lock() for _ in links]  # vLLM's encoder is not thread-safe
        self._count_lock = threading.Lock()
        self._queued = 0  # output batches put in ``queue`` and not yet written
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.inline = self.offloaded = 0  # batches written each way
        self.deferred = 0  # of the inline ones, those whose wake-up waited for the next step

    def put_nowait(self, item) -> None:
        if isinstance(item, bytes):  # ENGINE_CORE_DEAD: after what is queued
            self.wake_owed()
            self.queue.put(item)
            return
        client_index, outputs = item
        if client_index == -1:
            # For the DP coordinator (its ZMQ socket, owned by the output thread); no
            # order to keep with the frontend's outputs, so it holds none of them back.
            outputs.engine_index = self._engine_index
            self.queue.put(_ForCoordinator(outputs))
            return
        big = len(outputs.outputs) > self._inline_max
        free_cpu = self._free_cpu  # asked only for a batch that could go inline
        busy = not big and free_cpu is not None and not free_cpu(time.monotonic())
        wake = True
        if busy and self.step_follows is not None:
            busy = False
            # A utility's reply, or a batch from outside the busy loop, comes from outside
            # a step: its wake-up is never held.
            wake = (getattr(outputs, "utility_output", None) is not None or threading.get_ident() != self.loop_thread
                    or not self.step_follows())
        with self._count_lock:
            offload = big or busy or self._queued > 0
            if offload:
                self._queued += 1
        if offload:
            self.queue.put((client_index, outputs))
        else:
            self.send(client_index, outputs, wake=wake)

    put = put_nowait

    def send(self, client_index: int, outputs, *, queued: bool = False, wake: bool = True) -> None:
        """Encode and write one EngineCoreOutputs to frontend ``client_index`` in this
        thread (dropped, with an error logged, for a frontend this engine has not);
        ``wake=False``: its wake-up waits for ``wake_owed``."""
        outputs.engine_index = self._engine_index
        if not (isinstance(client_index, int) and 0 <= client_index < len(self._links)):
            _log().error("shmclient.vllm: outputs for frontend %r dropped: this engine serves %d",
                         client_index, len(self._links))
            return
        link = self._links[client_index]
        link.active = True
        with self._send_locks[client_index]:
            try:
                frames = link.framing.encoder.encode_into(outputs, self._buffers[client_index])
            except Exception as e:
                frames = self._encode_failed_reply(link, client_index, outputs, e)
            if link.send(wire.OUTPUTS, frames, wake=wake, placed=link.framing.take_placed()):
                # Kept for the link's flusher (the frontend's ring is full): the payload
                # may be the buffer itself, so the next batch gets another.
                self._buffers[client_index] = bytearray()
            if not wake:
                # After the write (an IO thread may put an error output while the busy
                # loop gives the owed wake-ups): a wake_owed that ran before it finds this.
                self.owing = True
            if queued:
                self.offloaded += 1
            else:
                self.inline += 1
                if not wake:
                    self.deferred += 1

    def _encode_failed_reply(self, link, client_index: int, outputs, error: Exception):
        """A utility's result vLLM's encoder cannot carry (an engine object, a worker's
        plain Python object without ``VLLM_ALLOW_INSECURE_SERIALIZATION``): that call
        fails alone, as when the method raises. Stock vLLM's output thread dies there
        (its client waits for good); raising here would kill the engine and every
        request on it. Anything else that does not encode is raised."""
        reply = getattr(outputs, "utility_output", None)
        if reply is None or reply.failure_message is not None:
            raise error
        _log().warning("shmclient.vllm: the result of utility call %s cannot be sent: %s",
                       reply.call_id, error)
        outputs.utility_output = type(reply)(
            call_id=reply.call_id,
            failure_message=f"Call to a utility method failed: its result cannot be sent to the "
                            f"client: {error}")
        return link.framing.encoder.encode_into(outputs, self._buffers[client_index])

    def wake_at_once(self) -> None:
        """Write a small batch from the thread that puts it and wake its frontend at once
        whatever the host's load, as output mode "inline" (adaptive on an engine core
        that steps through a batch queue, see ``_hook_adaptive``)."""
        self._free_cpu = None

    def wake_owed(self) -> None:
        """Give every frontend the wake-up its batches' writes held back (if any)."""
        if self.owing:
            self.owing = False
            for link in self._links:
                link.wake_owed()

    def serve_queued(self, dead_sockets, coordinator=None) -> None:
        """The output thread's loop: write what ``put_nowait`` queued, in order, until
        ENGINE_CORE_DEAD, which goes on each of ``dead_sockets``; messages for the DP
        coordinator go to ``coordinator`` (a callable)."""
        while True:
            item = self.queue.get()
            if isinstance(item, bytes):
                drain(self._links)  # what full rings held back goes first, as it was put
                for socket in dead_sockets:
                    socket.send(item)
                return
            if isinstance(item, _ForCoordinator):
                coordinator(item.outputs)
                continue
            try:
                self.send(*item, queued=True)
            finally:
                with self._count_lock:
                    self._queued -= 1

    def serve_output_queue(self, output_queue, dead: bytes, dead_sockets, coordinator=None) -> None:
        """Output mode "thread": the output thread's loop over vLLM's own output queue,
        writing every batch, until ENGINE_CORE_DEAD (``dead``), which goes on each of
        ``dead_sockets`` after what full rings held back."""
        while True:
            output = output_queue.get()
            if output == dead:
                drain(self._links)  # what full rings held back goes first, as it was put
                for socket in dead_sockets:
                    socket.send(output)
                return
            client_index, outputs = output
            if client_index == -1:
                outputs.engine_index = self._engine_index
                coordinator(outputs)
                continue
            self.send(client_index, outputs)

    def empty(self) -> bool:
        return not self._queued


class _ForCoordinator:
    """An output for the DP coordinator in the output thread's queue."""

    __slots__ = ("outputs",)

    def __init__(self, outputs) -> None:
        self.outputs = outputs


def _serve_outputs(self, links: "list[_EngineLink]", output_paths: list, coord_path: str | None,
                   engine_index: int) -> None:
    from contextlib import ExitStack

    from vllm.utils.network_utils import make_zmq_socket
    from vllm.v1.engine.core import EngineCoreProc
    from vllm.v1.serial_utils import MsgpackEncoder

    dead = EngineCoreProc.ENGINE_CORE_DEAD
    with ExitStack() as stack, zmq.Context() as ctx:
        dead_sockets = [stack.enter_context(make_zmq_socket(ctx, path, zmq.PUSH, linger=4000))
                        for path in output_paths]
        to_coordinator = None
        if coord_path is not None:
            # The DP coordinator's stats and wave notices stay on its ZMQ socket, as vLLM's.
            coord_socket = stack.enter_context(make_zmq_socket(ctx, coord_path, zmq.PUSH, bind=False, linger=4000))
            encoder = MsgpackEncoder()
            to_coordinator = lambda outputs: coord_socket.send_multipart(encoder.encode(outputs))  # noqa: E731

        inline = _inline_outputs(self, links)
        if links[0].spec.output_mode != "thread":
            # The input thread put the inline object in place of output_queue.
            inline.serve_queued(dead_sockets, to_coordinator)
            return
        inline.serve_output_queue(self.output_queue, dead, dead_sockets, to_coordinator)
