"""``EngineCoreClient``: the API every client shares, and ``make_client``.

Top layer: imports config, messages, errors and validate; the concrete clients are
imported inside ``make_client`` so that importing ``shmclient`` starts nothing. Two
classes, so that no client carries methods it cannot serve: ``EngineCoreClient`` is what
every client has (``make_client``, capacity, ``shutdown``, ``dp_engines_running``, ``with``);
``SyncEngineCoreClient`` adds the blocking API (``add_request``, ``get_output``,
``abort_requests``, ``call_utility`` and the named utilities, each a one-line
``call_utility``) for ``InprocClient`` and ``SyncMPClient``. ``AsyncMPClient`` has the
``*_async`` forms only, written out in its class body. The checks every client runs
before anything travels are ``shmclient.validate``'s (re-exported here). The errors a
client raises: docs/design.md, "Module notes", ``shmclient.client``.
"""

from __future__ import annotations

import math
import threading
from abc import ABC, abstractmethod
from typing import Any

from .config import EngineConfig
from .errors import InvalidRequestError
from .messages import UTILITY_METHODS, EngineCoreOutputs, EngineCoreRequest, LoRARequest
from .validate import check_abort_ids, check_request, check_timeout, check_utility_call

__all__ = [
    "DEFAULT_SHUTDOWN_TIMEOUT_S",
    "EngineCoreClient",
    "SyncEngineCoreClient",
    "UTILITY_METHODS",
    "check_abort_ids",
    "check_request",
    "check_timeout",
    "check_utility_call",
    "make_async_mp_client",
    "make_client",
]


#: What ``shutdown(timeout=None)`` waits for a clean engine exit before SIGTERM (as
#: vLLM, None means this default, never "forever").
DEFAULT_SHUTDOWN_TIMEOUT_S = 5.0


def shutdown_timeout(timeout: Any) -> float:
    """``timeout`` as seconds: None is ``DEFAULT_SHUTDOWN_TIMEOUT_S``; anything but a
    finite number >= 0 raises ``InvalidRequestError`` (a ``ValueError``). More than a
    thread's wait takes (``threading.TIMEOUT_MAX``, centuries) is cut to that."""
    if timeout is None:
        return DEFAULT_SHUTDOWN_TIMEOUT_S
    if (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0
            or (isinstance(timeout, float) and not math.isfinite(timeout))):
        raise InvalidRequestError(
            f"shutdown(): timeout={timeout!r} is invalid: must be a finite number of "
            "seconds >= 0, or None for the default")
    return min(timeout, _LONGEST_WAIT_S) * 1.0


#: The longest shutdown timeout, with room for what is added to it (a thread's wait
#: raises OverflowError past ``threading.TIMEOUT_MAX``).
_LONGEST_WAIT_S = threading.TIMEOUT_MAX / 2


def takes_keyword(fn: Any, name: str) -> bool:
    """Whether ``fn`` (a class: its constructor) can be called with keyword ``name``: a
    subclass with an ``__init__`` of its own may not take the private ones."""
    import inspect

    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind is p.VAR_KEYWORD or (p.name == name and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
               for p in params)


async def build_in_thread(cls: Any, config: Any) -> Any:
    """``cls(config, _abandon=event)`` in the loop's default executor, without blocking
    the loop (an asynchronous client's ``create``; ``cls(config)`` for a constructor
    that does not take ``_abandon``, e.g. a subclass's own). Cancelled meanwhile
    (``asyncio.wait_for`` ran out, Ctrl-C under ``asyncio.run``), ``event`` is set: a start
    still waiting for its engine(s) gives up within a poll slice (0.1 s) and stops what
    it started, instead of waiting out ``engine_ready_timeout_s`` while ``asyncio.run``
    (which waits for that executor) and the interpreter's exit wait for it. A client
    built as the wait was cancelled is shut down in that executor, never left with its
    engines running for the garbage collector to find."""
    import asyncio
    import threading

    lock = threading.Lock()
    abandon = threading.Event()
    state: dict = {"abandoned": False, "client": None}
    kwargs = {"_abandon": abandon} if takes_keyword(cls, "_abandon") else {}

    def build() -> Any:
        if abandon.is_set():  # cancelled before this thread ran: start nothing
            return None
        client = cls(config, **kwargs)
        with lock:
            if not state["abandoned"]:
                state["client"] = client
                return client
        client.shutdown()
        return None

    loop = asyncio.get_running_loop()
    try:
        return await loop.run_in_executor(None, build)
    except asyncio.CancelledError:
        with lock:
            state["abandoned"] = True
            client = state["client"]
        abandon.set()
        if client is not None:  # built as the wait was cancelled
            loop.run_in_executor(None, client.shutdown)
        raise


