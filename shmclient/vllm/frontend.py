"""Frontend side of the plug-in: vLLM's ``SyncMPClient`` / ``AsyncMPClient`` with their
data frames on a ``ShmChannel``.

Imports vLLM's client module, ``shmclient.channel`` and ``shmclient.waiting`` and the
plug-in's ``wire`` and ``oob``; nothing of the engine side, no ring end. The classes
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
  per-output hook unchanged): ``get_output_async`` reads the rings itself, spins for at most
  ``SHMCLIENT_VLLM_ASYNC_SPIN_US`` (adaptive, and only where the spin gate lets it), then
  parks; a reader callback on the ring's wake pipe reads while it is parked (and for
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
import os
import threading
import weakref
from concurrent.futures import Future
from time import monotonic, perf_counter
from typing import Any

from vllm.v1.engine import EngineCoreOutputs, EngineCoreRequestType
from vllm.v1.engine.core_client import AsyncMPClient, DPLBAsyncMPClient, SyncMPClient, _process_utility_output
from vllm.v1.engine.exceptions import EngineDeadError

from .. import _ring, waiting
from ..channel import BadMessage, ShmChannel
from ..doorbell import Spin
from ..errors import ClientClosedError, PeerDeadError, PeerNotProducingError, WouldBlock
from ..shm import Segment
from . import oob
from . import wire

__all__ = ["ShmAsyncMPClient", "ShmDPLBAsyncMPClient", "ShmSyncMPClient"]

SEND_TIMEOUT_S = 60.0
#: How long (µs) get_output_async may spin on the output ring, holding the event loop,
#: before it parks; adapted like the rings' own spins (doorbell.Spin).
ASYNC_SPIN_ENV = "SHMCLIENT_VLLM_ASYNC_SPIN_US"
ASYNC_SPIN_US = 50.0
#: "0" switches off the engine's early wake-up of a parked async frontend.
PREWAKE_ENV = "SHMCLIENT_VLLM_PREWAKE"
#: Output mode "inline": the engine's busy loop writes a batch of at most this many outputs
#: itself; bigger ones (a saturated engine) go through its output thread, off the busy
#: loop's path between two steps.
INLINE_MAX_ENV = "SHMCLIENT_VLLM_INLINE_MAX_OUTPUTS"
INLINE_MAX_OUTPUTS = 16
PAGE_BYTES = 4096
#: Tensor arena per direction (bytes; 0: tensors go as ring frames, as vLLM's own).
ARENA_ENV = "SHMCLIENT_VLLM_ARENA_BYTES"
ARENA_BYTES = 32 << 20
TENSOR_MIN_ENV = "SHMCLIENT_VLLM_TENSOR_MIN_BYTES"
CUDA_IPC_ENV = "SHMCLIENT_VLLM_CUDA_IPC"
_spawn_lock = threading.Lock()  # the spec travels in os.environ while an engine starts


def _env_float(name: str, default: float) -> float:
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {text!r}") from None


class _Link:
    """The frontend's end of the channel to its engine (plus the "parked" flag of the
    async client). Owned by a finalizer, not by the client."""

    def __init__(self, wake_fd: bool, engine_index: int = 0) -> None:
        self.engine_index = engine_index
        self.engine_pid: int | None = None
        capacity = int(_env_float("SHMCLIENT_VLLM_RING_BYTES", 4 << 20))
        spin_us = _env_float("SHMCLIENT_VLLM_SPIN_US", 50.0)
        self.output_mode = os.environ.get("SHMCLIENT_VLLM_ENGINE_OUTPUT", "inline")
        if self.output_mode not in ("thread", "inline"):
            raise ValueError(f"SHMCLIENT_VLLM_ENGINE_OUTPUT must be 'thread' or 'inline', got {self.output_mode!r}")
        self.inline_max_outputs = int(_env_float(INLINE_MAX_ENV, INLINE_MAX_OUTPUTS))
        if self.inline_max_outputs < 0:
            raise ValueError(f"{INLINE_MAX_ENV} must be >= 0, got {self.inline_max_outputs}")
        prewake = os.environ.get(PREWAKE_ENV, "1")
        if prewake not in ("0", "1"):
            raise ValueError(f"{PREWAKE_ENV} must be '0' or '1', got {prewake!r}")
        arena = int(_env_float(ARENA_ENV, ARENA_BYTES))
        self.tensor_min_bytes = int(_env_float(TENSOR_MIN_ENV, oob.TENSOR_MIN_BYTES))
        cuda_ipc = os.environ.get(CUDA_IPC_ENV, "1")
        if cuda_ipc not in ("0", "1") or arena < 0 or self.tensor_min_bytes < 0:
            raise ValueError(
                f"{CUDA_IPC_ENV} must be '0' or '1', {ARENA_ENV} and {TENSOR_MIN_ENV} >= 0; "
                f"got {cuda_ipc!r}, {arena}, {self.tensor_min_bytes}"
            )
        self.arenas = arena > 0
        self.framing: wire.VllmFraming | None = None

        def framing(tx, rx):
            self.framing = wire.VllmFraming(tx, rx, side="frontend", tensor_min_bytes=self.tensor_min_bytes,
                                            cuda_ipc=cuda_ipc == "1", arenas=self.arenas)
            return self.framing

        self.channel, self.spec = ShmChannel.create(
            ring_capacity=capacity, arena_bytes=arena, spin_us=spin_us, wake_fd=wake_fd,
            enable_cuda_ipc=cuda_ipc == "1", framing=framing)
        # No peer GPUs until the engine's GPUS record says which it sees: host copies.
        self.channel.set_peer_gpus([])
        self.parked: Segment | None = None
        try:
            if wake_fd and prewake == "1":
                # One byte the engine reads: 1 while get_output_async is parked (see _AsyncReader).
                self.parked = Segment.create(PAGE_BYTES, prefix="shmc-vllm-parked")
        except BaseException:
            self.close()
            raise
        self.parked_flag = self.parked.buf if self.parked is not None else bytearray(1)

    def engine_spec(self) -> wire.EngineSpec:
        gpus: list[str] = []
        try:
            import torch

            if torch.cuda.is_initialized():  # never create a CUDA context here for this
                from ..tensors_cuda import local_gpu_uuids

                gpus = local_gpu_uuids()
        except ImportError:
            pass
        return wire.EngineSpec(
            channel=self.spec, frontend_pid=os.getpid(), output_mode=self.output_mode,
            parked=self.parked.name if self.parked is not None else "", arenas=self.arenas,
            tensor_min_bytes=self.tensor_min_bytes, frontend_gpus=gpus,
            inline_max_outputs=self.inline_max_outputs, engine_index=self.engine_index)

    def attached(self, engine_pid: int | None) -> None:
        """The engine has attached: release the handles; its one-off tensor handles must
        name its own segments from now on."""
        self.channel.peer_attached()
        self.engine_pid = engine_pid
        if engine_pid is not None:
            self.channel.set_peer_pid(engine_pid)
        if self.parked is not None:
            self.parked.release_handle()

    def on_control(self, rtype: int, obj: Any) -> bool:
        """Handle a message that is not vLLM's outputs; False if it is one."""
        if rtype == wire.GPUS:
            if not isinstance(obj, BadMessage):
                self.channel.set_peer_gpus(list(obj))
            return True
        return False

    def close(self) -> None:
        self.channel.close()
        if self.parked is not None:
            self.parked_flag = bytearray(1)
            self.parked.release_handle()
            self.parked.close()


