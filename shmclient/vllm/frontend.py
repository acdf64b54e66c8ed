"""Frontend side of the plug-in: what vLLM's clients share over the channels
(``_LinkIO``: a channel per engine, made before vLLM starts the engine cores, whose specs
ride in their environment, or attached from a launcher's), and ``ShmSyncMPClient``.

Imports vLLM's client module, ``shmclient.waiting`` and the plug-in's ``wire`` and
``link`` (one engine's channel); nothing of the engine side, no ring end. The classes
subclass vLLM's own, so construction (engine launch, handshake, ready response), the
engine monitor, ``shutdown`` and every utility method are vLLM's. What changes: requests
are encoded by vLLM's encoder into the request ring, outputs read from the output ring;
vLLM's PULL socket and its reader stay, for ENGINE_CORE_DEAD only. The async clients are
in ``frontend_async``; both hand utility replies, and output messages that did not decode
or whose handling failed, to the helpers here. Its contract (threads, full rings, the
engine's death): docs/design.md, "Module notes", ``shmclient.vllm.frontend``.
"""

from __future__ import annotations

import collections
import threading
import weakref
from concurrent.futures import Future
from typing import Any

from vllm.v1.engine import EngineCoreOutputs, EngineCoreRequestType, UtilityOutput
from vllm.v1.engine.core_client import SyncMPClient, _process_utility_output
from vllm.v1.engine.exceptions import EngineDeadError

from .. import waiting
from ..channel import BadMessage
from ..errors import NOT_SENT, ClientClosedError, PeerDeadError, ProtocolError, not_sent
from . import wire
from .link import _close_links, _engine_pids, _Link, _start_with_links, new_monitors, own_monitor

__all__ = ["ShmSyncMPClient"]

SEND_TIMEOUT_S = 60.0
#: Wire positions (vLLM's array-like structs) of an output message's utility reply and of
#: the reply's call id: whose reply a message that did not decode was.
_UTILITY_POS = EngineCoreOutputs.__struct_fields__.index("utility_output")
_CALL_ID_POS = UtilityOutput.__struct_fields__.index("call_id")


def _utility_reply(reply: UtilityOutput, utility_results: dict, engine_index: int) -> None:
    """Resolve the call that ``reply`` answers (vLLM's ``_process_utility_output``). A
    reply nobody awaits is logged and dropped; one that cannot resolve its call (no
    result, no failure) fails it."""
    from . import log

    future = utility_results.pop(reply.call_id, None)
    if future is None:
        log.error("shmclient.vllm: engine %d: a reply to utility call %d, which nobody awaits: dropped",
                  engine_index, reply.call_id)
        return
    try:
        _process_utility_output(reply, {reply.call_id: future})
    finally:
        if not future.done():
            future.set_exception(RuntimeError(
                f"shmclient.vllm: engine {engine_index}: the reply to utility call {reply.call_id} is malformed"))


def _bad_reply(bad: BadMessage, utility_results: dict, engine_index: int) -> bool:
    """An output message that did not decode: True if it was a utility reply (it fails
    its call, or every pending call when its call id cannot be read); False if it was
    outputs or cannot be told (its error then goes where vLLM's would; pending calls fail
    in the latter case, one of them may have been answered)."""
    from . import log

    raw = bad.raw
    call_id = None
    if type(raw) is list:
        reply = raw[_UTILITY_POS] if len(raw) > _UTILITY_POS else None
        if reply is None:
            return False
        if type(reply) is list and len(reply) > _CALL_ID_POS and type(reply[_CALL_ID_POS]) is int:
            call_id = reply[_CALL_ID_POS]
    if call_id is not None:
        error = RuntimeError(f"shmclient.vllm: engine {engine_index}: the reply to utility call {call_id} "
                             f"did not decode: {bad.error}")
        futures = [utility_results.pop(call_id, None)]
    else:
        error = RuntimeError(f"shmclient.vllm: engine {engine_index}: an output message that may be a utility "
                             f"reply (its call cannot be read) did not decode, pending calls fail: {bad.error}")
        futures = [utility_results.pop(c, None) for c in list(utility_results)]
    log.error("%s", error)
    for future in futures:
        if future is not None and not future.done():
            future.set_exception(error)
    return type(raw) is list


