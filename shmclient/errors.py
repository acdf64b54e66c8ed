"""Every exception shmclient raises, in one place.

Lowest layer together with ``shm`` and ``ring``: imports nothing from the package. Each
class says who raises it. Users catch ``ShmClientError`` for "anything from us",
``EngineDeadError`` for "the engine is gone, build a new client".
"""

from __future__ import annotations


class ShmClientError(Exception):
    """Base of every error shmclient raises on purpose."""


class ConfigError(ShmClientError, ValueError):
    """An ``EngineConfig`` value is invalid; the message names the field."""


class InvalidRequestError(ShmClientError, ValueError):
    """A request was rejected (empty prompt, too long, duplicate id, ...).

    Only that request is refused; the engine keeps serving the others.
    """


class DuplicateRequestError(InvalidRequestError):
    """A request names the id of a request that is live in the engine. An engine core
    raises it from ``add_request``; the engine loop then answers nothing under that id
    (what comes under it belongs to the live request) and logs a warning."""


class PeerDeadError(ShmClientError, RuntimeError):
    """The process on the other side of a ring or socket is gone."""


class EngineDeadError(PeerDeadError):
    """The engine core process died or reported a fatal error.

    Every pending and later call on the client raises this; the client cannot recover.
    """

    def __init__(self, message: str | None = None, *, suppress_context: bool = False) -> None:
        super().__init__(
            message
            or "EngineCore encountered an issue. See stack trace (above) for the root cause."
        )
        self.__suppress_context__ = suppress_context


class ClientClosedError(EngineDeadError):
    """This side was closed (``shutdown()`` / ``close()``) and cannot be used again.

    Raised by a client called after its ``shutdown()`` (and by a ring end used after its
    ``close()``). It is an ``EngineDeadError``, as vLLM raises for calls after shutdown:
    code written for vLLM catches it as that, code written for shmclient may catch it
    by this name.
    """


class ForkedError(ClientClosedError):
    """A ring end or client was used in a process forked from the one that made it.

    A child made with ``os.fork()`` shares its parent's rings and engine but not their
    positions: anything it wrote would reach the parent's engine out of turn and leave
    the parent writing from a stale position. So every use in the child raises this
    and leaves the parent's rings and engine untouched; build a new client in the
    child instead.
    """


class WaitNotSupportedError(InvalidRequestError):
    """``mode="wait"`` of ``sleep`` / ``pause_scheduler`` asked of an engine that nothing
    steps while the caller waits (in-process). Raised by the engine core; ``InprocClient``
    passes it on unwrapped. A ``ValueError``, as vLLM's in-process engine raises."""


class ProtocolError(ShmClientError, RuntimeError):
    """The channel itself is broken: a record of unknown type, corrupt framing, a message
    that violates the protocol. Fatal for the channel (unlike a single message that does
    not decode, which fails alone)."""


class RingCorruptError(ProtocolError):
    """The peer wrote something into the shared ring that it could not have written by
    the protocol: a position out of its bounds or misaligned, a record or PAD that does
    not fit below the published head, a fragmented message longer than any message.
    Raised by the ring's C end, which then closes its end (the peer sees it closed);
    the message names the field, its value and the bound. Every later call on that end
    raises it again."""


class UsageError(ShmClientError, TypeError, RuntimeError):
    """A client was called in a way it does not support (an ``AsyncMPClient`` used from a
    second event loop); the message says what to do instead. (``AsyncMPClient`` has no
    blocking methods at all, only the ``*_async`` forms: a blocking call on it is an
    ``AttributeError`` a type checker sees.)"""


class WouldBlock(ShmClientError, BlockingIOError):
    """A ``*_nowait`` call could not go ahead without waiting: nothing to receive, no room
    to send (or another thread of this side holds the end). Nothing was lost: retry
    after waiting on the channel's wait handle (``shmclient.waiting``)."""


class EndBusy(WouldBlock):
    """The ``WouldBlock`` of a receive refused because another thread of this side is in
    a call on the end (its handler may run long): the wait handle may say ready at once
    meanwhile, so a waiter backs off instead of retrying at once."""


class PeerTimeoutError(ShmClientError, TimeoutError):
    """A bounded wait on the peer ran out. Subclasses say which side is stalled."""


class PeerNotConsumingError(PeerTimeoutError):
    """The ring stayed full for the whole timeout: the peer is not consuming."""


class PeerNotProducingError(PeerTimeoutError):
    """Nothing arrived for the whole timeout: the peer is not producing."""


class ShmCapacityError(ShmClientError, OSError):
    """The shared memory a ring, arena or channel needs cannot be reserved; raised at
    creation (naming the bytes), never later."""


class AuthenticationError(ShmClientError, PermissionError):
    """The peer of a remote (tcp) engine start-up could not prove it knows the shared
    secret, or a side has none (``shmclient.auth``); the message says which side and
    why. Raised by the frontend's client constructor and by a ``--connect`` engine."""


class UtilityCallError(ShmClientError, RuntimeError):
    """A utility method raised in the engine: ``Call to <method> method failed: <msg>``."""


class SerializationError(ShmClientError, TypeError):
    """A value cannot cross the boundary (unsupported type, tensor needing grad, ...)."""


#: What a send (``shmclient.waiting.send`` / ``send_async``) raises when its message
#: certainly did not go whole (a timeout on a full ring, the peer's death, a closed
#: channel): the blocks its tensors were placed in may be freed (``ShmChannel.discard``).
#: Any other exception (a signal handler's) may have come after the record was
#: published: it leaves them, unless ``not_sent`` says otherwise.
NOT_SENT = (PeerNotConsumingError, PeerDeadError)


def mark_not_sent(e: BaseException) -> None:
    """Note on ``e`` (raised while a send waited for room or for its turn: a signal
    handler's KeyboardInterrupt) that its message certainly did not go whole."""
    try:
        e.shmclient_not_sent = True  # type: ignore[attr-defined]
    except AttributeError:  # pragma: no cover - an exception type without a __dict__
        pass


def not_sent(e: BaseException) -> bool:
    """Whether the send that raised ``e`` certainly did not publish its message whole
    (one of ``NOT_SENT``, or raised while it waited: ``mark_not_sent``), so the blocks its
    tensors were placed in may be freed. False where it may have gone (an exception
    from inside the write itself, e.g. right after it published): those blocks stay."""
    return isinstance(e, NOT_SENT) or getattr(e, "shmclient_not_sent", False) is True
