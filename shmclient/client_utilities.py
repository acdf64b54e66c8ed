"""The named utility calls of the asyncio clients (vLLM's ``*_async`` methods), written
once for every async client, and their fan-out over a data-parallel group.

Client layer: imports ``messages``, ``errors`` and ``validate``; never a client module.
``AsyncUtilities`` spells out each of vLLM's ``AsyncMPClient`` utilities with vLLM's
signature (so type checkers and IDEs see them) and sends it through
``self._utility(name, *args)``, which each client defines: one engine answers for
``AsyncMPClient``; ``DPUtilities`` calls every engine of a data-parallel client and
combines their answers as ``DP_RULES`` says, as vLLM's DP clients do.
"""

from __future__ import annotations

import asyncio
from typing import Any

from .errors import EngineDeadError, UtilityCallError
from .messages import LoRARequest
from .validate import check_timeout, check_utility_call

__all__ = ["AsyncUtilities", "DPUtilities", "DP_RULES"]

#: How a data-parallel client answers a utility, when not by the first engine's result
#: (vLLM's rule): "all" calls every engine and is True when all were; "consensus" calls
#: every engine and returns their common answer (RuntimeError when they differ).
DP_RULES: dict[str, str] = {
    "reset_prefix_cache": "all",
    "wake_up": "all",
    "is_sleeping": "consensus",
    "is_scheduler_paused": "consensus",
    "get_weight_version": "consensus",
}