def _undelivered(engine_index: int, request_id: str, why: BaseException) -> EngineCoreOutputs:
    """The output that finishes a request that never reached its engine (its ADD was not
    sent: the request ring stayed full for SEND_TIMEOUT_S; in the sync client also a
    signal that interrupted the wait), with vLLM's request-scoped error, as vLLM's engine
    answers a request it could not add. vLLM's frontend registered the request before the
    send (its output processor, a DP client's in-flight count): without this it stayed
    unfinished for good, and ``LLM``'s next ``generate`` waited on it for ever. Only for
    what ``_LinkIO._finishable`` names."""
    from vllm.v1.engine import EngineCoreOutput, FinishReason

    from . import log

    log.warning("shmclient.vllm: request %s did not reach engine %d (%s): it finishes with an error",
                request_id, engine_index, type(why).__name__)
    return EngineCoreOutputs(
        engine_index=engine_index, finished_requests={request_id},
        outputs=[EngineCoreOutput(request_id=request_id, new_token_ids=[], finish_reason=FinishReason.ERROR)])


def _dispatch_failed(engine_index: int, rtype: int, obj: Any) -> None:
    """Log the error of a message whose handling raised (in an ``except`` block); the
    reader goes on with the next."""
    from . import log

    if getattr(obj, "utility_output", None) is not None:
        kind = f"the reply to utility call {obj.utility_output.call_id}"
    elif wire.kind_of(rtype) == wire.OUTPUTS:
        kind = "an output message"
    else:
        kind = f"a record of type 0x{rtype:02x}"
    log.error("shmclient.vllm: engine %d: handing on %s failed; dropped, the reader goes on",
              engine_index, kind, exc_info=True)


