"""How the plug-in's async clients read their engines' output rings on the event loop.

Imports vLLM's exceptions, the spin gate (``channel.SPIN_GATE``), ``shmclient.waiting``
and the plug-in's ``link`` and ``frontend`` (how utility replies, messages that did not
decode and messages whose handling failed are handed on, as by the sync client); no ring
end. Each engine's ring is read by ``waiting.LoopReader`` with the plug-in's options:
``_EngineReader`` passes it vLLM's dispatch (what vLLM's output task does with a batch,
into one ``_Inbox`` shared by every engine's reader, whose ``Parking`` they share) and the
engine's early wake-up (``_EarlyWake``, over the one-byte "parked" flag); ``_own_reader``
is the task that owns the reader's callback and the engine's pidfd.
"""

from __future__ import annotations

import asyncio
import collections
import os
import threading
from time import monotonic

from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.engine.exceptions import EngineDeadError

from .. import waiting
from ..channel import SPIN_GATE, BadMessage
from ..doorbell import Spin
from .frontend import _bad_reply, _dispatch_failed, _utility_reply
from .link import _Link

#: How long (µs) get_output_async may spin on the output ring, holding the event loop,
#: before it parks; adapted like the rings' own spins (doorbell.Spin).


class _Inbox:
    """Stands in for vLLM's ``outputs_queue`` (an asyncio.Queue): outputs and errors in
    order; ``put_nowait`` (vLLM's socket task) and ``put`` (a failing ring reader) wake the
    tasks parked in ``parking``, which the ring readers wake after each read. Loop thread
    only (as vLLM's queue).

    ``readers``: the ring readers feeding it (the client's list). An error from vLLM's
    socket task (ENGINE_CORE_DEAD) goes in after what their rings hold: an engine core
    that fails by an exception writes its last outputs to its ring before it sends
    ENGINE_CORE_DEAD on the socket, and on vLLM's one socket those outputs would come
    first."""

    __slots__ = ("items", "parking", "readers")

    def __init__(self, readers: "list[_EngineReader] | None" = None) -> None:
        self.items: collections.deque = collections.deque()
        self.parking = waiting.Parking()
        self.readers = readers if readers is not None else []

    def put_nowait(self, item) -> None:
        if isinstance(item, BaseException):
            for reader in self.readers:
                reader.read_remains()
        self.put(item)

    def put(self, item) -> None:
        self.items.append(item)
        self.parking.wake()

    def empty(self) -> bool:
        return not self.items

    def qsize(self) -> int:
        return len(self.items)


class _EarlyWake:
    """The engine's early wake-up of a parked task (``waiting.EarlyWake``): while armed,
    the "parked" flag is 1; the engine clears it and writes the wake byte as its scheduler
    starts a step's outputs, so the task's wake-up overlaps the engine's encoding. It pays
    only by a spin for the publish: armed only where the spin gate lets this process spin
    now, and backed off (probing now and then) when those spins miss."""

    def __init__(self, link: _Link, spin_s: float) -> None:
        self.link = link
        self.spin = Spin(spin_s)
        self.armed = False
        self.hits = self.misses = 0

    def arm(self) -> None:
        spin = self.spin
        if not SPIN_GATE.allows(monotonic()):
            self.armed = False  # spinning does not pay on this host now: one wake per batch
        elif spin.budget <= 0.0:
            spin.after(False, 0.0)  # backed off: counts towards the next probe
            self.armed = False
        else:
            self.armed = True
            self.link.parked_flag[0] = 1

    def disarm(self) -> None:
        self.link.parked_flag[0] = 0

    def fired(self) -> float:
        if self.armed and not self.link.parked_flag[0]:  # the engine cleared it: its early wake
            self.armed = False
            # Armed before the host turned busy (a task parked for long): no spin now.
            return self.spin.base if SPIN_GATE.allows(monotonic()) else 0.0
        return 0.0

    def after(self, paid: bool) -> None:
        self.spin.after(paid, 0.0)
        if paid:
            self.hits += 1
        else:
            self.misses += 1


