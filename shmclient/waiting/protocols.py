"""The interface the waits and readers are written against: what a channel or a ring end
must offer to be waited on, and the optional capabilities a channel may have.

Waiting layer (part of ``shmclient.waiting``): imports nothing of the package. The
Protocols name calls, never classes: ``Channel`` is ``channel.ShmChannel`` and
``channel_zmq.ZmqChannel``, ``Sender`` a ``ring_producer.RingProducer``, ``RecordReceiver`` a
``ring_consumer.RingConsumer``; none of them is imported here or anywhere in ``waiting``.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

__all__ = ["AsyncSender", "CAPABILITIES", "FLAGS", "Channel", "ChannelCapabilities", "EarlyWake", "Flag",
           "Receiver", "RecordReceiver", "Sender"]

@runtime_checkable
class Receiver(Protocol):
    """What ``recv`` and ``recv_spin`` need: a try and one wait."""

    def recv_nowait(self, limit: int = 0) -> list[tuple[int, Any]]: ...

    def wait_recv(self, timeout: float, *, spin: float | None = None, first: bool = True) -> bool: ...


@runtime_checkable
class RecordReceiver(Protocol):
    """What ``recv_into`` needs: a ring consumer end (zero-copy records)."""

    def recv_into(self, handler: Callable[[int, memoryview], Any], limit: int = 0) -> int: ...

    def wait_recv(self, timeout: float, *, spin: float | None = None, first: bool = True) -> bool: ...


@runtime_checkable
class Sender(Protocol):
    """What ``send`` needs: a try, one wait, and giving up a half-sent message."""

    def send_nowait(self, rtype: int, payload: Any) -> None: ...

    def wait_send(self, timeout: float, *, spin: float | None = None, first: bool = True) -> bool: ...

    def abandon(self, payload: Any) -> None: ...


@runtime_checkable
class AsyncSender(Sender, Protocol):
    """What ``send_async`` needs beyond ``Sender``: the descriptor to park on."""

    def send_fd(self) -> int: ...

    def arm_send(self) -> None: ...


@runtime_checkable
class Channel(AsyncSender, Receiver, Protocol):
    """A channel: both directions with their descriptors, as the clients, the engine loop
    and the vLLM plug-in use it (``channel.ShmChannel`` and ``channel_zmq.ZmqChannel``)."""

    def encode(self, obj: Any) -> Any: ...

    def try_recv(self, limit: int = 0) -> list[tuple[int, Any]]: ...

    def recv_fd(self) -> int: ...

    def arm_recv(self) -> None: ...

    def close(self) -> None: ...


class ChannelCapabilities(Protocol):
    """What a channel may or may not be able to do, each an attribute that is None where
    it cannot (``ZmqChannel`` has none but ``wait_registered``, ``ShmChannel`` all but
    that one): whoever sets a channel up calls what is there, never asks for a type.

    * ``handle_fds()``: the fds a child must inherit to attach;
    * ``wait_registered(timeout)``: wait until the peer has connected;
    * ``peer_attached()``: the peer has attached: release the handles;
    * ``set_peer_pid(pid)``, ``set_peer_gpus(uuids)``: who the peer is (tensor handles);
    * ``flush_releases()``: send the peer the releases of its tensor blocks now.

    And two flags: ``late_after_peer_death``, whether what the peer sent just before it
    died may still arrive after its death was noticed (ZMQ's IO threads; not a ring), and
    ``arm_after_read``, whether a reader re-arms ``recv_fd()`` after reading rather than
    before (the ring's wake pipe, readable again at once for a record still unread; not
    an edge-triggered socket descriptor)."""

    handle_fds: Callable[[], tuple[int, ...]] | None
    wait_registered: Callable[[float], None] | None
    peer_attached: Callable[[], None] | None
    set_peer_pid: Callable[[int], None] | None
    set_peer_gpus: Callable[[list[str]], None] | None
    flush_releases: Callable[[], None] | None
    late_after_peer_death: bool
    arm_after_read: bool


class EarlyWake(Protocol):
    """A peer that may wake a parked reader just before it publishes (the vLLM plug-in's
    engine, as its scheduler starts a step's outputs), so that the reader's wake-up and
    the peer's encoding overlap. ``LoopReader`` arms it while a task is parked and asks,
    on a wake-up that found nothing, how long to spin for the announced publish."""

    def arm(self) -> None:
        """A task parks: let the peer wake it early, if that pays now."""

    def disarm(self) -> None:
        """The task is awake: no early wake-up wanted."""

    def fired(self) -> float:
        """On a wake-up that found nothing: seconds to spin for the publish the peer
        announced (0.0: it announced none). Disarms."""

    def after(self, paid: bool) -> None:
        """How that spin ended: the publish came within it, or not."""


class Flag(Protocol):
    """What ``ThreadReader`` needs of its ``dead`` flag (a ``threading.Event`` does)."""

    def is_set(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> bool: ...


#: The optional capabilities' names (``ChannelCapabilities``).
CAPABILITIES = ("handle_fds", "wait_registered", "peer_attached", "set_peer_pid", "set_peer_gpus",
                "flush_releases")
#: The flags every channel sets (``ChannelCapabilities``).
FLAGS = ("late_after_peer_death", "arm_after_read")