class EngineCoreClient(ABC):
    """Talks to an EngineCore; the frontend never touches the core directly.

    * ``make_client(False, False, config)`` → ``InprocClient`` (core in this process)
    * ``make_client(True, False, config)``  → ``SyncMPClient`` (core in its own process)
    * ``make_client(True, True, config)``   → ``make_async_mp_client(config)``:
      ``AsyncMPClient``, or with ``data_parallel_size > 1`` ``DPLBAsyncMPClient``
      (``DPAsyncMPClient`` with ``data_parallel_external_lb``)

    Every client checks each request, abort and utility call at the door (types and
    ranges of every field, ``shmclient.validate``) and raises ``InvalidRequestError``
    naming the field before anything travels. A client is a context manager: leaving the
    ``with`` block calls ``shutdown()`` (``AsyncMPClient``: ``async with`` and
    ``shutdown_async()``). After ``shutdown()`` every call raises ``EngineDeadError``
    (``ClientClosedError``, a subclass). The blocking API is ``SyncEngineCoreClient``'s;
    the asyncio one ``AsyncMPClient``'s.
    """

    @staticmethod
    def make_client(
        multiprocess_mode: bool, asyncio_mode: bool, config: EngineConfig | None = None
    ) -> "EngineCoreClient":
        """Build the client for a frontend, as vLLM's ``EngineCoreClient.make_client``.

        ``multiprocess_mode``: run the engine core in its own process (``SyncMPClient``,
        or ``AsyncMPClient`` with ``asyncio_mode``) instead of in this one
        (``InprocClient``). ``config``: an ``shmclient.config.EngineConfig`` (the default
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
            config = EngineConfig()
        if not multiprocess_mode:
            from .client_inproc import InprocClient

            return InprocClient(config)
        if asyncio_mode:
            return EngineCoreClient.make_async_mp_client(config)
        from .client_mp import SyncMPClient

        return SyncMPClient(config)

    @staticmethod
    def make_async_mp_client(config: EngineConfig | None = None) -> "EngineCoreClient":
        """The asyncio multiprocess client for ``config``, with vLLM's rules:
        ``data_parallel_size > 1`` gives ``DPAsyncMPClient`` (one rank per client behind
        an external load balancer) with ``data_parallel_external_lb``, else
        ``DPLBAsyncMPClient`` (every rank behind this client, load-balanced); size 1
        gives ``AsyncMPClient``. Blocks and raises as ``make_client``; a DP client
        starts its engines concurrently."""
        if config is None:
            config = EngineConfig()
        if config.data_parallel_size > 1:
            from .client_dp import DPAsyncMPClient
            from .client_dp_lb import DPLBAsyncMPClient

            if config.data_parallel_external_lb:
                return DPAsyncMPClient(config)
            return DPLBAsyncMPClient(config)
        from .client_async import AsyncMPClient

        return AsyncMPClient(config)

    # -- capacity, as reported by the engine -------------------------------------------
    num_gpu_blocks: int
    block_size: int
    max_model_len: int

    @abstractmethod
    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the engine and free everything. Idempotent; later calls on the client
        raise ``EngineDeadError``. A multiprocess client waits up to ``timeout`` seconds
        (None: ``DEFAULT_SHUTDOWN_TIMEOUT_S``, never forever) for the engine to exit,
        then sends SIGTERM and, 2 s later, SIGKILL: it returns within about
        ``timeout + 2`` s even when the engine hangs. InvalidRequestError for a timeout
        that is not a finite number >= 0."""

    def __enter__(self) -> "EngineCoreClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def dp_engines_running(self) -> bool:
        """Whether data-parallel engines are collectively running. One engine, no data
        parallelism: always False, as vLLM's non-DP clients answer. No engine call."""
        return False



