"""The engine loop around one core: take requests, step, write outputs; answer what it
cannot take. Protocol layer, engine side: imports shmclient's channel, control, messages,
errors and ``waiting`` (it blocks only through it); never a client and never an engine
(the core is an ``EngineCore``, built by whoever calls). One bad message never stops the
loop: a request the core refuses, or one that does not decode (the channel hands it up
as ``BadMessage``), finishes at once with ``FinishReason.ERROR`` and the reason in
``stop_reason``; a utility call that does not decode fails with the decoder's message; an
abort that does not decode, or a control message that is not ``Shutdown``, is dropped
with a log line. Those outputs are queued and sent by the loop, never from inside
``handle`` (which runs while ``send`` waits for room). Only a broken channel
(``ProtocolError``) is fatal.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time
from collections import deque
from typing import Any, Callable, Protocol

import zmq

from . import control, waiting
from .channel import REC_OUTPUTS, REQ_ABORT, REQ_ADD, REQ_UTILITY, BadMessage, ShmChannel
from .channel_zmq import ZmqChannel
from .config import EngineConfig
from .errors import (DuplicateRequestError, PeerDeadError, PeerNotConsumingError,
                     PeerNotProducingError, ProtocolError)
from .messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason, UtilityOutput, UtilityRequest
from .serve_remote import FrontendLink

__all__ = ["Channel", "EngineCore", "EngineProc", "MakeCore"]

_SLICE_S = 0.1

log = logging.getLogger("shmclient_engine")

Channel = ShmChannel | ZmqChannel


class EngineCore(Protocol):
    """What the engine process serves: ``shmclient_engine.core.EngineCore`` is one.
    ``step()`` runs one scheduler step and returns each client's outputs; ``has_work()``
    says whether a step would do anything (a paused or sleeping engine says no);
    ``call_utility`` returns the result, a ``concurrent.futures.Future`` of it, or raises
    (the caller reads "Call to <method> method failed: <error>"). None of them may block
    for long but ``step``."""

    num_gpu_blocks: int
    block_size: int
    max_model_len: int

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue ``request``; raise to refuse it (the frontend gets it finished with
        ERROR, the reason in ``stop_reason``), or raise ``DuplicateRequestError`` for an
        id that is live (nothing is answered under it)."""

    def abort_requests(self, request_ids: list[str]) -> None: ...

    def is_live(self, request_id: str) -> bool:
        """Whether ``request_id`` is live here (its finish not sent yet): a request
        under that id that does not decode is then dropped, not answered with ERROR
        under the live request's id. Optional: a core without it is not asked."""

    def step(self) -> dict[int, EngineCoreOutputs]: ...

    def pending_outputs(self) -> dict[int, EngineCoreOutputs]:
        """The outputs decided and not sent yet (an abort's ABORT outputs), without a
        step. Optional: with it a utility's reply is sent before the next step, after
        these; a core without it has its replies sent after the next step."""

    def has_work(self) -> bool: ...

    def call_utility(self, method: str, args: tuple) -> Any: ...

    def shutdown(self) -> None: ...


#: ``make_core(config, *, supports_wait)``: builds the core (raising ``ConfigError`` for a
#: config it cannot run); ``supports_wait``: a loop keeps stepping while a pause or sleep
#: in mode "wait" drains (this one does).
MakeCore = Callable[..., EngineCore]


