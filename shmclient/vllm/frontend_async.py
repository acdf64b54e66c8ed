"""The plug-in's async clients: vLLM's ``AsyncMPClient`` (one engine) and
``DPLBAsyncMPClient`` (data parallelism) with their data frames on ``ShmChannel``s.

Imports vLLM's client module, ``shmclient.waiting``, the plug-in's ``frontend`` (the
channels, ``_LinkIO``), ``link`` and ``reader`` (the output readers); nothing of the engine
side, no ring end. One channel per engine of this node, all read into one inbox (vLLM's
engine selection, coordinator and per-output hook unchanged; engines on other nodes keep
vLLM's sockets). ``get_output_async`` reads the rings itself, spins (one engine only) for
at most ``SHMCLIENT_VLLM_ASYNC_SPIN_US`` (adaptive, and only where the spin gate lets it),
then parks; a reader callback on each ring's wake pipe reads while it is parked (and for
utility replies). The engine may wake a parked task early, as its scheduler starts
building a step's outputs (a one-byte "parked" flag in shared memory;
``SHMCLIENT_VLLM_PREWAKE=0`` switches it off). Sends never hold the event loop: a message
that finds the ring full, or others waiting before it, takes its turn and a task sends
it, parked on the ring's space pipe (``waiting.OrderedSendsAsync``). The clients watch
each engine's process (a pidfd on the loop): an engine's death fails them at once, where
vLLM's own monitor first waits for the other engines to stop.
"""

from __future__ import annotations

import asyncio
import functools
import weakref

from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.engine.core_client import AsyncMPClient, DPLBAsyncMPClient
from vllm.v1.engine.exceptions import EngineDeadError

from ..errors import ClientClosedError, PeerDeadError, PeerNotConsumingError, ProtocolError
from . import wire
from .frontend import NOT_SENT, SEND_TIMEOUT_S, _LinkIO, _message, _undelivered
from .link import _Link
from .reader import _EngineReader, _Inbox, _own_reader, park_all, reader_task_ended

__all__ = ["ShmAsyncMPClient", "ShmDPLBAsyncMPClient"]