class _LinkIO:
    """Send and receive vLLM messages over the channels, one per engine (shared by the
    clients)."""

    def _init_link(self, wake_fd: bool, construct, engine_indexes: "tuple[int, ...]" = (0,),
                   frontend_specs: "list[wire.FrontendSpec] | None" = None) -> None:
        """Make a channel per engine and run vLLM's construction (which starts the
        engines) with their specs in the environment; or, with ``frontend_specs`` (an
        API server of several), attach to the channels the launcher made."""
        links: list[_Link] = []
        #: ids of the streaming-input sessions sent (``_finishable``)
        self._sessions: set[str] = set()
        self._link_finalizer = weakref.finalize(self, _close_links, links)
        monitors: list[threading.Thread] = []

        def construct_watching() -> None:
            monitors.extend(new_monitors(construct))

        try:
            if frontend_specs is not None:
                for spec in frontend_specs:
                    links.append(_Link(wake_fd, frontend_spec=spec))
                construct_watching()
            else:
                def make() -> None:
                    for index in engine_indexes:
                        links.append(_Link(wake_fd, index))

                _start_with_links(links, make, construct_watching)
            #: vLLM's engine monitor thread of this client (None where vLLM started
            #: none: engines it did not launch), see ``_mark_engine_dead``
            resources = getattr(self, "resources", None)
            self._vllm_monitor = own_monitor(monitors, getattr(resources, "engine_manager", None))
            pids = _engine_pids(self)
            for link in links:
                link.attached(pids.get(link.engine_index))
        except BaseException:
            self._link_finalizer()
            raise
        #: engine identity (vLLM's: its index, 2 bytes little-endian) -> its link
        self._links = {link.engine_index.to_bytes(2, "little"): link for link in links}
        self._link = links[0]
        self._alive = alive = self._make_alive()
        for link in links:  # each engine's sends in call order (as on vLLM's socket)
            ordered = waiting.OrderedSendsAsync if wake_fd else waiting.OrderedSends
            link.sends = ordered(link.channel, alive, lambda: not alive())
        #: vLLM's encoder had an out-of-band path of its own (its multimodal tensor queue)
        self._own_oob = self.encoder.oob_tensor_consumer is not None
        if len(links) == 1 and links[0].arenas and not self._own_oob and not getattr(self, "_remote", ()):
            # vLLM's encoder with the arena as its out-of-band path. With several engines
            # each has its own arena: requests are encoded for their engine's
            # (``_encode``); vLLM's encoder (utility calls, and everything to an engine on
            # another node) keeps tensors in line.
            self.encoder = links[0].framing.encoder

    def _finishable(self, request_type: EngineCoreRequestType, request: Any) -> "str | None":
        """The id of the request that ``request`` (about to be sent) adds and that an
        ADD which does not go may finish with an error (``_undelivered``); None for
        every other message. Left out: pooling requests (vLLM's output processor takes
        an output without a pooling result for a generation one and fails), and the
        ADDs of a streaming-input session (vLLM's ``resumable`` chunks, and the final
        request that closes the session under the same id): the session may be live in
        the engine, which an error finish would hide from a later abort. The sessions
        are known by their chunks' ids until that final request or an abort."""
        if request_type == EngineCoreRequestType.ABORT:
            if self._sessions:
                self._sessions.difference_update(request)
            return None
        request_id = getattr(request, "request_id", None)
        if request_type != EngineCoreRequestType.ADD or type(request_id) is not str:
            return None  # (not an ADD; or not a request: its encode fails as vLLM's does)
        if getattr(request, "resumable", False):
            self._sessions.add(request_id)
            return None
        if request_id in self._sessions:
            self._sessions.discard(request_id)  # (the session's final request)
            return None
        return None if getattr(request, "pooling_params", None) is not None else request_id

    def _link_for(self, engine) -> _Link:
        return self._link if engine is None else self._links[engine]

    def _encode(self, link: _Link, request: Any) -> "tuple[list, list]":
        """vLLM's frames of ``request`` for ``link``'s engine (large tensors in its arena)
        and the handles of those it placed there (``wire.message``)."""
        if link.arenas and not self._own_oob:
            return link.framing.encode_placed(request)
        return self.encoder.encode(request), []

    def _placed_by(self, link: _Link) -> list:
        """The handles the last encode by ``self.encoder`` placed in ``link``'s arena
        (none unless that is the link's own encoder)."""
        return link.framing.take_placed() if self.encoder is link.framing.encoder else []

    def _make_alive(self):
        resources = self.resources
        return lambda: not resources.engine_dead

    def _dead(self) -> EngineDeadError:
        self._mark_engine_dead()
        return EngineDeadError()

    def _mark_engine_dead(self) -> None:
        """The plug-in found the engine gone (its channel closed, its process exited):
        set vLLM's flag, which its calls read, at once. vLLM's engine monitor shuts the
        client down (sockets, tasks, the DP coordinator) only if it finds that flag
        unset once the engine manager has stopped the other engines (seconds): so
        that shutdown is done here then, when the monitor has returned."""
        resources = self.resources
        if resources.engine_dead:
            return
        resources.engine_dead = True
        monitor = getattr(self, "_vllm_monitor", None)
        if monitor is not None and monitor.is_alive():
            threading.Thread(target=_shutdown_after, args=(monitor, weakref.ref(self)), daemon=True,
                             name="ShmEngineMonitorFollower").start()

    def _ring_send(self, request_type: EngineCoreRequestType, request: Any) -> None:
        """Send from this thread in call order, waiting while the request ring is full
        (at most SEND_TIMEOUT_S, then PeerNotConsumingError); EngineDeadError once it is
        gone."""
        self.ensure_alive()
        link = self._link
        rtype, payload = _message(link, request_type.value[0], *self._encode(link, request))
        try:
            try:
                link.sends.send(rtype, payload, SEND_TIMEOUT_S)
            except BaseException as e:
                if not_sent(e):  # (a timeout, the engine's death, Ctrl-C while it waited)
                    link.channel.discard(rtype, payload)  # its tensors' blocks come back now
                raise
        except (PeerDeadError, ClientClosedError):
            raise self._dead() from None
        except ProtocolError as e:  # the engine broke the request ring's protocol
            raise self._request_ring_broken(e) from None

    def _request_ring_broken(self, e: ProtocolError) -> EngineDeadError:
        """The request ring is broken (the engine stored a position outside the protocol:
        the ring's end closed itself): nothing more can go to the engine, which is taken
        for dead (logged with why; vLLM's EngineDeadError says no more)."""
        from . import log

        log.error("shmclient.vllm: the request ring to the engine is broken: %s", e)
        return self._dead()

    def _close_link(self) -> None:
        self._link_finalizer()


def _message(link: _Link, kind: int, frames, placed: list) -> tuple[int, Any]:
    """``wire.message``; its tensors' arena blocks freed if it raises (a signal handler's
    exception while it packs a large message: no send will ever see them)."""
    try:
        return wire.message(kind, frames, placed)
    except BaseException:
        link.channel.cancel_handles(placed)
        raise


def _shutdown_after(monitor: threading.Thread, client_ref) -> None:
    """Shut the client down as vLLM's engine monitor would have, once it has returned
    (it found the engine-dead flag set by the plug-in, and left the client as it was)."""
    monitor.join()
    client = client_ref()
    if client is not None and client._finalizer.alive:
        client.shutdown()


class _EngineDead:
    """The ``dead`` flag ``waiting.ThreadReader`` reads, over vLLM's: its engine monitor
    marks a dead engine in ``resources.engine_dead`` (an attribute, no event to wait on).
    The plug-in takes the channel's word as final: when the channel says the engine is
    gone (it closed its end), ``wait`` marks it dead at once."""

    __slots__ = ("resources", "closing", "mark")

    def __init__(self, resources, mark) -> None:
        self.resources = resources
        self.mark = mark  # the client's _mark_engine_dead (a WeakMethod: no cycle)
        self.closing = False  # shutdown: readers leave the channel

    def is_set(self) -> bool:
        return self.closing or self.resources.engine_dead

    def wait(self, timeout: float | None = None) -> bool:
        mark = self.mark()
        if mark is None:
            self.resources.engine_dead = True
        else:
            mark()
        return True


