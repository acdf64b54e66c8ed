"""``EngineCoreClient``: the API every client shares, and ``make_client``.

Top layer: imports messages, errors and validate; the concrete clients are imported
inside ``make_client`` so that importing ``shmclient`` does not import the engine or start
anything. The base class holds what is written once for every client: the named utility
methods, each a one-line ``call_utility`` (the async client derives its ``*_async`` forms
from this table). The checks every client runs before anything travels are
``shmclient.validate``'s (re-exported here as ``check_request``).

Errors a client raises are all ``ShmClientError`` subclasses, each also the builtin that
vLLM code catches: ``InvalidRequestError`` (``ValueError``) for a request, abort or call
refused at the door or by the engine, ``EngineDeadError`` (``RuntimeError``) once the
engine is gone or the client was shut down (``ClientClosedError`` is a subclass),
``UtilityCallError`` for a utility that failed in the engine, ``SerializationError``
(``TypeError``) for a value that cannot cross, ``ConfigError`` (``ValueError``) for a
configuration the engine cannot run, ``PeerNotProducingError`` (``TimeoutError``) for a
timed-out wait.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from .messages import EngineCoreOutputs, EngineCoreRequest, LoRARequest
from .validate import check_abort_ids, check_request, check_utility_call

__all__ = [
    "EngineCoreClient",
    "UTILITY_METHODS",
    "check_abort_ids",
    "check_request",
    "check_utility_call",
    "make_client",
]

#: The engine methods a frontend may call by name (``call_utility``).
UTILITY_METHODS = (
    "echo",
    "profile",
    "reset_prefix_cache",
    "sleep",
    "wake_up",
    "is_sleeping",
    "execute_dummy_batch",
    "collective_rpc",
    "save_sharded_state",
    "get_supported_tasks",
    "add_lora",
    "remove_lora",
    "list_loras",
    "pin_lora",
)


class EngineCoreClient(ABC):
    """Talks to an EngineCore; the frontend never touches the core directly.

    * ``make_client(False, False, config)`` → ``InprocClient`` (core in this process)
    * ``make_client(True, False, config)``  → ``SyncMPClient`` (core in its own process)
    * ``make_client(True, True, config)``   → ``AsyncMPClient``

    Every client checks each request, abort and utility call at the door (types and
    ranges of every field, ``shmclient.validate``) and raises ``InvalidRequestError``
    naming the field before anything travels. A client is a context manager: leaving the
    ``with`` block calls ``shutdown()``. After ``shutdown()`` every call raises
    ``EngineDeadError`` (``ClientClosedError``, a subclass).
    """

    @staticmethod
    def make_client(
        multiprocess_mode: bool, asyncio_mode: bool, config: Any = None
    ) -> "EngineCoreClient":
        """Build the client for a frontend, as vLLM's ``EngineCoreClient.make_client``.

        ``multiprocess_mode``: run the engine core in its own process (``SyncMPClient``,
        or ``AsyncMPClient`` with ``asyncio_mode``) instead of in this one
        (``InprocClient``). ``config``: an ``engine.config.EngineConfig`` (the default
        one if None); ``config.transport`` picks shared memory (``"shm"``) or ZMQ.

        Blocks until the engine is ready (for a multiprocess client: the engine process
        has started and answered, up to ``engine_ready_timeout_s``). Raises
        ``NotImplementedError`` for asyncio without multiprocessing (as vLLM),
        ``ConfigError`` for a configuration the engine cannot run (e.g. ``device="cuda"``
        without a GPU), ``PeerNotProducingError`` (a ``TimeoutError``) when the engine
        is not ready in time and ``EngineDeadError`` when it dies while starting.
        """
        if asyncio_mode and not multiprocess_mode:
            raise NotImplementedError(
                "Running EngineCore in asyncio without multiprocessing is not supported."
            )
        if config is None:
            from engine.config import EngineConfig

            config = EngineConfig()
        if not multiprocess_mode:
            from .client_inproc import InprocClient

            return InprocClient(config)
        if asyncio_mode:
            from .client_async import AsyncMPClient

            return AsyncMPClient(config)
        from .client_mp import SyncMPClient

        return SyncMPClient(config)

    # -- capacity, as reported by the engine -------------------------------------------
    num_gpu_blocks: int
    block_size: int
    max_model_len: int

    # -- the core API ------------------------------------------------------------------
    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request. Raises InvalidRequestError naming the field (this request
        only; nothing was sent) or EngineDeadError. Blocks only while the request ring is
        full. A request the engine refuses later finishes with ``FinishReason.ERROR``."""

    @abstractmethod
    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        """The next batch of outputs (see each client for blocking)."""

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort requests; unknown or finished ids are ignored; [] sends nothing.
        Raises InvalidRequestError for anything but a list (or other iterable) of str,
        e.g. a single id not wrapped in a list."""

    @abstractmethod
    def call_utility(self, method: str, *args: Any) -> Any:
        """Call an engine method by name and return its result. Raises UtilityCallError
        ("Call to <method> method failed: <message>", as vLLM), InvalidRequestError for
        a ``method`` that is not a non-empty str, SerializationError for arguments that
        cannot cross, or EngineDeadError."""

    @abstractmethod
    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the engine and free everything. Idempotent; later calls on the client
        raise ``EngineDeadError``."""

    def __enter__(self) -> "EngineCoreClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # -- named utilities: one line each over call_utility ------------------------------
    def echo(self, x: Any) -> Any:
        """Return ``x`` after a round trip through the engine (tensors included)."""
        return self.call_utility("echo", x)

    def profile(self, is_start: bool = True) -> None:
        """Start (``is_start``) or stop the engine's profiler."""
        self.call_utility("profile", is_start)

    def reset_prefix_cache(self) -> bool:
        """Drop the engine's prefix cache; True when it was reset."""
        return self.call_utility("reset_prefix_cache")

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Free the KV cache (level 1 also offloads, level 2 drops the weights).
        ``mode``: "abort" running requests, "wait" for them to finish, or "keep" them."""
        self.call_utility("sleep", level, mode)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Undo ``sleep`` for ``tags`` ("weights", "kv_cache"; None: both)."""
        self.call_utility("wake_up", tags)

    def is_sleeping(self) -> bool:
        """Whether the engine is asleep."""
        return self.call_utility("is_sleeping")

    def execute_dummy_batch(self) -> None:
        """Run the model once on a throw-away request (warm-up)."""
        self.call_utility("execute_dummy_batch")

    def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Call ``method`` on every model worker; a list of their results."""
        return self.call_utility("collective_rpc", method, timeout, args, kwargs)

    def save_sharded_state(
        self, path: str, pattern: str | None = None, max_size: int | None = None
    ) -> None:
        """Save the model's state under ``path`` in parts of at most ``max_size`` bytes."""
        self.call_utility("save_sharded_state", path, pattern, max_size)

    def get_supported_tasks(self) -> tuple[str, ...]:
        """The tasks the engine serves ("generate", "embed", ...)."""
        return tuple(self.call_utility("get_supported_tasks"))

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register a LoRA adapter; True on success."""
        return self.call_utility("add_lora", lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        """Unregister a LoRA adapter; True if it was registered."""
        return self.call_utility("remove_lora", lora_id)

    def list_loras(self) -> set[int]:
        """The ids of the registered LoRA adapters."""
        return set(self.call_utility("list_loras"))

    def pin_lora(self, lora_id: int) -> bool:
        """Keep a LoRA adapter loaded; False if it is not registered."""
        return self.call_utility("pin_lora", lora_id)


make_client = EngineCoreClient.make_client
