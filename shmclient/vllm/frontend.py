"""Frontend side of the plug-in: vLLM's ``SyncMPClient`` / ``AsyncMPClient`` with their
data frames on a ``ShmChannel``.

Imports vLLM's client module, ``shmclient.waiting`` and the plug-in's ``wire``, ``link``
(one engine's channel) and ``reader`` (the async clients' output readers); nothing of the
engine side, no ring end. The classes
subclass vLLM's own, so construction (engine launch, handshake, ready response), the
engine monitor, ``shutdown`` and every utility method are vLLM's. What changes: a
channel per engine is created before the engine core processes are started (their specs
ride in the engines' environment) and its handles released once the engines have
answered READY;
requests are encoded by vLLM's encoder into the request ring, outputs read from the output
ring. vLLM's PULL socket and its reader stay, for ENGINE_CORE_DEAD only.

* ``ShmSyncMPClient`` reads the ring in the caller's thread (``get_output`` and a
  ``call_utility`` waiting for its reply), through ``waiting.recv``: no reader thread, no
  queue hand-off. Sends wait (``waiting.send``) while the request ring is full, at most
  ``SEND_TIMEOUT_S``, then PeerNotConsumingError.
* ``ShmAsyncMPClient`` (one engine) and ``ShmDPLBAsyncMPClient`` (data parallelism, one
  channel per engine, all read into one inbox; vLLM's engine selection, coordinator and
  per-output hook unchanged): ``get_output_async`` reads the rings itself, spins (one
  engine only) for at most ``SHMCLIENT_VLLM_ASYNC_SPIN_US`` (adaptive, and only where the
  spin gate lets it), then parks; a reader callback on the ring's wake pipe reads while it is parked (and for
  utility replies). The engine may wake a parked task early, as its scheduler starts
  building a step's outputs (a one-byte "parked" flag in shared memory;
  ``SHMCLIENT_VLLM_PREWAKE=0`` switches it off). Sends never hold the event loop: a
  message that finds the ring full waits in a backlog that one task sends in order,
  parked on the ring's space pipe (``waiting.send_async``).

Blocking: ``get_output`` blocks like vLLM's (until an output, or EngineDeadError within
about 0.1 s of the engine's death); nothing of the async clients blocks the loop, and they
watch each engine's process (a pidfd on the loop): an engine's death fails them at once,
where vLLM's own monitor first waits for the other engines to stop.
"""
from __future__ import annotations

import asyncio
import collections
import threading
import weakref
from concurrent.futures import Future
from typing import Any

from vllm.v1.engine import EngineCoreOutputs, EngineCoreRequestType
from vllm.v1.engine.core_client import AsyncMPClient, DPLBAsyncMPClient, SyncMPClient, _process_utility_output
from vllm.v1.engine.exceptions import EngineDeadError

from .. import waiting
from ..channel import BadMessage
from ..errors import ClientClosedError, PeerDeadError, PeerNotProducingError, WouldBlock
from . import wire
from .link import _close_links, _engine_pids, _Link, _start_with_links
from .reader import _AsyncReader, _Inbox, _own_reader

__all__ = ["ShmAsyncMPClient", "ShmDPLBAsyncMPClient", "ShmSyncMPClient"]

SEND_TIMEOUT_S = 60.0