class _AsyncRings(_LinkIO):
    """What the async clients (one engine, or several with data parallelism) change of
    vLLM's: one channel per engine, their outputs read into one inbox on the event
    loop's thread, requests sent to their engine's channel without holding the loop."""

    def _init_async(self, construct, engine_indexes: "tuple[int, ...]" = (0,),
                    frontend_specs: "list[wire.FrontendSpec] | None" = None) -> None:
        self._ring_tasks: list[asyncio.Task] = []
        self._readers: list[_EngineReader] = []
        if not hasattr(self, "_remote"):
            self._remote: frozenset[bytes] = frozenset()
        self._init_link(True, construct, engine_indexes, frontend_specs)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass  # started lazily, as vLLM's
        else:
            self._ensure_output_queue_task()

    @property
    def _reader(self) -> "_EngineReader | None":
        return self._readers[0] if self._readers else None

    def _ensure_output_queue_task(self) -> None:
        if self.resources.output_queue_task is None and not isinstance(self.outputs_queue, _Inbox):
            # vLLM's socket task (ENGINE_CORE_DEAD only) and the ring readers all put here.
            self.outputs_queue = _Inbox()
        super()._ensure_output_queue_task()
        if self._ring_tasks or not hasattr(self, "_alive"):
            return  # (not before _init_link has set up the channels)
        # vLLM's per-output hook of its DP clients (request counts for load balancing)
        handler = getattr(type(self), "process_engine_outputs", None)
        loop = asyncio.get_running_loop()
        for link in self._links.values():
            reader = _EngineReader(weakref.ref(self), link, self.outputs_queue, self.utility_results, handler)
            reader.loop_reader.bind(loop)
            self._readers.append(reader)
        self.outputs_queue.readers = self._readers  # what an error from vLLM's socket comes after
        for reader in self._readers:
            task = asyncio.create_task(_own_reader(reader), name=f"ShmEngineCoreOutputTask_{reader.link.engine_index}")
            task.add_done_callback(functools.partial(reader_task_ended, reader))
            self._ring_tasks.append(task)

    async def get_output_async(self) -> EngineCoreOutputs:
        """The next output batch. Reads the rings in this task: what is there is returned
        at once (a task not suspended for ``LoopReader.YIELD_EVERY_S`` yields to the loop
        first); else, with one engine, its reader spins on the ring for at most the spin
        budget (holding the loop), then parks until the wake pipe's callback has read
        something. Raises EngineDeadError (or the output reader's error) as vLLM's does."""
        self._ensure_output_queue_task()
        readers = self._readers
        inbox = self.outputs_queue
        items = inbox.items
        # vLLM's output handler awaits this in a loop and yields nowhere else (but between
        # chunks of a large batch): while the engine keeps outputs coming, it would never
        # suspend, starving the loop's other tasks (HTTP, streams).
        if readers and readers[0].loop_reader.turn_due():
            await asyncio.sleep(0)
        if not items and readers:
            if len(readers) == 1 and not self._remote:
                await readers[0].loop_reader.wait(items.__len__, None)
            else:
                # Several engines: no spin. It would be a Python loop over their rings
                # holding the loop and the GIL; their wake-ups (and each engine's early
                # one) serve.
                for reader in readers:
                    reader.loop_reader.read_now(0.0)
                while not items:
                    if any(reader.stopped for reader in readers):
                        raise EngineDeadError()  # its error was taken by an earlier call
                    await park_all(readers, inbox.parking)
                    readers[0].loop_reader.turn_due()  # suspended: that was its turn
        while not items:  # no ring reader yet: vLLM's socket task (ENGINE_CORE_DEAD) only
            await inbox.parking.park(asyncio.get_running_loop(), None)
        outputs = items.popleft()
        if isinstance(outputs, Exception):
            raise self._format_exception(outputs) from None
        return outputs

    def _send_input(self, request_type, request, engine=None):
        if engine in self._remote:  # an engine on another node: vLLM's socket
            return super()._send_input(request_type, request, engine)
        self.ensure_alive()
        link = self._link_for(engine)
        add = self._finishable(request_type, request)
        return self._send_frames(link, request_type.value[0], *self._encode(link, request), add)

    def _send_input_message(self, message, engine):
        # vLLM builds (type, *frames) itself for utility calls.
        if engine in self._remote:
            return super()._send_input_message(message, engine)
        self.ensure_alive()
        request_type, *frames = message
        link = self._link_for(engine)
        return self._send_frames(link, bytes(request_type)[0], frames, self._placed_by(link))

    def _send_frames(self, link: _Link, kind: int, frames, placed: list,
                     add: "str | None" = None) -> asyncio.Future:
        """Send one message to ``link``'s engine (``placed``: the handles its encode
        placed in the link's arena) without holding the loop: at once when its request
        ring has room and nothing waits before it; else it takes its turn behind the
        others (each link's ``sends`` keeps the order of sends, as vLLM's socket does)
        and a task sends it, parked on the ring's space pipe, at most SEND_TIMEOUT_S
        from now, then PeerNotConsumingError. The returned future says how it went; a
        caller that stops waiting for it (cancelled) does not stop the send. Raises
        EngineDeadError at once when the engine is gone. ``add``: the message is that
        request's ADD (``_finishable``); one that times out finishes the request with an
        error in the outputs (``frontend._undelivered``)."""
        rtype, payload = _message(link, kind, frames, placed)
        try:
            pending = link.sends.start(rtype, payload, SEND_TIMEOUT_S, self._send_failed(link, rtype, payload, add))
        except (PeerDeadError, ClientClosedError):
            link.channel.discard(rtype, payload)
            raise self._dead() from None
        except ProtocolError as e:  # the engine broke the request ring's protocol
            raise self._request_ring_broken(e) from None
        return _done(asyncio.get_running_loop()) if pending is None else pending

    def _send_failed(self, link: _Link, rtype: int, payload, add: "str | None" = None):
        """What a queued send of ``payload`` raises for what ended it; a message that
        never went gives its tensors' blocks back, and a request's ADD that timed out
        finishes that request with an error (loop thread)."""

        def failed(e: BaseException) -> BaseException:
            if isinstance(e, (*NOT_SENT, ClientClosedError, asyncio.CancelledError)):
                link.channel.discard(rtype, payload)  # its tensors' blocks come back now
            if add is not None and isinstance(e, PeerNotConsumingError):
                self._finish_undelivered(link, add, e)
            if isinstance(e, asyncio.CancelledError):  # (shutdown)
                return EngineDeadError()
            if isinstance(e, (PeerDeadError, ClientClosedError)):
                return self._dead()
            if isinstance(e, ProtocolError):
                return self._request_ring_broken(e)
            return e

        return failed

    def _finish_undelivered(self, link: _Link, request_id: str, e: BaseException) -> None:
        """Hand ``link``'s reader the output that finishes ``request_id`` with an error
        (vLLM's per-output hook runs on it: a DP client's in-flight count drops)."""
        self._ensure_output_queue_task()
        reader = next((r for r in self._readers if r.link is link), None)
        if reader is None or reader.stopped:
            return  # (its engine is gone: its requests end with EngineDeadError)
        reader._dispatch(_undelivered(link.engine_index, request_id, e))
        self.outputs_queue.parking.wake()

    def shutdown(self, timeout: float | None = None) -> None:
        if self.resources.engine_dead:
            # vLLM's engine monitor found an engine dead and shuts the client down: its
            # engine manager waits for the other engines to stop (seconds) before the
            # output tasks are cancelled. Fail the readers now, so that every caller
            # gets EngineDeadError at once.
            self._fail_readers_soon()
        try:
            super().shutdown(timeout)
        finally:
            links = getattr(self, "_links", {}).values()  # (none while vLLM's construction failed)
            sending = [task for link in links if link.sends is not None for task in link.sends.tasks()]
            for task in (*sending, *self._ring_tasks):
                _on_its_loop(task, task.cancel)
            if not self._ring_tasks:
                self._close_link()
            for task, reader in zip(self._ring_tasks, self._readers):
                if task.done() or task.get_loop().is_closed():
                    reader.link.close()
                # else the reader task closes its channel itself once cancelled (on its loop)


    def _fail_readers_soon(self) -> None:
        for task, reader in zip(self._ring_tasks, self._readers):
            _on_its_loop(task, reader.fail, EngineDeadError())