class EngineProc:
    """The loop around one EngineCore. Single-threaded; utility futures may complete on
    other threads and hand their replies over through a deque."""

    def __init__(self, ctl: zmq.Socket, parent_pid: int | None, config: EngineConfig,
                 channel: Channel, make_core: MakeCore, *,
                 link: FrontendLink | None = None):
        """Builds the core with ``make_core(config, supports_wait=True)``; blocks while the
        model loads and raises what that raises (``ConfigError`` for a config it cannot
        run). ``link``: a remote engine's control thread (then ``parent_pid`` is None and
        ``ctl`` is the link's)."""
        self.ctl = ctl
        self.parent_pid = parent_pid
        self.link = link
        self.config = config
        self.channel = channel
        # This loop keeps stepping while a pause or sleep in mode "wait" drains.
        self.core = make_core(config, supports_wait=True)
        self.replies: deque[EngineCoreOutputs] = deque()
        #: Outputs of refused requests, per client, sent by the loop (never by handle).
        self.rejected: dict[int, list[EngineCoreOutput]] = {}
        self.steps = 0
        self._last_check = 0.0
        self._stop = False

    # -- liveness ---------------------------------------------------------------------
    def alive(self) -> bool:
        """Checked by every blocking wait: frontend alive and no ``Shutdown`` received."""
        if self.link is not None:
            if self.link.stopped:
                self._stop = True
        elif os.getppid() != self.parent_pid:
            self._stop = True
        else:
            while self.ctl.poll(0, zmq.POLLIN):
                self._take_control(self.ctl.recv_multipart())
        return not self._stop

    def _take_control(self, frames: list[bytes]) -> None:
        """A local engine's control message: ``Shutdown`` stops the loop; one that is not
        a message, or not one a frontend sends after ``Start``, is logged and dropped."""
        try:
            msg = control.decode(frames)
        except control.ControlMessageError as e:
            log.warning("dropped a bad control message from the frontend: %s", e)
            return
        if isinstance(msg, control.Shutdown):
            self._stop = True
        else:
            log.warning("dropped an %s",
                        control.ControlMessageError.unexpected(msg, "from the frontend after Start"))

    # -- requests ---------------------------------------------------------------------
    def handle(self, rtype: int, obj: Any) -> None:
        """Act on one message. Never sends (replies and rejections are queued for the
        loop); raises only ``ProtocolError`` (a message type the engine never takes)."""
        if type(obj) is BadMessage:
            self.bad_message(rtype, obj)
        elif rtype == REQ_ADD:
            try:
                self.core.add_request(obj)
            except DuplicateRequestError as e:
                # An ERROR under that id would finish the live request at the frontend
                # while the engine goes on with it: refused without an answer.
                log.warning("dropped a request from client %r: %s", obj.client_index, e)
            except Exception as e:  # noqa: BLE001 - a refused request changes nothing
                self.reject(obj.client_index, obj.request_id, str(e))
        elif rtype == REQ_ABORT:
            try:
                self.core.abort_requests(obj)
            except Exception:  # noqa: BLE001 - an engine refusing an abort (an unknown id)
                log.warning("dropped an abort of %d request(s) that the engine core refused",
                            len(obj), exc_info=True)
        elif rtype == REQ_UTILITY:
            self.utility(obj)
        else:
            raise ProtocolError(f"unexpected message type 0x{rtype:02x} on the request channel")

    def reject(self, client_index: Any, request_id: str, reason: str) -> None:
        """Finish a request the engine did not take with ERROR (queued for the loop)."""
        if type(client_index) is not int or client_index < 0:
            client_index = 0
        out = EngineCoreOutput(
            request_id=request_id, finish_reason=FinishReason.ERROR, stop_reason=_sendable(reason)
        )
        self.rejected.setdefault(client_index, []).append(out)

    def bad_message(self, rtype: int, bad: BadMessage) -> None:
        """Answer a message that did not decode, if it can be matched to its sender."""
        if rtype == REQ_ADD:
            rid = bad.field("request_id")
            is_live = getattr(self.core, "is_live", None)
            if type(rid) is str and rid and is_live is not None and is_live(rid):
                # An ERROR under that id would finish the live request at the frontend
                # while the engine goes on with it (as for a duplicate that decodes).
                log.warning("dropped a request that does not decode, under the id of a "
                            "live request %r: %s", rid, bad.error)
            elif type(rid) is str and rid:
                self.reject(bad.field("client_index"), rid,
                            f"the engine could not decode this request: {bad.error}")
            else:
                log.warning("dropped a request that does not decode and whose request_id "
                            "cannot be read, so it cannot be answered: %s", bad.error)
        elif rtype == REQ_UTILITY:
            call_id = bad.field("call_id")
            if type(call_id) is int:
                out = UtilityOutput(call_id=call_id,
                                    failure_message=_sendable(f"the engine could not decode the call: "
                                                              f"{bad.error}"))
                self.replies.append(EngineCoreOutputs(utility_output=out))
            else:
                log.warning("dropped a utility call that does not decode and whose call_id "
                            "cannot be read, so it cannot be answered: %s", bad.error)
        elif rtype == REQ_ABORT:
            log.warning("dropped an abort whose request ids do not decode: %s", bad.error)
        else:
            raise ProtocolError(f"unexpected message type 0x{rtype:02x} on the request channel")

    def flush_rejected(self) -> None:
        """Send the queued ERROR outputs, one batch per client."""
        while self.rejected:
            client_index, outs = self.rejected.popitem()
            self.send(client_index, EngineCoreOutputs(
                outputs=outs, finished_requests={o.request_id for o in outs}))

    def utility(self, req: UtilityRequest) -> None:
        def reply(result: Any = None, failure: str | None = None) -> None:
            out = UtilityOutput(call_id=req.call_id, failure_message=None if failure is None else _sendable(failure),
                                result=result)
            self.replies.append(EngineCoreOutputs(utility_output=out))

        try:
            # A pause or sleep in mode "wait" returns a Future that core.step() completes
            # once the requests that came before it have finished: answered then.
            result = self.core.call_utility(req.method, tuple(req.args))
        except Exception as e:
            reply(failure=str(e))  # read as "Call to <method> method failed: <e>", as vLLM
            return
        if isinstance(result, concurrent.futures.Future):
            result.add_done_callback(lambda f: _reply_future(f, reply))
        else:
            reply(result)

    def send(self, client_index: int, outputs: EngineCoreOutputs) -> None:
        """Send one batch. While the output ring is full (the frontend is not reading),
        keep taking requests, so that a frontend blocked on a full request ring always
        gets room and the two processes can never wait on each other. ``handle`` only
        queues, so this never recurses."""
        channel = self.channel
        try:
            payload = channel.encode(outputs)
        except Exception as e:
            # A utility's result the codec cannot carry (an object of no wire type, an
            # int over 64 bits): that call fails alone, as when the utility raises.
            outputs = _unsendable(outputs, e)
            payload = channel.encode(outputs)
        while True:
            try:
                waiting.send(channel, REC_OUTPUTS, payload, timeout=_SLICE_S, alive=self.alive)
                return
            except ValueError as e:
                # Longer than one message can carry (4 GiB; nothing of it was sent): a
                # utility's result fails that call alone.
                failed = _unsendable(outputs, e)
                channel.discard(REC_OUTPUTS, payload)  # (its tensors' blocks)
                outputs, payload = failed, channel.encode(failed)
            except PeerNotConsumingError:
                for rtype, obj in channel.try_recv():
                    self.handle(rtype, obj)
                if self._stop:
                    raise PeerDeadError("the frontend is gone") from None

    def send_replies(self) -> None:
        """Send the queued utility replies and refusals. What the core decided before a
        call goes first: ``pause_scheduler("abort")``'s ABORT outputs come before its
        reply (taken with ``pending_outputs``, where the core has it), also for a call
        handled while a send waited for room."""
        pending_outputs = getattr(self.core, "pending_outputs", None)
        while True:  # (a send waiting for room may handle more requests meanwhile)
            pending = pending_outputs() if pending_outputs is not None else None
            if pending:
                for client_index, outputs in pending.items():
                    self.send(client_index, outputs)
            elif self.rejected:
                self.flush_rejected()
            elif self.replies:
                self.send(0, self.replies.popleft())
            else:
                return

    # -- loop -------------------------------------------------------------------------
    def run(self) -> None:
        core = self.core
        while not self._stop:
            # A sleeping or paused engine schedules nothing (has_work says so): it waits
            # like an idle one.
            if core.has_work():
                got = self.channel.try_recv()
                now = time.monotonic()
                if now - self._last_check > _SLICE_S:
                    self._last_check = now
                    self.alive()
            else:
                try:
                    got = waiting.recv(self.channel, timeout=_SLICE_S, alive=self.alive)
                except PeerNotProducingError:
                    got = []
            for rtype, obj in got:
                self.handle(rtype, obj)
            if self.rejected:
                self.flush_rejected()
            if self.replies and hasattr(core, "pending_outputs"):
                # Before the next step, which may take long (vLLM's engine puts a reply
                # on its output queue before it steps); a core without pending_outputs
                # has its replies sent after the step, behind what it decided before.
                self.send_replies()
            if core.has_work():
                self.steps += 1
                for client_index, outputs in core.step().items():
                    self.send(client_index, outputs)
            if self.replies or self.rejected:
                self.send_replies()


def _unsendable(outputs: EngineCoreOutputs, error: Exception) -> EngineCoreOutputs:
    """The failure reply that replaces a utility's reply the wire cannot carry (``error``
    says why); re-raises ``error`` for anything else (a step's outputs, a failure reply):
    the caller's ``except`` clause is the only one running."""
    reply = outputs.utility_output
    if reply is None or reply.failure_message is not None:
        raise error
    log.warning("the result of utility call %s cannot be sent: %s", reply.call_id, error)
    return EngineCoreOutputs(utility_output=UtilityOutput(
        call_id=reply.call_id, failure_message=_sendable(f"its result cannot be sent to the client: {error}")))


def _sendable(text: str) -> str:
    """``text`` as the wire can carry it: a lone surrogate (a file name as os.listdir
    gives it, in an exception's message) would fail the encoding of the reply that
    carries it, and with it the engine; it goes as its backslash escape."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _reply_future(fut: concurrent.futures.Future, reply: Any) -> None:
    try:
        reply(fut.result())
    except Exception as e:
        reply(failure=str(e))