def _start_with_links(links: "list[_Link]", construct) -> None:
    """Run vLLM's client construction with the specs in the environment while it starts
    the engine core processes (each takes the one naming its engine index)."""
    with _spawn_lock:
        os.environ[wire.ENV_SPEC] = wire.encode_specs([link.engine_spec() for link in links])
        try:
            construct()
        finally:
            os.environ.pop(wire.ENV_SPEC, None)


def _engine_pids(client) -> dict[int, int]:
    """Engine index -> pid of the engine core processes vLLM started here (named
    ``EngineCore`` alone, ``EngineCore_DP<index>`` with data parallelism)."""
    pids: dict[int, int] = {}
    try:
        processes = list(client.resources.engine_manager.processes)
    except (AttributeError, TypeError):
        return pids
    for proc in processes:
        name = getattr(proc, "name", "")
        if name == "EngineCore":
            pids[0] = proc.pid
        elif name.startswith("EngineCore_DP") and name[len("EngineCore_DP"):].isdigit():
            pids[int(name[len("EngineCore_DP"):])] = proc.pid
    return pids


def _close_links(links: "list[_Link]") -> None:
    for link in links:
        link.close()


class _LinkIO:
    """Send and receive vLLM messages over the channels, one per engine (shared by the
    clients)."""

    def _init_link(self, wake_fd: bool, construct, engine_indexes: "tuple[int, ...]" = (0,)) -> None:
        links: list[_Link] = []
        self._link_finalizer = weakref.finalize(self, _close_links, links)
        try:
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
        if len(links) == 1 and links[0].arenas and not self._own_oob:
            # vLLM's encoder with the arena as its out-of-band path. With several engines
            # each has its own arena: requests are encoded for their engine's
            # (``_encode``); vLLM's encoder (utility calls) keeps tensors in line.
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

    def _init_async(self, construct, engine_indexes: "tuple[int, ...]" = (0,)) -> None:
        self._ring_tasks: list[asyncio.Task] = []
        self._readers: list[_AsyncReader] = []
        #: Per engine index: messages waiting for room in its request ring, oldest
        #: first, and the task that sends them (sends keep their order, as on vLLM's
        #: socket).
        self._backlogs: dict[int, collections.deque] = {}
        self._backlog_tasks: dict[int, asyncio.Task] = {}
        self._init_link(True, construct, engine_indexes)
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
        if len(self._readers) > 1:
            self._readers[0].spin_channels = [r.channel for r in self._readers]
        for reader in self._readers:
            self._ring_tasks.append(asyncio.create_task(
                _own_reader(reader), name=f"ShmEngineCoreOutputTask_{reader.link.engine_index}"))

    async def get_output_async(self) -> EngineCoreOutputs:
        """The next output batch. Reads the rings in this task: what is there is returned
        at once; else spins on them for at most the spin budget (holding the loop);
        else parks until a wake pipe's callback has read something. Raises
        EngineDeadError (or the output reader's error) as vLLM's does."""
        self._ensure_output_queue_task()
        readers = self._readers
        inbox = self.outputs_queue
        items = inbox.items
        if not items and readers:
            for reader in readers:
                reader.read_now()
            if not items and readers[0].spin_for_output():
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
        self.ensure_alive()
        link = self._link_for(engine)
        return self._send_frames(link, request_type.value[0], self._encode(link, request))

    def _send_input_message(self, message, engine):
        # vLLM builds (type, *frames) itself for utility calls.
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
                if task.done():
                    continue
                loop = task.get_loop()
                if loop.is_closed():
                    continue
                try:
                    running = asyncio.get_running_loop()
                except RuntimeError:
                    running = None
                if running is loop:
                    task.cancel()
                else:
                    loop.call_soon_threadsafe(task.cancel)
            if not self._ring_tasks:
                self._close_link()
            for task, reader in zip(self._ring_tasks, self._readers):
                if task.done() or task.get_loop().is_closed():
                    reader.link.close()
                # else the reader task closes its channel itself once cancelled (on its loop)


    def _fail_readers_soon(self) -> None:
        for task, reader in zip(self._ring_tasks, self._readers):
            loop = task.get_loop()
            if task.done() or loop.is_closed():
                continue
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is loop:
                reader._fail(EngineDeadError())
            else:
                loop.call_soon_threadsafe(reader._fail, EngineDeadError())