class AsyncUtilities:
    """vLLM's named ``*_async`` utility calls over ``self._utility``."""

    async def _utility(self, method: str, *args: Any) -> Any:  # pragma: no cover - each client's
        raise NotImplementedError

    async def echo_async(self, x: Any) -> Any:
        """Async form of ``echo``."""
        return await self._utility("echo", x)

    async def profile_async(
        self,
        is_start: bool = True,
        profile_prefix: str | None = None,
        delay_iterations: int | None = None,
        max_iterations: int | None = None,
    ) -> None:
        """Async form of ``profile``."""
        await self._utility("profile", is_start, profile_prefix, delay_iterations, max_iterations)

    async def reset_prefix_cache_async(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        """Async form of ``reset_prefix_cache``."""
        return await self._utility("reset_prefix_cache", reset_running_requests, reset_connector)

    async def reset_mm_cache_async(self) -> None:
        """Async form of ``reset_mm_cache``."""
        await self._utility("reset_mm_cache")

    async def reset_encoder_cache_async(self) -> None:
        """Async form of ``reset_encoder_cache``."""
        await self._utility("reset_encoder_cache")

    async def sleep_async(self, level: int = 1, mode: str = "abort") -> None:
        """Async form of ``sleep``."""
        await self._utility("sleep", level, mode)

    async def release_kv_cache_memory_async(self) -> None:
        """Async form of ``release_kv_cache_memory``."""
        await self._utility("release_kv_cache_memory")

    async def wake_up_async(self, tags: list[str] | None = None) -> bool:
        """Async form of ``wake_up``."""
        return await self._utility("wake_up", tags)

    async def is_sleeping_async(self) -> bool:
        """Async form of ``is_sleeping``."""
        return await self._utility("is_sleeping")

    async def pause_scheduler_async(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """Async form of ``pause_scheduler``."""
        await self._utility("pause_scheduler", mode, clear_cache)

    async def resume_scheduler_async(self) -> None:
        """Async form of ``resume_scheduler``."""
        await self._utility("resume_scheduler")

    async def is_scheduler_paused_async(self) -> bool:
        """Async form of ``is_scheduler_paused``."""
        return await self._utility("is_scheduler_paused")

    async def execute_dummy_batch_async(self) -> None:
        """Async form of ``execute_dummy_batch``."""
        await self._utility("execute_dummy_batch")

    async def collective_rpc_async(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Async form of ``collective_rpc``."""
        return await self._utility("collective_rpc", method, timeout, args, kwargs)

    async def save_sharded_state_async(
        self, path: str, pattern: str | None = None, max_size: int | None = None
    ) -> None:
        """Async form of ``save_sharded_state``."""
        await self._utility("save_sharded_state", path, pattern, max_size)

    async def get_supported_tasks_async(self) -> tuple[str, ...]:
        """Async form of ``get_supported_tasks``."""
        return tuple(await self._utility("get_supported_tasks"))

    async def add_lora_async(self, lora_request: LoRARequest) -> bool:
        """Async form of ``add_lora``."""
        return await self._utility("add_lora", lora_request)

    async def remove_lora_async(self, lora_id: int) -> bool:
        """Async form of ``remove_lora``."""
        return await self._utility("remove_lora", lora_id)

    async def list_loras_async(self) -> set[int]:
        """Async form of ``list_loras``."""
        return set(await self._utility("list_loras"))

    async def pin_lora_async(self, lora_id: int) -> bool:
        """Async form of ``pin_lora``."""
        return await self._utility("pin_lora", lora_id)

    async def set_weight_version_async(self, weight_version: str) -> None:
        """Async form of ``set_weight_version``."""
        await self._utility("set_weight_version", weight_version)

    async def get_weight_version_async(self) -> str:
        """Async form of ``get_weight_version``."""
        return await self._utility("get_weight_version")


def _abandon(fut: asyncio.Future) -> None:
    """Cancel ``fut``, whose outcome nobody will read: read it once it comes (a gather
    cancelled ends with its CancelledError as its exception, which asyncio would log as
    never retrieved, with a traceback at ERROR level)."""
    fut.cancel()
    fut.add_done_callback(lambda f: f.cancelled() or f.exception())


class DPUtilities(AsyncUtilities):
    """The utility calls of a data-parallel client: each goes to every engine of
    ``self.engines`` (engine clients with ``call_utility_async``) at once. The client
    provides ``engine_ranks``, ``engine_pids``, ``_bind()``, ``_ensure_alive()``,
    ``_dead_error()``, ``_dead_fut`` (done once an engine died), ``_closed``,
    ``_dead_reason`` and ``_death`` (set once any thread saw an engine die)."""

    async def _guard(self, aw: Any) -> Any:
        """Await ``aw``, or raise EngineDeadError as soon as any engine died."""
        dead = self._dead_fut
        fut = asyncio.ensure_future(aw)
        try:
            await asyncio.wait((fut, dead), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            _abandon(fut)
            raise
        if fut.done():
            return fut.result()
        _abandon(fut)
        raise self._dead_error()

    async def call_utility_all_async(self, method: str, *args: Any,
                                     timeout: float | None = None) -> list[Any]:
        """Call ``method(*args)`` on every engine at once; their results in rank order.
        Raises UtilityCallError when it failed on an engine, InvalidRequestError for a
        ``method`` that is not a non-empty str or a bad ``timeout``, SerializationError
        for arguments that cannot cross, EngineDeadError when an engine died (also
        while waiting), a ``TimeoutError`` when an engine took no call or gave no reply
        within ``timeout`` seconds (None: no limit; see
        ``SyncEngineCoreClient.call_utility``)."""
        timeout = check_timeout("call_utility_all_async", timeout)
        self._bind()
        self._ensure_alive()
        check_utility_call(method)
        calls = [asyncio.ensure_future(self._call_on(i, method, args, timeout))
                 for i in range(len(self.engines))]
        return await self._guard(asyncio.gather(*calls))

    async def _call_on(self, pos: int, method: str, args: tuple,
                       timeout: float | None) -> Any:
        try:
            return await self.engines[pos].call_utility_async(method, *args, timeout=timeout)
        except EngineDeadError as e:
            # Its engine's death, said as the client says it (which engine, why).
            if self._closed or self._dead_reason is not None or self._death is not None:
                raise self._dead_error() from e
            raise EngineDeadError(
                f"data-parallel engine {self.engine_ranks[pos]} (pid "
                f"{self.engine_pids[pos]}) died: {e}") from e

    async def call_utility_async(self, method: str, *args: Any,
                                 timeout: float | None = None) -> Any:
        """Call ``method(*args)`` on this client's engine (``DPLBAsyncMPClient``: on
        every engine, returning the first's result, as vLLM). Errors and ``timeout``
        as ``call_utility_all_async``."""
        return (await self.call_utility_all_async(method, *args, timeout=timeout))[0]

    async def call_utility_consensus_async(self, method: str, *args: Any,
                                           timeout: float | None = None) -> Any:
        """Call ``method(*args)`` on every engine; their common result.
        UtilityCallError when the engines disagree (vLLM raises a RuntimeError, which
        UtilityCallError is), else as ``call_utility_all_async``."""
        results = await self.call_utility_all_async(method, *args, timeout=timeout)
        if any(r != results[0] for r in results):
            raise UtilityCallError(f"Engines returned different {method} results: {results}")
        return results[0]

    async def _utility(self, method: str, *args: Any) -> Any:
        rule = DP_RULES.get(method)
        if rule == "all":
            return all(await self.call_utility_all_async(method, *args))
        if rule == "consensus":
            return await self.call_utility_consensus_async(method, *args)
        return await self.call_utility_async(method, *args)