class ShmAsyncMPClient(_AsyncRings, AsyncMPClient):
    """vLLM's AsyncMPClient with requests and outputs on shared-memory rings.
    ``frontend_specs``: the channels a launcher made for this API server (one of
    several); else it makes its own for the engine it starts."""

    def __init__(self, vllm_config, executor_class, log_stats: bool, client_addresses=None,
                 client_count: int = 1, client_index: int = 0, renderer=None,
                 frontend_specs: "list[wire.FrontendSpec] | None" = None) -> None:
        self._init_async(lambda: AsyncMPClient.__init__(
            self, vllm_config, executor_class, log_stats, client_addresses, client_count, client_index,
            renderer=renderer), frontend_specs=frontend_specs)


class ShmDPLBAsyncMPClient(_AsyncRings, DPLBAsyncMPClient):
    """vLLM's DPLBAsyncMPClient (data parallelism, internal or hybrid load balancing)
    with one pair of rings per engine core of this node (made here, or by the launcher:
    ``frontend_specs``; ``local``: their DP ranks, default all). Engine selection, the DP
    coordinator's request counts and waves, aborts routed to the owning engine and
    utilities to every engine are vLLM's; what travels between this frontend and its
    engines of this node goes over the rings. The coordinator's messages, and everything
    to and from engines on other nodes, stay on vLLM's ZMQ sockets."""

    def __init__(self, vllm_config, executor_class, log_stats: bool, client_addresses=None,
                 client_count: int = 1, client_index: int = 0, renderer=None,
                 frontend_specs: "list[wire.FrontendSpec] | None" = None,
                 local: "list[int] | None" = None) -> None:
        from . import local_only

        parallel = vllm_config.parallel_config
        dp_size = parallel.data_parallel_size
        local = list(range(dp_size)) if local is None else local
        #: Engines on other nodes (vLLM's identities): their messages go over vLLM's sockets.
        #: With hybrid load balancing there are none: those nodes have API servers of their own.
        self._remote = frozenset() if local_only(parallel) else frozenset(
            rank.to_bytes(2, "little") for rank in range(dp_size) if rank not in local)
        self._init_async(
            lambda: DPLBAsyncMPClient.__init__(
                self, vllm_config, executor_class, log_stats, client_addresses, client_count, client_index,
                renderer=renderer),
            tuple(local), frontend_specs)


def _on_its_loop(task: asyncio.Task, fn, *args) -> None:
    """Call ``fn(*args)`` on ``task``'s loop (now, when that is this thread's running
    loop; else soon, thread-safely), unless the task is done or its loop closed."""
    loop = task.get_loop()
    if task.done() or loop.is_closed():
        return
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        fn(*args)
    else:
        loop.call_soon_threadsafe(fn, *args)


def _done(loop: asyncio.AbstractEventLoop) -> asyncio.Future:
    fut = loop.create_future()
    fut.set_result(None)
    return fut
