"""How the plug-in's async clients read their engines' output rings on the event loop.

Imports vLLM's client module (its utility-reply helper) and exceptions, the ring's spin
gate, ``shmclient.doorbell`` and the plug-in's ``link``; no waiting module (nothing here
blocks). ``_AsyncReader`` reads one output ring on the loop's thread, from
``get_output_async`` (the fast path) and from the wake pipe's reader callback, and
dispatches as vLLM's output task does into one ``_Inbox`` shared by every engine's
reader; ``_own_reader`` is the task that owns the callback and the engine's pidfd.
"""

from __future__ import annotations

import asyncio
import collections
import os
from time import monotonic, perf_counter

from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.engine.core_client import _process_utility_output
from vllm.v1.engine.exceptions import EngineDeadError

from .. import _ring
from ..channel import BadMessage
from ..doorbell import Spin
from ..errors import ClientClosedError, PeerDeadError
from .link import _env_float, _Link

#: How long (µs) get_output_async may spin on the output ring, holding the event loop,
#: before it parks; adapted like the rings' own spins (doorbell.Spin).
ASYNC_SPIN_ENV = "SHMCLIENT_VLLM_ASYNC_SPIN_US"
ASYNC_SPIN_US = 50.0


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
    pidfd: int | None = None

    def watch() -> None:  # now, or once the engine's HELLO has named it (a launcher's engine)
        nonlocal pidfd
        if pidfd is None and not reader.stopped:
            pidfd = _watch_engine(loop, reader)

    reader.link.on_engine_pid = watch
    watch()
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
        reader.link.on_engine_pid = None
        if pidfd is not None:
            loop.remove_reader(pidfd)
            os.close(pidfd)
        reader.link.close()