class SyncEngineCoreClient(EngineCoreClient):
    """The blocking client API: ``InprocClient`` and ``SyncMPClient``. Each named utility
    is a one-line ``call_utility``; ``AsyncMPClient`` has the same list as ``*_async``
    methods (a test keeps the two in step with ``UTILITY_METHODS``)."""

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
    def call_utility(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        """Call an engine method by name and return its result. Raises UtilityCallError
        ("Call to <method> method failed: <message>", as vLLM), InvalidRequestError for
        a ``method`` that is not a non-empty str or a ``timeout`` that is not a number
        >= 0 or None, SerializationError for arguments that cannot cross, or
        EngineDeadError. A multiprocess client waits ``timeout`` seconds at most (None,
        as vLLM: as long as the engine lives) for room in the request ring and the
        reply together, then raises a ``TimeoutError``: PeerNotConsumingError (the call
        was not sent) or PeerNotProducingError (sent and not answered: it may still run
        in the engine; its reply is dropped)."""

    # -- named utilities: one line each over call_utility ------------------------------
    def echo(self, x: Any) -> Any:
        """Return ``x`` after a round trip through the engine (tensors included)."""
        return self.call_utility("echo", x)

    def profile(
        self,
        is_start: bool = True,
        profile_prefix: str | None = None,
        delay_iterations: int | None = None,
        max_iterations: int | None = None,
    ) -> None:
        """Start (``is_start``) or stop the engine's step profiler, as vLLM's: skip
        ``delay_iterations`` steps, stop by itself after ``max_iterations``; the summary
        is logged under ``profile_prefix`` when it stops."""
        self.call_utility("profile", is_start, profile_prefix, delay_iterations, max_iterations)

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        """Drop the engine's cached KV; True when it was reset. With requests running
        and ``reset_running_requests`` False nothing is dropped and the answer is False
        (as vLLM); with it True the running requests are preempted (recomputed later,
        no token lost). The engine has no KV connector: ``reset_connector`` succeeds."""
        return self.call_utility("reset_prefix_cache", reset_running_requests, reset_connector)

    def reset_mm_cache(self) -> None:
        """vLLM's multi-modal cache reset; this engine caches no multi-modal data."""
        self.call_utility("reset_mm_cache")

    def reset_encoder_cache(self) -> None:
        """vLLM's encoder cache reset; the models here have no encoder."""
        self.call_utility("reset_encoder_cache")

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Pause the scheduler as ``pause_scheduler(mode)``, then free memory: level 0
        pauses only, level 1 frees the KV cache and offloads the weights, level 2 drops
        them. In ``mode="wait"`` the call returns once the running requests finished."""
        self.call_utility("sleep", level, mode)

    def release_kv_cache_memory(self) -> None:
        """Free the engine's KV cache memory (vLLM's): only after a pause has completed,
        with no request left and the engine not asleep (else ``UtilityCallError``
        carrying the engine's RuntimeError). ``wake_up(["kv_cache"])`` undoes it."""
        self.call_utility("release_kv_cache_memory")

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Undo ``sleep`` for ``tags`` ("weights", "kv_cache", "scheduling"; None: all);
        scheduling resumes once nothing is asleep. True when fully awake."""
        return self.call_utility("wake_up", tags)

    def is_sleeping(self) -> bool:
        """Whether the engine is asleep at any level (level 0: its scheduler paused)."""
        return self.call_utility("is_sleeping")

    def pause_scheduler(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """Schedule nothing new until ``resume_scheduler``; requests added meanwhile
        are queued. ``mode``: "abort" every request, "wait" until the running ones
        finished (the call returns then), or "keep" them (their state is kept). With
        ``clear_cache`` the cached KV is dropped once paused."""
        self.call_utility("pause_scheduler", mode, clear_cache)

    def resume_scheduler(self) -> None:
        """Undo ``pause_scheduler``: queued and kept requests run again."""
        self.call_utility("resume_scheduler")

    def is_scheduler_paused(self) -> bool:
        """Whether the engine's scheduler is paused."""
        return self.call_utility("is_scheduler_paused")

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

    def set_weight_version(self, weight_version: str) -> None:
        """Label the weights now loaded (read back with ``get_weight_version``)."""
        self.call_utility("set_weight_version", weight_version)

    def get_weight_version(self) -> str:
        """The label set by ``set_weight_version``; "default" until one was set."""
        return self.call_utility("get_weight_version")


make_client = EngineCoreClient.make_client
make_async_mp_client = EngineCoreClient.make_async_mp_client