class ShmAsyncMPClient(_AsyncRings, AsyncMPClient):
    """vLLM's AsyncMPClient with requests and outputs on shared-memory rings."""

    def __init__(self, vllm_config, executor_class, log_stats: bool, client_addresses=None,
                 client_count: int = 1, client_index: int = 0, renderer=None) -> None:
        self._init_async(lambda: AsyncMPClient.__init__(
            self, vllm_config, executor_class, log_stats, client_addresses, client_count, client_index,
            renderer=renderer))


class ShmDPLBAsyncMPClient(_AsyncRings, DPLBAsyncMPClient):
    """vLLM's DPLBAsyncMPClient (data parallelism, internal load balancing) with one
    pair of rings per engine core this frontend starts. Engine selection, the DP
    coordinator's request counts and waves, aborts routed to the owning engine and
    utilities to every engine are vLLM's; what travels between this frontend and its
    engines goes over the rings (the coordinator's messages stay on ZMQ)."""

    def __init__(self, vllm_config, executor_class, log_stats: bool, client_addresses=None,
                 client_count: int = 1, client_index: int = 0, renderer=None) -> None:
        dp_size = vllm_config.parallel_config.data_parallel_size
        self._init_async(
            lambda: DPLBAsyncMPClient.__init__(
                self, vllm_config, executor_class, log_stats, client_addresses, client_count, client_index,
                renderer=renderer),
            tuple(range(dp_size)))


def _done(loop: asyncio.AbstractEventLoop) -> asyncio.Future:
    fut = loop.create_future()
    fut.set_result(None)
    return fut


