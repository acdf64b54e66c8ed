"""``MPClient`` (the protocol, written once) and ``SyncMPClient``.

Top layer: imports client, launcher, channel, messages, errors and waiting. The engine runs
in its own process; requests and outputs travel over the channel (shared-memory rings by
default, ZMQ sockets with ``transport="zmq"``). The protocol is shared: ``_dispatch``
(outputs to the queue, utility replies to their futures, finished requests forgotten), the
futures, and what the engine's death means. Waiting is not written here: each client
hands ``_dispatch`` to a reader of ``shmclient.waiting`` (``SyncMPClient``: the
``ThreadReader``, whose callers' threads read the channel by turns, no reader thread).
The monitor thread (launcher) watches the engine; on its death every waiter and every
pending utility future gets EngineDeadError.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import os
import threading
import time
import weakref
from collections import deque
from typing import Any, Callable

from .config import EngineConfig
from . import forksafe, waiting
from .channel import REC_OUTPUTS, REQ_ABORT, REQ_ADD, REQ_UTILITY, BadMessage
from .client import (
    EngineCoreClient,
    SyncEngineCoreClient,
    check_abort_ids,
    check_request,
    check_timeout as _check_timeout,
    check_utility_call,
    shutdown_timeout,
)
from .errors import (ClientClosedError, EngineDeadError, ForkedError,
                     InvalidRequestError, PeerDeadError, PeerNotConsumingError,
                     PeerNotProducingError, ProtocolError, UtilityCallError)
from .errors import not_sent
from .launcher import EngineResources, weak_callback
from .messages import EngineCoreOutputs, EngineCoreRequest, UtilityRequest

logger = logging.getLogger("shmclient")


#: How long an engine that reported its start-up failure is given to exit by itself.
_STARTUP_EXIT_GRACE_S = 5.0


def _engine_reported_failure(e: BaseException) -> bool:
    """Did the engine report its start-up failure (and exit now by itself)?"""
    return isinstance(e, RuntimeError) and str(e).startswith("Engine core initialization failed")


class MPClient(EngineCoreClient):
    """The engine core in a background process; shared by the sync and async clients.

    Construction starts the engine process and blocks until it is ready; it raises
    ``ConfigError`` for a configuration the engine cannot run (the same error the
    in-process client raises), ``PeerNotProducingError`` (a ``TimeoutError``) when the
    engine is not ready within ``engine_ready_timeout_s``, ``EngineDeadError`` when it
    dies while starting; nothing is left behind in any of these cases.
    """

    _asyncio = False
    #: True in a process forked from the one that built the client (see forksafe).
    _forked = False
    #: Longest a send that found the engine gone waits for the client to learn of the
    #: death (the monitor's reason) before it marks the client dead itself.
    DEATH_NOTICE_S = 2.0

    def __init__(self, config: EngineConfig, *, _abandon: threading.Event | None = None) -> None:
        # (``_abandon``: a data-parallel group's start, ``dp_engines.start_engines``: once
        # set, a start still waiting for its engine gives up, PeerNotProducingError.)
        self.config = config  # never mutated: capacity comes back in attributes
        #: Held by the one thread (or event-loop task) that is reading the channel, and
        #: by shutdown() while it closes the channel under any reader.
        self._lead = threading.Lock()
        self.resources = EngineResources()
        self._finalizer = weakref.finalize(self, self.resources.shutdown)
        try:
            info = self.resources.start(
                config, wake_fd=self._asyncio and config.transport == "shm", abandon=_abandon
            )
        except BaseException as e:
            # The engine never became ready. One that reported its failure is exiting on
            # its own: give it the time to (a SIGTERM in its exit prints a second
            # traceback); any other is stopped at once.
            self._finalizer.detach()
            self.resources.shutdown(
                timeout=_STARTUP_EXIT_GRACE_S if _engine_reported_failure(e) else 0.0)
            raise
        self.engine_pid = info.pid
        self.num_gpu_blocks = info.num_gpu_blocks
        self.block_size = info.block_size
        self.max_model_len = info.max_model_len
        self.channel = self.resources.channel
        self._call_ids = itertools.count(1)
        self._futures: dict[int, Any] = {}
        self._outputs: deque[EngineCoreOutputs] = deque()
        #: Where ``_dispatch`` puts each output batch (None: ``_outputs``, get_output's).
        self._put: Any = None
        self._live: set[str] = set()
        self._closed = False
        #: The sends in call order: a later call's message (an abort, a pause) waits
        #: behind one waiting for room instead of overtaking it in the room left (vLLM's
        #: socket keeps the order of sends).
        self._sends = self._make_sends()
        #: The reader of ``shmclient.waiting`` that waits for the channel (it holds
        #: ``_lead`` while it reads); what the engine left after its death is read once.
        self._reader = self._make_reader()
        # The channel is closed once a reader inside it has left (readers check the dead
        # flag at least every liveness interval, 0.1 s).
        self.resources.guard_close(self._lead)
        self.resources.on_dead(weak_callback(self._on_engine_dead))
        self._pid = os.getpid()
        forksafe.register(self)

    def _forget_after_fork(self) -> None:
        """In a forked child: the engine and its channel are the parent's. Every call
        raises ForkedError from here on, so nothing the child does reaches the parent's
        engine or moves the parent's ring positions; ``shutdown()`` does nothing and the
        child's exit does not stop the engine (the finalizer is detached). What the
        parent had queued is dropped from the child's copy."""
        self._forked = True
        self._closed = True
        self._finalizer.detach()
        self._outputs.clear()
        self._futures.clear()

    def _make_reader(self) -> Any:
        raise NotImplementedError

    # -- state ------------------------------------------------------------------------
    def _is_closed(self) -> bool:
        return self._closed

    def _is_gone(self) -> bool:
        """The engine is known dead or the client closed (a cheap flag)."""
        return self._closed or self.resources.dead.is_set()

    def _make_sends(self):
        return waiting.OrderedSends(self.channel, self.resources.alive, self._is_gone)

    def _dead_error(self) -> EngineDeadError:
        if self._forked:
            return ForkedError(
                f"this {type(self).__name__} belongs to process {self._pid}, whose engine it "
                f"drives; the forked child {os.getpid()} cannot use it (nothing was sent): "
                "make a new client in the child")
        if self._closed:
            # An EngineDeadError, as vLLM raises after shutdown (ClientClosedError is one).
            return ClientClosedError("the client was shut down")
        return EngineDeadError(self.resources.dead_reason or None)

    def _ensure_alive(self) -> None:
        if self._closed or self.resources.dead.is_set():
            raise self._dead_error()

    def _on_engine_dead(self) -> None:
        """Called from the monitor thread once the engine is gone."""

    def _seen_dead(self, e: PeerDeadError) -> bool:
        """A send found the engine gone (``e``, from the channel) before the client knew
        (the channel may notice the death before the monitor does): whether the client
        must still learn of it (the caller waits, at most ``DEATH_NOTICE_S``, then calls
        ``_mark_seen_dead``). False after a shutdown (the channel closed under the send)."""
        return not (self._closed or isinstance(e, ClientClosedError) or self.resources.dead.is_set())

    def _mark_seen_dead(self, e: PeerDeadError) -> None:
        """The monitor did not report the death that a send saw: mark the client dead
        with the channel's message, so that the error raised says why and ``is_dead``
        is True by then."""
        if not self._seen_dead(e):
            return
        # (logged there; ``_on_engine_dead`` and every ``on_dead`` callback run)
        self.resources.mark_dead(f"The engine core process (pid {self.engine_pid}) is gone: {e}")

    def _send_dead_error(self, e: PeerDeadError) -> EngineDeadError:
        """The error for a send that found the engine gone (``e``): once the client
        knows of the death (``_seen_dead``), saying why."""
        if self._seen_dead(e):
            self.resources.dead.wait(self.DEATH_NOTICE_S)
            self._mark_seen_dead(e)
        return self._dead_error()

    def _channel_broken(self, e: ProtocolError) -> EngineDeadError:
        """The channel with the engine is broken (ProtocolError, in either direction:
        the engine broke a ring's protocol, or a batch of outputs does not decode;
        found by a send or by a reader): nothing more can be
        trusted from it, so the client treats the engine as dead from here on (pending
        and later calls raise EngineDeadError saying why; ``shutdown()`` still stops the
        engine process)."""
        res = self.resources
        if not res.dead.is_set():
            self._reader.remains_read = True  # nothing more can be trusted from this channel
            # (logged there; ``_on_engine_dead`` and every ``on_dead`` callback run)
            res.mark_dead(f"The channel with the engine core is broken: {e}")
        return self._dead_error()

    def on_dead(self, callback: Callable[[EngineDeadError], None]) -> None:
        """Call ``callback(error)`` once the engine is gone (its process died, it
        reported a fatal error, its heartbeats stopped, its channel broke), whether or
        not anything waits on this client; ``error`` is what the client's calls raise
        from then on. A shutdown is no death: once the client's own shutdown began
        (``shutdown()``, or the finalizer of a client dropped or left to the
        interpreter's exit) it is never called, and an engine that dies after that is
        not reported either. It runs in the thread that saw the death, at once when the
        engine is gone already: the monitor's mostly, or, for a channel found broken,
        the reading thread (the event loop's, for ``AsyncMPClient``) while it holds the
        client's read lead; so it must not block, and must not wait on this client.
        The engine's resources hold ``callback``, never this client."""
        ref = weakref.ref(self)
        res = self.resources

        def call() -> None:
            client = ref()
            if client is not None and not res.by_shutdown:
                callback(client._dead_error())

        res.on_dead(call)

    # -- sending (never waits for the engine, only for ring space) ---------------------
    def _send(self, rtype: int, obj: Any, timeout: float | None = None) -> None:
        self._ensure_alive()
        channel = self.channel
        payload = channel.encode(obj)
        try:
            try:
                self._sends.send(rtype, payload, timeout)
            except BaseException as e:
                if not_sent(e):  # (a timeout, the engine's death, Ctrl-C while it waited)
                    channel.discard(rtype, payload)  # its tensors' blocks come back now
                raise
        except PeerDeadError as e:  # ClientClosedError too: the channel closed under us
            raise self._send_dead_error(e) from e
        except PeerNotConsumingError as e:
            raise self._stalled(timeout) from e
        except ProtocolError as e:  # the engine broke the request ring's protocol
            raise self._channel_broken(e) from e

    def _stalled(self, timeout: float | None) -> PeerNotConsumingError:
        return PeerNotConsumingError(
            f"the engine core process (pid {self.engine_pid}) took nothing from the full "
            f"request ring within {timeout} s: it is stalled or too busy; the message was "
            "not sent")

    def _no_reply(self, method: str, timeout: float | None) -> PeerNotProducingError:
        return PeerNotProducingError(
            f"the engine core process (pid {self.engine_pid}) did not answer the call to "
            f"{method} within {timeout} s: it is stalled or the call is slow; the call may "
            "still run in the engine, and its reply is dropped")

    def _admit(self, request: EngineCoreRequest, checked: bool = False) -> None:
        """Checks before a request travels (``checked``: ``check_request`` ran already,
        against this engine's limits or stricter ones; only the live-id check is left);
        marks its id live."""
        self._ensure_alive()
        if not checked:
            check_request(request, max_model_len=self.max_model_len,
                          hidden_size=self.config.hidden_size, vocab_size=self.config.vocab_size)
        if request.request_id in self._live:
            raise InvalidRequestError(f"request id {request.request_id!r} is already live")
        self._live.add(request.request_id)

    def _abort_ids(self, request_ids: Any) -> list[str]:
        """The checked ids to send, [] when there is nothing to send (none given, or
        the engine is dead or the client shut down: aborts are then quiet no-ops)."""
        if self._forked:
            raise self._dead_error()
        ids = check_abort_ids(request_ids)
        if not ids or self._closed or self.resources.dead.is_set():
            return []
        return ids

    def _register_call(self, method: str, args: tuple, future: Any) -> tuple[int, Any]:
        """A new call's id and its encoded message; the future is registered (the
        caller unregisters it if the send fails)."""
        self._ensure_alive()
        check_utility_call(method)
        call_id = next(self._call_ids)
        payload = self.channel.encode(UtilityRequest(0, call_id, method, args))
        self._futures[call_id] = (method, future)
        return call_id, payload

    # -- receiving --------------------------------------------------------------------
    def _dispatch(self, got: list[tuple[int, Any]]) -> None:
        """Sort what arrived: utility replies resolve their futures (never reach
        get_output), output batches are queued in order (``_put``)."""
        put = self._put or self._outputs.append
        for rtype, outs in got:
            if rtype != REC_OUTPUTS:
                continue
            if type(outs) is BadMessage:
                # Only a bug in the engine (or memory corruption) can cause this. A
                # utility reply's call fails instead of waiting; a batch of outputs
                # breaks the channel, as vLLM's output reader ends on a batch it cannot
                # decode (its requests would lose tokens, or never finish, unseen).
                if self._fail_undecodable_reply(outs) and not outs.field("outputs"):
                    logger.error("a utility reply from the engine does not decode: %s",
                                 outs.error)
                    continue
                self._channel_broken(ProtocolError(
                    f"an output batch from the engine does not decode: {outs.error}"))
                return
            u = outs.utility_output
            if u is not None:
                entry = self._futures.pop(u.call_id, None)
                if entry is not None:
                    method, fut = entry
                    if u.failure_message is None:
                        self._set_future(fut, result=u.result)
                    else:
                        self._set_future(fut, exc=UtilityCallError(
                            f"Call to {method} method failed: {u.failure_message}"))
                if not outs.outputs:
                    continue
            for o in outs.outputs:
                if o.finish_reason is not None:
                    self._live.discard(o.request_id)
            put(outs)

    def _fail_undecodable_reply(self, bad: BadMessage) -> bool:
        """Fail the utility call whose reply is ``bad`` (an output batch that did not
        decode), when its call id can be read; whether it was a utility reply."""
        reply = bad.field("utility_output")
        call_id = reply[0] if type(reply) is list and reply else None
        entry = self._futures.pop(call_id, None) if type(call_id) is int else None
        if entry is not None:
            method, fut = entry
            self._set_future(fut, exc=UtilityCallError(
                f"Call to {method} method failed: its reply did not decode: {bad.error}"))
        return type(call_id) is int

    @staticmethod
    def _set_future(fut: Any, result: Any = None, exc: BaseException | None = None) -> None:
        if fut.done():  # cancelled by its caller: the late reply is dropped
            return
        try:
            fut.set_result(result) if exc is None else fut.set_exception(exc)
        except (concurrent.futures.InvalidStateError, Exception):
            pass

    def _fail_all_futures(self) -> None:
        err = self._dead_error()
        for _, (_, fut) in list(self._futures.items()):
            self._set_future(fut, exc=err)
        self._futures.clear()

    # -- lifecycle --------------------------------------------------------------------
    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the engine (SHUTDOWN; SIGTERM once ``timeout`` passed, None meaning
        ``DEFAULT_SHUTDOWN_TIMEOUT_S``; SIGKILL 2 s later) and free every resource, so it
        returns within about ``timeout + 2`` s even when the engine hangs. Idempotent;
        pending calls get EngineDeadError. Interrupted (Ctrl-C), the stop goes on in its
        own thread and another call waits for it."""
        timeout = shutdown_timeout(timeout)
        if self._forked:
            return
        res = self.resources
        if not self._closed:
            self._closed = True
            res.begin_shutdown()  # waiters leave the channel now
        res.shutdown(timeout)
        # (Only now: interrupted before the stop's thread started, the finalizer still
        # stops the engine when the client goes.)
        self._finalizer.detach()

    @property
    def is_dead(self) -> bool:
        """True once the engine died or the client was shut down (never resets)."""
        return self.resources.dead.is_set()


class SyncMPClient(MPClient, SyncEngineCoreClient):
    """Blocking client: ``get_output()`` waits for the next batch in the caller's thread.

    ``make_client(True, False, config)``. Thread-safe: any number of threads may add,
    abort, wait for output and call utilities at once (one of the waiting threads reads
    the channel for all; there is no reader thread). Every blocking call wakes with
    ``EngineDeadError`` within about 0.2 s of the engine's death or of ``shutdown()``.
    """

    def _make_reader(self) -> waiting.ThreadReader:
        return waiting.ThreadReader(
            self.channel, self._dispatch, lead=self._lead, dead=self.resources.dead,
            alive=self.resources.alive, closed=self._is_closed, dead_error=self._dead_error,
            broken=self._channel_broken)

    def _on_engine_dead(self) -> None:
        # The waiters look again: each reads what the engine wrote before dying (a
        # utility's reply too: its call then returns it, as vLLM's does), then raises.
        # After a shutdown (nothing more is read) the futures fail at once.
        self._reader.wake_all(first=self._fail_all_futures if self._closed else None)

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        """The next output batch; blocks until one arrives. Once the engine died, the
        outputs it wrote before dying still come first (as vLLM's, whose death notice
        queues behind them), then EngineDeadError (within ~0.2 s of the death);
        PeerNotProducingError (a TimeoutError) when ``timeout`` runs out."""
        outputs = self._outputs
        deadline = None
        while True:
            if self._closed:  # shut down: what was queued is not handed out any more
                raise self._dead_error()
            try:
                return outputs.popleft()  # another thread may have taken the one we saw
            except IndexError:
                pass
            if deadline is None and timeout is not None:
                deadline = time.monotonic() + _check_timeout("get_output", timeout)
            # Once the engine died, the reader reads what it wrote first, then raises.
            self._reader.wait(outputs.__len__, deadline)

    def add_request(self, request: EngineCoreRequest, timeout: float | None = None) -> None:
        """Validate (InvalidRequestError), then queue. EngineDeadError if the engine is
        gone. Blocks only while the request ring is full (the engine keeps taking
        requests even while its own output ring is full, so this always progresses
        while the engine runs): ``timeout`` seconds at most (None: as long as the engine
        lives), then PeerNotConsumingError (a ``TimeoutError``) and the request was not
        sent (a request bigger than the ring may have gone in part; the engine drops
        it), so it may be added again."""
        timeout = _check_timeout("add_request", timeout)
        self._admit(request)
        try:
            self._send(REQ_ADD, request, timeout)
        except BaseException:
            self._live.discard(request.request_id)
            raise

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort; rides the same ordered ring as the adds. InvalidRequestError for ids
        that are not a list of str; a quiet no-op once the engine is dead or for []."""
        ids = self._abort_ids(request_ids)
        if ids:
            try:
                self._send(REQ_ABORT, ids)
            except EngineDeadError:
                pass

    def call_utility(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        """Call ``method(*args)`` in the engine and wait for its result, ``timeout``
        seconds at most (None: as long as the engine lives); see
        ``SyncEngineCoreClient.call_utility`` for the errors."""
        timeout = _check_timeout("call_utility", timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        fut: concurrent.futures.Future = concurrent.futures.Future()
        call_id, payload = self._register_call(method, args, fut)
        try:
            # Death may have failed every registered future just before ours went in.
            self._ensure_alive()
            self._sends.send(REQ_UTILITY, payload, timeout)
        except PeerDeadError as e:
            self._futures.pop(call_id, None)
            self.channel.discard(REQ_UTILITY, payload)
            raise self._send_dead_error(e) from e
        except ProtocolError as e:
            self._futures.pop(call_id, None)
            raise self._channel_broken(e) from e
        except BaseException as e:
            self._futures.pop(call_id, None)
            if not_sent(e):
                self.channel.discard(REQ_UTILITY, payload)
            if isinstance(e, PeerNotConsumingError):
                raise self._stalled(timeout) from e
            raise
        try:
            self._reader.wait(fut.done, deadline)
        except PeerNotProducingError as e:
            self._futures.pop(call_id, None)  # (a late reply is dropped)
            if fut.done():  # (it came as the wait gave up)
                return fut.result()
            raise self._no_reply(method, timeout) from e
        except BaseException:
            self._futures.pop(call_id, None)
            raise
        return fut.result()