class _LinkIO:
    """Send and receive vLLM messages over the channels, one per engine (shared by the
    clients)."""

    def _init_link(self, wake_fd: bool, construct, engine_indexes: "tuple[int, ...]" = (0,),
                   frontend_specs: "list[wire.FrontendSpec] | None" = None) -> None:
        """Make a channel per engine and run vLLM's construction (which starts the
        engines) with their specs in the environment; or, with ``frontend_specs`` (an
        API server of several), attach to the channels the launcher made."""
        links: list[_Link] = []
        self._link_finalizer = weakref.finalize(self, _close_links, links)
        try:
            if frontend_specs is not None:
                for spec in frontend_specs:
                    links.append(_Link(wake_fd, frontend_spec=spec))
                construct()
            else:
                for index in engine_indexes:
                    links.append(_Link(wake_fd, index))
                _start_with_links(links, construct)
            pids = _engine_pids(self)
            for link in links:
                link.attached(pids.get(link.engine_index))
        except BaseException:
            self._link_finalizer()
            raise
        #: engine identity (vLLM's: its index, 2 bytes little-endian) -> its link
        self._links = {link.engine_index.to_bytes(2, "little"): link for link in links}
        self._link = links[0]
        self._alive = self._make_alive()
        #: vLLM's encoder had an out-of-band path of its own (its multimodal tensor queue)
        self._own_oob = self.encoder.oob_tensor_consumer is not None
        if len(links) == 1 and links[0].arenas and not self._own_oob and not getattr(self, "_remote", ()):
            # vLLM's encoder with the arena as its out-of-band path. With several engines
            # each has its own arena: requests are encoded for their engine's
            # (``_encode``); vLLM's encoder (utility calls, and everything to an engine on
            # another node) keeps tensors in line.
            self.encoder = links[0].framing.encoder

    def _link_for(self, engine) -> _Link:
        return self._link if engine is None else self._links[engine]

    def _encode(self, link: _Link, request: Any) -> list:
        """vLLM's frames of ``request`` for ``link``'s engine (large tensors in its arena)."""
        if link.arenas and not self._own_oob:
            return link.framing.encoder.encode(request)
        return self.encoder.encode(request)

    def _make_alive(self):
        resources = self.resources
        return lambda: not resources.engine_dead

    def _dead(self) -> EngineDeadError:
        self.resources.engine_dead = True
        return EngineDeadError()

    def _ring_send(self, request_type: EngineCoreRequestType, request: Any) -> None:
        """Send from this thread, waiting while the request ring is full (at most
        SEND_TIMEOUT_S, then PeerNotConsumingError); EngineDeadError once it is gone."""
        self.ensure_alive()
        rtype, payload = wire.message(request_type.value[0], self._encode(self._link, request))
        try:
            waiting.send(self._link.channel, rtype, payload, timeout=SEND_TIMEOUT_S, alive=self._alive)
        except (PeerDeadError, ClientClosedError):
            raise self._dead() from None

    def _close_link(self) -> None:
        self._link_finalizer()


class ShmSyncMPClient(_LinkIO, SyncMPClient):
    """vLLM's SyncMPClient with requests and outputs on shared-memory rings."""

    def __init__(self, vllm_config, executor_class, log_stats: bool, renderer=None) -> None:
        self._pending: collections.deque = collections.deque()
        self._read_lock = threading.Lock()
        self._init_link(
            False, lambda: SyncMPClient.__init__(self, vllm_config, executor_class, log_stats, renderer=renderer)
        )

    # -- reading (in the caller's thread)
    def _pump(self, timeout: float) -> None:
        """Read what the ring holds (waiting up to ``timeout``); utility replies resolve
        their futures, outputs queue for get_output. Caller holds _read_lock."""
        try:
            messages = waiting.recv(self._link.channel, timeout=timeout, alive=self._alive)
        except PeerNotProducingError:
            return
        except (PeerDeadError, ClientClosedError):
            self.resources.engine_dead = True
            self._fail_utilities()
            raise EngineDeadError(suppress_context=True) from None
        link = self._link
        for rtype, outputs in messages:
            if link.on_control(rtype, outputs):
                continue
            if isinstance(outputs, BadMessage):  # as vLLM's reader thread: the error goes to get_output
                self._pending.append(RuntimeError(f"an engine output did not decode: {outputs.error}"))
            elif outputs.utility_output:
                _process_utility_output(outputs.utility_output, self.utility_results)
            else:
                self._pending.append(outputs)

    def _fail_utilities(self) -> None:
        for call_id in list(self.utility_results):
            future = self.utility_results.pop(call_id, None)
            if future is not None and not future.done():
                future.set_exception(EngineDeadError())

    def get_output(self) -> EngineCoreOutputs:
        while not self._pending:
            if self.resources.engine_dead:
                raise EngineDeadError()
            with self._read_lock:
                if not self._pending:
                    self._pump(1.0)
        outputs = self._pending.popleft()
        if isinstance(outputs, Exception):
            raise self._format_exception(outputs) from None
        if outputs.wave_complete is not None:
            self.engines_running = False
        return outputs

    def _send_input(self, request_type: EngineCoreRequestType, request: Any) -> None:
        self._ring_send(request_type, request)

    def call_utility(self, method: str, *args) -> Any:
        import uuid

        call_id = uuid.uuid1().int >> 64
        future: Future = Future()
        self.utility_results[call_id] = future
        self._send_input(EngineCoreRequestType.UTILITY, (0, call_id, method, args))
        while not future.done():
            if self._read_lock.acquire(timeout=0.05):
                try:
                    if not future.done():
                        self._pump(0.05)
                finally:
                    self._read_lock.release()
            else:  # another thread is reading and resolves our future
                try:
                    return future.result(timeout=0.05)
                except TimeoutError:
                    if self.resources.engine_dead:
                        self._fail_utilities()
        return future.result()

    def shutdown(self, timeout: float | None = None) -> None:
        try:
            super().shutdown(timeout)
        finally:
            self._close_link()