class _Inbox:
    """Stands in for vLLM's ``outputs_queue`` (an asyncio.Queue): outputs and errors in
    order, and at most one parked ``get_output_async``, woken by ``put_nowait`` or by the
    ring reader. Used from the loop's thread only (as vLLM's queue is)."""

    __slots__ = ("items", "waiter")

    def __init__(self) -> None:
        self.items: collections.deque = collections.deque()
        self.waiter: asyncio.Future | None = None

    def put_nowait(self, item) -> None:
        self.items.append(item)
        self.wake()

    def wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def empty(self) -> bool:
        return not self.items

    def qsize(self) -> int:
        return len(self.items)


class _AsyncReader:
    """Reads the output ring on the event loop's thread, from ``get_output_async`` (the
    fast path) and from the wake pipe's reader callback (a parked waiter, utility replies
    nobody awaits as outputs). Dispatches as vLLM's output task does."""

    def __init__(self, client_ref, link: _Link, inbox: _Inbox, utility_results, handler=None) -> None:
        self.client_ref = client_ref
        self.link = link
        self.channel = link.channel
        #: the channels ``spin_for_output`` watches (all the client's, on its first reader)
        self.spin_channels = [self.channel]
        #: vLLM's per-output hook of the client class (its DP clients'), or None
        self.handler = handler
        self.inbox = inbox
        self.utility_results = utility_results
        self.stopped = False
        self.failed: asyncio.Future | None = None  # set by the owning task
        self.parked_at: float | None = None
        self.spin = Spin(_env_float(ASYNC_SPIN_ENV, ASYNC_SPIN_US) * 1e-6)
        # Whether the engine's early wake-up pays: spins after it that end in the
        # outputs. Backs off (and probes now and then) like the rings' own spins.
        self.prewake = Spin(self.spin.base if link.parked is not None else 0.0)
        self.armed = False
        self.prewake_hits = self.prewake_misses = 0
        self.wakes = self.empty_wakes = 0  # callbacks; those that found nothing to do

    def read_now(self) -> int:
        """Decode and dispatch every message the ring holds now; never blocks. On a dead
        or closed channel the error goes to the inbox (once) and the callback stops."""
        if self.stopped:
            return 0
        try:
            messages = self.channel.try_recv()
        except (PeerDeadError, ClientClosedError):
            self._fail(EngineDeadError())
            return 0
        except BaseException as e:  # noqa: BLE001 - handed to the waiter
            self._fail(e)
            return 0
        link = self.link
        for rtype, outputs in messages:
            if link.on_control(rtype, outputs):
                continue
            if isinstance(outputs, BadMessage):  # as vLLM's output task: the error ends it
                self._fail(RuntimeError(f"an engine output did not decode: {outputs.error}"))
                break
            self._dispatch(outputs)
        return len(messages)

    def _dispatch(self, outputs: EngineCoreOutputs) -> None:
        from vllm.v1.engine import FT_STATUS_CALL_ID

        if outputs.utility_output:
            if outputs.utility_output.call_id == FT_STATUS_CALL_ID:
                client = self.client_ref()
                if client is not None and outputs.utility_output.result is not None:
                    client._engine_status[outputs.engine_index] = outputs.utility_output.result.result
            else:
                _process_utility_output(outputs.utility_output, self.utility_results)
        else:
            if self.handler is not None:
                client = self.client_ref()
                if client is None:
                    return
                _run_to_end(self.handler(client, outputs))
            if outputs.outputs or outputs.scheduler_stats:
                self.inbox.items.append(outputs)

    def spin_for_output(self) -> bool:
        """Spin (holding the loop) until a record is there, for at most the adaptive
        budget, never more than the configured spin; True if one came."""
        spin = self.spin
        budget = min(spin.budget, spin.base)
        if budget <= 0.0:
            spin.after(False, 0.0)  # counts towards the next probe
            return False
        if self._spin_until(budget):
            spin.after(True, 0.0)
            return True
        self.parked_at = perf_counter()
        return False

    def arm_prewake(self) -> bool:
        """Whether to let the engine wake this parked task early (see ``on_readable``)."""
        prewake = self.prewake
        if not _ring.gate.allows(monotonic()):
            # the early wake-up pays only by a spin for the publish, and the spin gate
            # says spinning does not pay on this host now: one wake per batch instead
            self.armed = False
        elif prewake.budget <= 0.0:
            prewake.after(False, 0.0)  # backed off: counts towards the next probe
            self.armed = False
        else:
            self.armed = True
        return self.armed

    def _spin_until(self, budget: float) -> bool:
        # The ring's own spin: it stops at once where the spin gate says spinning does
        # not pay on this host now (shmclient/_spin_gate.h), and never sleeps here.
        channels = self.spin_channels
        if len(channels) > 1:
            return _spin_any(channels, budget)
        channel = self.channel
        if channel.readable():
            return True
        if budget <= 0.0:
            return False
        return channel.wait_recv(0.0, spin=budget) and channel.readable()

    def on_readable(self) -> None:
        # Read before re-arming: re-arming first would write a byte for the record that
        # woke us while it is still unread, and wake us once more for nothing. Read,
        # then re-arm: a record published in between is seen by the re-arm (it writes
        # the byte itself), so no wake-up is lost.
        self.wakes += 1
        n = self.read_now()
        try:
            self.channel.arm_recv()
        except (ClientClosedError, OSError):
            pass
        inbox = self.inbox
        waiter = inbox.waiter
        if not n and waiter is not None and not inbox.items and self.armed and not self.link.parked_flag[0]:
            # The engine cleared our parked flag: its early wake-up, it is about to
            # publish. Spin for it for at most the configured spin; else the publish
            # wakes us again.
            self.armed = False
            if self._spin_until(self.prewake.base):
                n = self.read_now()
                self.prewake.after(True, 0.0)
                self.prewake_hits += 1
            else:
                self.prewake.after(False, 0.0)
                self.prewake_misses += 1
        elif not n:
            self.empty_wakes += 1
        if n and waiter is not None:
            inbox.wake()
            parked_at = self.parked_at
            if parked_at is not None:
                # Woken just after the spin gave up: the spin policy stretches or backs off.
                self.spin.after_block(perf_counter() - parked_at)
                self.parked_at = None

    def _fail(self, e: BaseException) -> None:
        if self.stopped:
            return
        self.stopped = True
        if self.failed is not None and not self.failed.done():
            self.failed.set_result(None)
        self.inbox.put_nowait(e if isinstance(e, Exception) else EngineDeadError())


