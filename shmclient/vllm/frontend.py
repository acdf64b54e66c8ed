"""Frontend side of the plug-in: vLLM's ``SyncMPClient`` / ``AsyncMPClient`` with their
data frames on rings.

Imports vLLM's client module and the plug-in's ``wire``; nothing of the engine side. The
classes subclass vLLM's own, so construction (engine launch, handshake, ready response),
the engine monitor, ``shutdown`` and every utility method are vLLM's. What changes: the
two rings are created before the engine core process is started (their spec rides in its
environment), the names are unlinked once the engine has answered READY, requests are
encoded with vLLM's ``MsgpackEncoder`` into the request ring, and outputs are read from
the output ring. vLLM's PULL socket and its reader stay, for ENGINE_CORE_DEAD only.

* ``ShmSyncMPClient`` reads the ring in the caller's thread (``get_output`` and a
  ``call_utility`` waiting for its reply): no reader thread, no queue hand-off. Whoever
  reads resolves utility futures and queues outputs for ``get_output``.
* ``ShmAsyncMPClient`` reads it in a reader callback on the ring's wake pipe
  (``loop.add_reader``), which drains the ring in the loop iteration that saw the pipe
  readable; what it reads goes where vLLM's own output task puts it (``outputs_queue``,
  utility futures). Data parallelism (whose output handlers are coroutines) keeps
  vLLM's client.

Blocking: ``get_output`` blocks like vLLM's (until an output, or EngineDeadError within
about 0.1 s of the engine's death); sends block only while the request ring is full
(60 s at most, then PeerNotConsumingError).
"""

from __future__ import annotations

import asyncio
import collections
import os
import threading
import weakref
from concurrent.futures import Future
from typing import Any

from vllm.v1.engine import EngineCoreOutputs, EngineCoreRequestType
from vllm.v1.engine.core_client import AsyncMPClient, SyncMPClient, _process_utility_output
from vllm.v1.engine.exceptions import EngineDeadError

from ..errors import ClientClosedError, PeerDeadError, PeerNotProducingError
from ..ring import Ring
from . import wire

__all__ = ["ShmAsyncMPClient", "ShmSyncMPClient"]

SEND_TIMEOUT_S = 60.0
_spawn_lock = threading.Lock()  # the spec travels in os.environ while an engine starts


def _env_float(name: str, default: float) -> float:
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {text!r}") from None


class _Rings:
    """The frontend's ends: producer of requests, consumer of outputs (with a wake FIFO
    for the async client). Owned by a finalizer, not by the client."""

    def __init__(self, wake_fd: bool) -> None:
        capacity = int(_env_float("SHMCLIENT_VLLM_RING_BYTES", 4 << 20))
        self.spin_us = _env_float("SHMCLIENT_VLLM_SPIN_US", 50.0)
        self.output_mode = os.environ.get("SHMCLIENT_VLLM_ENGINE_OUTPUT", "inline")
        if self.output_mode not in ("thread", "inline"):
            raise ValueError(f"SHMCLIENT_VLLM_ENGINE_OUTPUT must be 'thread' or 'inline', got {self.output_mode!r}")
        self.requests = Ring.create("producer", capacity, spin_us=self.spin_us)
        try:
            self.outputs = Ring.create("consumer", capacity, spin_us=self.spin_us, consumer_wake_fd=wake_fd)
        except BaseException:
            self.requests.close()
            raise

    def spec_text(self) -> str:
        return wire.encode_spec(self.requests, self.outputs, self.spin_us, self.output_mode)

    def unlink(self) -> None:
        self.requests.unlink()
        self.outputs.unlink()

    def close(self) -> None:
        self.requests.close()
        self.outputs.close()


def _start_with_rings(rings: _Rings, construct) -> None:
    """Run vLLM's client construction with the spec in the environment while it starts
    the engine core process, then unlink the names (the engine attached before READY)."""
    with _spawn_lock:
        os.environ[wire.ENV_SPEC] = rings.spec_text()
        try:
            construct()
        finally:
            os.environ.pop(wire.ENV_SPEC, None)
    rings.unlink()


class _RingIO:
    """Send and receive vLLM messages on the rings (shared by both clients)."""

    def _init_rings(self, wake_fd: bool, construct) -> None:
        self._rings = rings = _Rings(wake_fd)
        self._rings_finalizer = weakref.finalize(self, rings.close)
        try:
            _start_with_rings(rings, construct)
        except BaseException:
            self._rings_finalizer()
            raise
        self._partial: list = []
        self._alive = self._make_alive()

    def _make_alive(self):
        resources = self.resources
        return lambda: not resources.engine_dead

    def _ring_send(self, request_type: EngineCoreRequestType, request: Any) -> None:
        self.ensure_alive()
        frames = self.encoder.encode(request)
        try:
            if len(frames) == 1:
                self._rings.requests.send(request_type.value[0], frames[0], timeout=SEND_TIMEOUT_S, alive=self._alive)
            else:
                self._rings.requests.send_batch(
                    wire.frames_to_records(request_type.value[0], frames), timeout=SEND_TIMEOUT_S, alive=self._alive
                )
        except (PeerDeadError, ClientClosedError):
            self.resources.engine_dead = True
            raise EngineDeadError() from None

    def _decode(self, records) -> list[EngineCoreOutputs]:
        out = []
        for _, frames in wire.split_messages(records, self._partial):
            if len(frames) > 1:
                frames = [frames[0], *(bytearray(f) for f in frames[1:])]
            out.append(self.decoder.decode(frames))
        return out

    def _close_rings(self) -> None:
        self._rings_finalizer()