class ShmSyncMPClient(_LinkIO, SyncMPClient):
    """vLLM's SyncMPClient with requests and outputs on shared-memory rings."""

    def __init__(self, vllm_config, executor_class, log_stats: bool, renderer=None) -> None:
        self._pending: collections.deque = collections.deque()
        self._lead = threading.Lock()
        self._init_link(
            False, lambda: SyncMPClient.__init__(self, vllm_config, executor_class, log_stats, renderer=renderer)
        )
        self._dead_flag = _EngineDead(self.resources, weakref.WeakMethod(self._mark_engine_dead))
        self._reader = waiting.ThreadReader(
            self._link.channel, self._dispatch, lead=self._lead, dead=self._dead_flag,
            alive=self._alive_check, closed=self._is_closed, dead_error=self._reader_dead_error,
            broken=self._broken)

    # -- reading (in the callers' threads, by turns) ----------------------------------
    def _dispatch(self, messages) -> None:
        """Utility replies resolve their futures, outputs queue for get_output; a message
        whose handling raises is logged and dropped, the others go on."""
        link = self._link
        for rtype, outputs in messages:
            try:
                if link.on_control(rtype, outputs):
                    continue
                if isinstance(outputs, BadMessage):
                    if not _bad_reply(outputs, self.utility_results, link.engine_index):
                        # as vLLM's reader thread: the error goes to get_output
                        self._pending.append(RuntimeError(f"an engine output did not decode: {outputs.error}"))
                elif outputs.utility_output:
                    _utility_reply(outputs.utility_output, self.utility_results, link.engine_index)
                else:
                    self._pending.append(outputs)
            except Exception:
                _dispatch_failed(link.engine_index, rtype, outputs)

    def _alive_check(self) -> bool:
        return not self._dead_flag.is_set()

    def _is_closed(self) -> bool:
        return self._dead_flag.closing

    def _reader_dead_error(self) -> EngineDeadError:
        self._mark_engine_dead()
        self._fail_utilities()
        return EngineDeadError(suppress_context=True)

    def _broken(self, e: Exception) -> EngineDeadError:
        """The output ring is broken: nothing more from it can be trusted."""
        from . import log

        log.error("shmclient.vllm: the output ring from the engine is broken: %s", e)
        return self._reader_dead_error()

    def _fail_utilities(self) -> None:
        for call_id in list(self.utility_results):
            future = self.utility_results.pop(call_id, None)
            if future is not None and not future.done():
                future.set_exception(EngineDeadError())

    def get_output(self) -> EngineCoreOutputs:
        pending = self._pending
        while True:
            try:
                outputs = pending.popleft()  # another thread may have taken the one we saw
                break
            except IndexError:
                pass
            # Once the engine died, what it wrote before comes first, then EngineDeadError.
            self._reader.wait(pending.__len__, None)
        if isinstance(outputs, Exception):
            raise self._format_exception(outputs) from None
        if outputs.wave_complete is not None:
            self.engines_running = False
        return outputs

    def _send_input(self, request_type: EngineCoreRequestType, request: Any) -> None:
        finishable = self._finishable(request_type, request)
        try:
            self._ring_send(request_type, request)
        except BaseException as e:
            # An ADD that did not go (a timeout, a signal while it waited; not the
            # engine's death): the request finishes with an error in the outputs.
            if finishable is not None and not_sent(e) and not isinstance(e, EngineDeadError):
                self._pending.append(_undelivered(self._link.engine_index, finishable, e))
            raise

    def call_utility(self, method: str, *args) -> Any:
        import uuid

        call_id = uuid.uuid1().int >> 64
        future: Future = Future()
        self.utility_results[call_id] = future
        self._send_input(EngineCoreRequestType.UTILITY, (0, call_id, method, args))
        self._reader.wait(future.done, None)
        return future.result()

    def shutdown(self, timeout: float | None = None) -> None:
        try:
            super().shutdown(timeout)
        finally:
            # Readers leave the channel (they look between slices of 0.1 s) before it closes
            # (vLLM's engine monitor may shut down a client still being built: no flag yet).
            flag = getattr(self, "_dead_flag", None)
            if flag is not None:
                flag.closing = True
            # (try_hold: a Ctrl-C as the lead is taken cannot leave it held)
            with waiting.try_hold(self._lead, 2.0):
                self._close_link()