def _spin_any(channels: list, budget: float) -> bool:
    """Spin (holding the loop) until one of ``channels`` has a record, for at most
    ``budget`` seconds, and only while the rings' spin gate says spinning pays on this
    host now."""
    for channel in channels:
        if channel.readable():
            return True
    if budget <= 0.0 or not _ring.gate.allows(monotonic()):
        return False
    end = perf_counter() + budget
    while perf_counter() < end:
        for channel in channels:
            if channel.readable():
                return True
    return False


def _run_to_end(coro) -> None:
    """Run a coroutine that never suspends (vLLM's per-output hooks await nothing) to its
    end, here. One that suspends is a vLLM this was not written against: RuntimeError."""
    try:
        coro.send(None)
    except StopIteration:
        return
    coro.close()
    raise RuntimeError("shmclient.vllm: vLLM's output hook awaited; this vLLM's DP client is not supported")


def _watch_engine(loop: asyncio.AbstractEventLoop, reader: _AsyncReader) -> int | None:
    """Watch the engine's process (a pidfd, readable once it has exited): when it dies,
    the client is dead and the reader fails at once. vLLM's own engine monitor notices
    too, but with several engines it first waits for the others to stop (seconds) before
    failing the client. None where the kernel has no pidfd (vLLM's monitor then)."""
    pid = reader.link.engine_pid
    if pid is None or not hasattr(os, "pidfd_open"):
        return None
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return None

    def exited() -> None:
        loop.remove_reader(pidfd)
        client = reader.client_ref()
        if client is not None:
            client.resources.engine_dead = True
        reader._fail(EngineDeadError())

    loop.add_reader(pidfd, exited)
    return pidfd


async def _own_reader(reader: _AsyncReader) -> None:
    """Own the wake pipe's reader callback: in place until the reader fails or the task
    is cancelled (shutdown); then fail pending utility calls, remove the callback and
    close the channel, on the loop."""
    loop = asyncio.get_running_loop()
    fd = reader.channel.recv_fd()
    reader.failed = failed = loop.create_future()
    inbox = reader.inbox
    loop.add_reader(fd, reader.on_readable)
    pidfd = _watch_engine(loop, reader)
    try:
        if not reader.stopped:
            reader.on_readable()  # whatever arrived before the callback was in place
            await failed  # the error is in the inbox already
    except asyncio.CancelledError:
        reader.stopped = True
        inbox.put_nowait(EngineDeadError())
    finally:
        failed.cancel()
        utility_results = reader.utility_results
        for call_id in list(utility_results):
            future = utility_results.pop(call_id, None)
            if future is not None and not future.done():
                future.set_exception(EngineDeadError())
        loop.remove_reader(fd)
        if pidfd is not None:
            loop.remove_reader(pidfd)
            os.close(pidfd)
        reader.link.close()