class _AsyncRings(_LinkIO):
    """What the async clients (one engine, or several with data parallelism) change of
    vLLM's: one channel per engine, their outputs read into one inbox on the event
    loop's thread, requests sent to their engine's channel without holding the loop."""

    def _init_async(self, construct, engine_indexes: "tuple[int, ...]" = (0,),
                    frontend_specs: "list[wire.FrontendSpec] | None" = None) -> None:
        self._ring_tasks: list[asyncio.Task] = []
        self._readers: list[_AsyncReader] = []
        if not hasattr(self, "_remote"):
            self._remote: frozenset[bytes] = frozenset()
        #: Per engine index: messages waiting for room in its request ring, oldest
        #: first, and the task that sends them (sends keep their order, as on vLLM's
        #: socket).
        self._backlogs: dict[int, collections.deque] = {}
        self._backlog_tasks: dict[int, asyncio.Task] = {}
        self._init_link(True, construct, engine_indexes, frontend_specs)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass  # started lazily, as vLLM's
        else:
            self._ensure_output_queue_task()

    @property
    def _reader(self) -> "_AsyncReader | None":
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
        for link in self._links.values():
            reader = _AsyncReader(weakref.ref(self), link, self.outputs_queue, self.utility_results, handler)
            self._readers.append(reader)
        for reader in self._readers:
            self._ring_tasks.append(asyncio.create_task(
                _own_reader(reader), name=f"ShmEngineCoreOutputTask_{reader.link.engine_index}"))

    async def get_output_async(self) -> EngineCoreOutputs:
        """The next output batch. Reads the rings in this task: what is there is returned
        at once; else, with one engine, spins on its ring for at most the spin budget
        (holding the loop); else parks until a wake pipe's callback has read something. Raises
        EngineDeadError (or the output reader's error) as vLLM's does."""
        self._ensure_output_queue_task()
        readers = self._readers
        inbox = self.outputs_queue
        items = inbox.items
        if not items and readers:
            for reader in readers:
                reader.read_now()
            # Several engines: no spin. It would be a Python loop over their rings holding
            # the loop and the GIL; their wake-ups (and each engine's early one) serve.
            if not items and len(readers) == 1 and not self._remote and readers[0].spin_for_output():
                for reader in readers:
                    reader.read_now()
        while not items:
            waiter = asyncio.get_running_loop().create_future()
            inbox.waiter = waiter
            for reader in readers:
                if reader.arm_prewake():
                    reader.link.parked_flag[0] = 1  # its engine may now wake us before it publishes
            try:
                await waiter
            finally:
                inbox.waiter = None
                for reader in readers:
                    reader.link.parked_flag[0] = 0
        outputs = items.popleft()
        if isinstance(outputs, Exception):
            raise self._format_exception(outputs) from None
        return outputs

    def _send_input(self, request_type, request, engine=None):
        if engine in self._remote:  # an engine on another node: vLLM's socket
            return super()._send_input(request_type, request, engine)
        self.ensure_alive()
        link = self._link_for(engine)
        return self._send_frames(link, request_type.value[0], self._encode(link, request))

    def _send_input_message(self, message, engine):
        # vLLM builds (type, *frames) itself for utility calls.
        if engine in self._remote:
            return super()._send_input_message(message, engine)
        self.ensure_alive()
        request_type, *frames = message
        return self._send_frames(self._link_for(engine), bytes(request_type)[0], frames)

    def _send_frames(self, link: _Link, kind: int, frames) -> asyncio.Future:
        """Send one message to ``link``'s engine without holding the loop: at once when
        its request ring has room and nothing waits before it; else it queues behind the
        others and the returned future completes when it is sent (the backlog task parks
        on the ring's space pipe, at most SEND_TIMEOUT_S a message, then
        PeerNotConsumingError). Raises EngineDeadError at once when the engine is gone."""
        rtype, payload = wire.message(kind, frames)
        loop = asyncio.get_running_loop()
        key = link.engine_index
        backlog = self._backlogs.get(key)
        if not backlog:
            try:
                link.channel.send_nowait(rtype, payload)
            except WouldBlock:
                pass
            except (PeerDeadError, ClientClosedError):
                raise self._dead() from None
            else:
                return _done(loop)
        if backlog is None:
            backlog = self._backlogs[key] = collections.deque()
        sent = loop.create_future()
        backlog.append((rtype, payload, sent))
        task = self._backlog_tasks.get(key)
        if task is None or task.done():
            self._backlog_tasks[key] = loop.create_task(self._send_backlog(link, backlog),
                                                        name=f"ShmEngineCoreSendTask_{key}")
        return sent

    async def _send_backlog(self, link: _Link, backlog: collections.deque) -> None:
        channel = link.channel
        while backlog:
            rtype, payload, sent = backlog[0]
            error: BaseException | None = None
            try:
                await waiting.send_async(channel, rtype, payload, timeout=SEND_TIMEOUT_S, alive=self._alive)
            except (PeerDeadError, ClientClosedError):
                error = self._dead()
            except asyncio.CancelledError:
                error = EngineDeadError()
                raise
            except Exception as e:  # noqa: BLE001 - handed to whoever awaits the send
                error = e
            finally:
                backlog.popleft()
                if not sent.done():
                    if error is None:
                        sent.set_result(None)
                    else:
                        sent.set_exception(error)
                if isinstance(error, EngineDeadError):
                    while backlog:
                        f = backlog.popleft()[2]
                        if not f.done():
                            f.set_exception(EngineDeadError())

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
            for task in (*self._backlog_tasks.values(), *self._ring_tasks):
                _on_its_loop(task, task.cancel)
            if not self._ring_tasks:
                self._close_link()
            for task, reader in zip(self._ring_tasks, self._readers):
                if task.done() or task.get_loop().is_closed():
                    reader.link.close()
                # else the reader task closes its channel itself once cancelled (on its loop)


    def _fail_readers_soon(self) -> None:
        for task, reader in zip(self._ring_tasks, self._readers):
            _on_its_loop(task, reader._fail, EngineDeadError())


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
    """vLLM's DPLBAsyncMPClient (data parallelism, internal load balancing) with one
    pair of rings per engine core of this node (made here, or by the launcher:
    ``frontend_specs``; ``local``: their DP ranks, default all). Engine selection, the DP
    coordinator's request counts and waves, aborts routed to the owning engine and
    utilities to every engine are vLLM's; what travels between this frontend and its
    engines of this node goes over the rings. The coordinator's messages, and everything
    to and from engines on other nodes, stay on vLLM's ZMQ sockets."""

    def __init__(self, vllm_config, executor_class, log_stats: bool, client_addresses=None,
                 client_count: int = 1, client_index: int = 0, renderer=None,
                 frontend_specs: "list[wire.FrontendSpec] | None" = None,
                 local: "list[int] | None" = None) -> None:
        dp_size = vllm_config.parallel_config.data_parallel_size
        local = list(range(dp_size)) if local is None else local
        #: Engines on other nodes (vLLM's identities): their messages go over vLLM's sockets.
        self._remote = frozenset(rank.to_bytes(2, "little") for rank in range(dp_size) if rank not in local)
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