class _EngineReader:
    """One engine's output ring, read on the loop's thread by a ``waiting.LoopReader``
    (from ``get_output_async``, and from the wake pipe's callback: a parked task, utility
    replies nobody awaits as outputs). Dispatches as vLLM's output task does, except that
    a message whose handling raises is logged and dropped (the others go on) and a utility
    reply that does not decode fails its call alone. A failure (the engine's death, a
    broken channel, outputs that do not decode) stops it and queues the error, after what
    the engine wrote before dying."""

    def __init__(self, client_ref, link: _Link, inbox: _Inbox, utility_results, handler=None) -> None:
        self.client_ref = client_ref
        self.link = link
        #: vLLM's per-output hook of the client class (its DP clients'), or None
        self.handler = handler
        self.inbox = inbox
        self.utility_results = utility_results
        self.stopped = False
        self.draining = False  # reading the dead engine's last outputs (fail with remains)
        self.failed: asyncio.Future | None = None  # set by the owning task
        spin_s = link.async_spin_s
        self.early = _EarlyWake(link, spin_s) if link.parked is not None else None
        self.loop_reader = waiting.LoopReader(
            link.channel, self._dispatch_batch, lead=threading.Lock(), closed=self._stopped,
            dead=_never, dead_error=EngineDeadError, broken=self.fail, spin_s=spin_s, early=self.early)
        self.loop_reader.parking = inbox.parking

    def _stopped(self) -> bool:
        return self.stopped

    def _dispatch_batch(self, got) -> None:
        link = self.link
        client = self.client_ref()
        if client is not None and client.resources.engine_dead and not self.draining:
            # As with vLLM: once the client is found dead, nothing more is handed on
            # (vLLM's engine monitor shuts the client down as it marks it dead, which
            # ends its output task; an ENGINE_CORE_DEAD reads the remains first, here
            # as on vLLM's socket). With data parallelism the other
            # engines are being stopped meanwhile and abort what they run: those aborts
            # would end their streams as if finished instead of with EngineDeadError.
            self.fail(EngineDeadError())
            return
        try:
            for rtype, outputs in got:
                if self.stopped:
                    break
                try:
                    if link.on_control(rtype, outputs):
                        continue
                    if isinstance(outputs, BadMessage):
                        if _bad_reply(outputs, self.utility_results, link.engine_index):
                            continue
                        # as vLLM's output task: the error ends it
                        self.fail(RuntimeError(f"an engine output did not decode: {outputs.error}"))
                        break
                    self._dispatch(outputs)
                except Exception:
                    _dispatch_failed(link.engine_index, rtype, outputs)
        except BaseException:
            self.inbox.parking.wake()  # the LoopReader wakes only after a dispatch that returned
            raise

    def _dispatch(self, outputs: EngineCoreOutputs) -> None:
        from vllm.v1.engine import FT_STATUS_CALL_ID

        if outputs.utility_output:
            if outputs.utility_output.call_id == FT_STATUS_CALL_ID:
                client = self.client_ref()
                if client is not None and outputs.utility_output.result is not None:
                    client._engine_status[outputs.engine_index] = outputs.utility_output.result.result
            else:
                _utility_reply(outputs.utility_output, self.utility_results, self.link.engine_index)
        else:
            if self.handler is not None:
                client = self.client_ref()
                if client is None:
                    return
                _run_to_end(self.handler(client, outputs))
            if outputs.outputs or outputs.scheduler_stats:
                self.inbox.items.append(outputs)

    def fail(self, e: BaseException, remains: bool = False) -> None:
        """Stop reading and queue ``e`` (once); with ``remains``, what the ring still
        holds (the engine's last outputs) is dispatched first. Loop thread only."""
        if self.stopped:
            return
        try:
            if remains:
                self.read_remains()
        finally:  # stopped and the error queued, whatever the remains did
            self.stopped = True
            self.loop_reader.unwatch_hook()()
            if self.failed is not None and not self.failed.done():
                self.failed.set_result(None)
            self.inbox.put(e if isinstance(e, Exception) else EngineDeadError())

    def read_remains(self) -> None:
        """Dispatch what the ring holds now, the engine's death notwithstanding (what
        it wrote before dying). Loop thread only."""
        if self.stopped or self.draining:
            return
        self.draining = True
        try:
            while self.loop_reader.read_now(0.0):
                pass
        finally:
            self.draining = False