class ShmSyncMPClient(_RingIO, SyncMPClient):
    """vLLM's SyncMPClient with requests and outputs on shared-memory rings."""

    def __init__(self, vllm_config, executor_class, log_stats: bool, renderer=None) -> None:
        self._pending: collections.deque = collections.deque()
        self._read_lock = threading.Lock()
        self._init_rings(
            False, lambda: SyncMPClient.__init__(self, vllm_config, executor_class, log_stats, renderer=renderer)
        )

    # -- reading (in the caller's thread)
    def _pump(self, timeout: float) -> None:
        """Read what the ring holds (waiting up to ``timeout``); utility replies resolve
        their futures, outputs queue for get_output. Caller holds _read_lock."""
        try:
            records = self._rings.outputs.recv(timeout=timeout, alive=self._alive)
        except PeerNotProducingError:
            return
        except (PeerDeadError, ClientClosedError):
            self.resources.engine_dead = True
            self._fail_utilities()
            raise EngineDeadError(suppress_context=True) from None
        for outputs in self._decode(records):
            if outputs.utility_output:
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
            self._close_rings()


class ShmAsyncMPClient(_RingIO, AsyncMPClient):
    """vLLM's AsyncMPClient with requests and outputs on shared-memory rings."""

    def __init__(self, vllm_config, executor_class, log_stats: bool, client_addresses=None,
                 client_count: int = 1, client_index: int = 0, renderer=None) -> None:
        self._ring_task: asyncio.Task | None = None
        self._init_rings(
            True,
            lambda: AsyncMPClient.__init__(
                self, vllm_config, executor_class, log_stats, client_addresses, client_count, client_index,
                renderer=renderer,
            ),
        )

    def _ensure_output_queue_task(self) -> None:
        super()._ensure_output_queue_task()  # vLLM's socket task: ENGINE_CORE_DEAD
        if self._ring_task is not None or not hasattr(self, "_rings"):
            return
        self._ring_task = asyncio.create_task(
            _read_outputs(weakref.ref(self), self._rings, self.resources, self.outputs_queue,
                          self.utility_results, type(self)),
            name="ShmEngineCoreOutputTask",
        )

    def _send_input(self, request_type, request, engine=None):
        self._ring_send(request_type, request)
        return _done()

    def _send_input_message(self, message, engine):
        # vLLM builds (type, *frames) itself for utility calls.
        self.ensure_alive()
        request_type, *frames = message
        kind = bytes(request_type)[0]
        try:
            self._rings.requests.send_batch(
                wire.frames_to_records(kind, frames), timeout=SEND_TIMEOUT_S, alive=self._alive
            )
        except (PeerDeadError, ClientClosedError):
            self.resources.engine_dead = True
            raise EngineDeadError() from None
        return _done()

    def shutdown(self, timeout: float | None = None) -> None:
        try:
            super().shutdown(timeout)
        finally:
            task = self._ring_task
            if task is not None and not task.done():
                loop = task.get_loop()
                if loop.is_closed():
                    self._close_rings()
                else:
                    # The task closes the rings itself once cancelled (on its loop).
                    try:
                        running = asyncio.get_running_loop()
                    except RuntimeError:
                        running = None
                    if running is loop:
                        task.cancel()
                    else:
                        loop.call_soon_threadsafe(task.cancel)
            else:
                self._close_rings()


def _done() -> asyncio.Future:
    fut = asyncio.get_running_loop().create_future()
    fut.set_result(None)
    return fut


async def _read_outputs(client_ref, rings: _Rings, resources, outputs_queue, utility_results, cls) -> None:
    """Read the output ring from the event loop: a reader callback on the ring's wake pipe
    drains the ring and dispatches like vLLM's output task, in the same loop iteration
    that saw the pipe readable (no task wake-up in between). This task only owns the
    callback's lifetime: it ends when the callback fails or the task is cancelled
    (shutdown), and then removes the callback and closes the rings on the loop."""
    from vllm.v1.engine import FT_STATUS_CALL_ID

    loop = asyncio.get_running_loop()
    ring = rings.outputs
    fd = ring.fileno()
    failed: asyncio.Future = loop.create_future()
    partial: list = []
    client = client_ref()
    decoder = client.decoder if client is not None else None
    del client

    def dispatch(outputs: EngineCoreOutputs) -> None:
        if outputs.utility_output:
            if outputs.utility_output.call_id == FT_STATUS_CALL_ID:
                client = client_ref()
                if client is not None and outputs.utility_output.result is not None:
                    client._engine_status[outputs.engine_index] = outputs.utility_output.result.result
            else:
                _process_utility_output(outputs.utility_output, utility_results)
        elif outputs.outputs or outputs.scheduler_stats:
            outputs_queue.put_nowait(outputs)

    def on_readable() -> None:
        if failed.done():
            return
        try:
            while True:
                ring.drain_wake_fd()
                try:
                    records = ring.try_recv()
                except (PeerDeadError, ClientClosedError):
                    raise EngineDeadError() from None
                if not records:
                    return
                for _, frames in wire.split_messages(records, partial):
                    if len(frames) > 1:
                        frames = [frames[0], *(bytearray(f) for f in frames[1:])]
                    dispatch(decoder.decode(frames))
        except BaseException as e:  # noqa: BLE001 - handed to the owning task
            loop.remove_reader(fd)
            failed.set_exception(e)

    if decoder is None:
        return
    loop.add_reader(fd, on_readable)
    try:
        on_readable()  # whatever arrived before the callback was in place
        await failed
    except asyncio.CancelledError:
        outputs_queue.put_nowait(EngineDeadError())
    except Exception as e:
        outputs_queue.put_nowait(e)
    finally:
        for call_id in list(utility_results):
            future = utility_results.pop(call_id, None)
            if future is not None and not future.done():
                future.set_exception(EngineDeadError())
        loop.remove_reader(fd)
        rings.close()
