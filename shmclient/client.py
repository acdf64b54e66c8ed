"""``EngineCoreClient``: the API every client shares, and ``make_client``.

Top layer: imports messages and errors; the concrete clients are imported inside
``make_client`` so that importing ``shmclient`` does not import the engine or start
anything. The base class holds what is written once for every client: request checks a
frontend can do before anything travels, and the named utility methods, each a one-line
``call_utility``. (The async client derives its ``*_async`` forms from this table.)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from .errors import InvalidRequestError
from .messages import EngineCoreOutputs, EngineCoreRequest, LoRARequest

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


def check_request(
    request: Any, *, max_model_len: int, hidden_size: int | None, vocab_size: int | None
) -> None:
    """Refuse a request the engine would refuse, before it travels.

    Raises ``InvalidRequestError`` naming the problem. The engine checks again (it is the
    authority); this only makes the error synchronous and typed on every client.
    """
    if not isinstance(request, EngineCoreRequest):
        raise InvalidRequestError(
            f"add_request() takes an EngineCoreRequest, got {type(request).__name__}"
        )
    rid = request.request_id
    if not isinstance(rid, str) or not rid:
        raise InvalidRequestError(f"request_id must be a non-empty str, got {rid!r}")
    embeds = request.prompt_embeds
    ids = request.prompt_token_ids
    if embeds is not None:
        shape = tuple(getattr(embeds, "shape", ()))
        if len(shape) != 2:
            raise InvalidRequestError(
                f"request {rid!r}: prompt_embeds must be 2-D [num_tokens, hidden_size], "
                f"got shape {shape}"
            )
        if hidden_size is not None and shape[1] != hidden_size:
            raise InvalidRequestError(
                f"request {rid!r}: prompt_embeds width is {shape[1]}, the model's "
                f"hidden_size is {hidden_size}"
            )
        n = shape[0]
    else:
        n = len(ids) if ids is not None else 0
    if n == 0:
        raise InvalidRequestError(f"request {rid!r}: the prompt is empty")
    if n > max_model_len:
        raise InvalidRequestError(
            f"request {rid!r}: the prompt has {n} tokens, more than max_model_len "
            f"({max_model_len})"
        )
    if embeds is None and vocab_size is not None and (min(ids) < 0 or max(ids) >= vocab_size):  # type: ignore[arg-type]
        bad = [t for t in ids if not (0 <= t < vocab_size)]  # type: ignore[union-attr]
        if bad:
            raise InvalidRequestError(
                f"request {rid!r}: token ids {bad[:5]} are outside the vocabulary "
                f"[0, {vocab_size})"
            )
    sp = request.sampling_params
    if sp is not None and sp.max_tokens < 1:
        raise InvalidRequestError(
            f"request {rid!r}: max_tokens must be at least 1, got {sp.max_tokens}"
        )


class EngineCoreClient(ABC):
    """Talks to an EngineCore; the frontend never touches the core directly.

    * ``make_client(False, False, config)`` → ``InprocClient`` (core in this process)
    * ``make_client(True, False, config)``  → ``SyncMPClient`` (core in its own process)
    * ``make_client(True, True, config)``   → ``AsyncMPClient``
    """

    @staticmethod
    def make_client(
        multiprocess_mode: bool, asyncio_mode: bool, config: Any = None
    ) -> "EngineCoreClient":
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
        """Queue a request. Raises InvalidRequestError (this request only) or
        EngineDeadError. Blocks only while the request ring is full."""

    @abstractmethod
    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        """The next batch of outputs (see each client for blocking)."""

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort requests; unknown or finished ids are ignored; [] sends nothing."""

    @abstractmethod
    def call_utility(self, method: str, *args: Any) -> Any:
        """Call an engine method by name and return its result. Raises UtilityCallError
        ("Call to <method> method failed: ...") or EngineDeadError."""

    @abstractmethod
    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the engine and free everything. Idempotent."""

    def __enter__(self) -> "EngineCoreClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # -- named utilities: one line each over call_utility ------------------------------
    def echo(self, x: Any) -> Any:
        return self.call_utility("echo", x)

    def profile(self, is_start: bool = True) -> None:
        self.call_utility("profile", is_start)

    def reset_prefix_cache(self) -> bool:
        return self.call_utility("reset_prefix_cache")

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        self.call_utility("sleep", level, mode)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.call_utility("wake_up", tags)

    def is_sleeping(self) -> bool:
        return self.call_utility("is_sleeping")

    def execute_dummy_batch(self) -> None:
        self.call_utility("execute_dummy_batch")

    def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        return self.call_utility("collective_rpc", method, timeout, args, kwargs)

    def save_sharded_state(
        self, path: str, pattern: str | None = None, max_size: int | None = None
    ) -> None:
        self.call_utility("save_sharded_state", path, pattern, max_size)

    def get_supported_tasks(self) -> tuple[str, ...]:
        return tuple(self.call_utility("get_supported_tasks"))

    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self.call_utility("add_lora", lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.call_utility("remove_lora", lora_id)

    def list_loras(self) -> set[int]:
        return set(self.call_utility("list_loras"))

    def pin_lora(self, lora_id: int) -> bool:
        return self.call_utility("pin_lora", lora_id)


make_client = EngineCoreClient.make_client