def _never() -> bool:
    return False


async def park_all(readers: "list[_EngineReader]", parking: waiting.Parking) -> None:
    """Park the running task until a reader (or vLLM's socket task) brings something,
    each engine's early wake-up armed meanwhile."""
    early = [r.early for r in readers if r.early is not None]
    for e in early:
        e.arm()
    try:
        await parking.park(asyncio.get_running_loop(), None)
    finally:
        for e in early:
            e.disarm()


def _run_to_end(coro) -> None:
    """Run a coroutine that never suspends (vLLM's per-output hooks await nothing) to its
    end, here. One that suspends is a vLLM this was not written against: RuntimeError."""
    try:
        coro.send(None)
    except StopIteration:
        return
    coro.close()
    raise RuntimeError("shmclient.vllm: vLLM's output hook awaited; this vLLM's DP client is not supported")


def _watch_engine(loop: asyncio.AbstractEventLoop, reader: _EngineReader) -> int | None:
    """Watch the engine's process (a pidfd, readable once it has exited): when it dies,
    the client is dead and the reader fails at once (after the engine's last outputs).
    vLLM's own engine monitor notices too, but with several engines it first waits for
    the others to stop (seconds) before failing the client. None where the kernel has no
    pidfd (vLLM's monitor then)."""
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
            client._mark_engine_dead()
        reader.fail(EngineDeadError(), remains=True)

    loop.add_reader(pidfd, exited)
    return pidfd


async def _own_reader(reader: _EngineReader) -> None:
    """Own the reader's callback: in place until the reader fails or the task is
    cancelled (shutdown); then fail pending utility calls, stop watching and close the
    channel, on the loop."""
    loop = asyncio.get_running_loop()
    reader.failed = failed = loop.create_future()
    loop_reader = reader.loop_reader
    if loop_reader.loop is None:
        loop_reader.bind(loop)
    pidfd: int | None = None

    def watch() -> None:  # now, or once the engine's HELLO has named it (a launcher's engine)
        nonlocal pidfd
        if pidfd is None and not reader.stopped:
            pidfd = _watch_engine(loop, reader)

    reader.link.on_engine_pid = watch
    watch()
    try:
        if not reader.stopped:
            loop_reader.on_readable()  # whatever arrived before the callback was in place
            await failed  # the error is in the inbox already
    except asyncio.CancelledError:
        reader.fail(EngineDeadError())
    finally:
        failed.cancel()
        if pidfd is not None:
            loop.remove_reader(pidfd)
            os.close(pidfd)
        _close_reader(reader)


def _close_reader(reader: _EngineReader) -> None:
    """Fail the utility calls still waiting, stop watching the channel and close it, on
    the loop. Idempotent."""
    utility_results = reader.utility_results
    for call_id in list(utility_results):
        future = utility_results.pop(call_id, None)
        if future is not None and not future.done():
            future.set_exception(EngineDeadError())
    reader.loop_reader.unwatch_hook()()
    reader.link.on_engine_pid = None
    reader.link.close()


def reader_task_ended(reader: _EngineReader, task: asyncio.Task) -> None:
    """The done-callback of ``_own_reader``'s task: one cancelled before its first step
    (a shutdown right after the client was made on a running loop) never ran the body
    that closes the channel, which then stayed open, and watched, for the client's
    life."""
    if reader.failed is None:
        _close_reader(reader)
