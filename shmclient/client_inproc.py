"""``InprocClient``: the EngineCore in this process, no transport.

Top layer: imports client and the engine (at construction, not at module load).
``get_output()`` runs exactly one engine step and never blocks: with nothing scheduled it
returns an empty ``EngineCoreOutputs``. Everything else forwards directly, after the same
door checks as the multiprocess clients (``shmclient.validate``).
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

from .client import EngineCoreClient, check_abort_ids, check_request, check_utility_call
from .errors import ClientClosedError, InvalidRequestError, UtilityCallError
from .messages import EngineCoreOutputs, EngineCoreRequest


class InprocClient(EngineCoreClient):
    """The engine core in the caller's process, driven by the caller's thread.

    For tests and single-process frontends (vLLM's ``InprocClient``). Nothing runs in the
    background: ``get_output()`` is one engine step, so outputs only advance while the
    caller calls it. Not thread-safe. Construction builds the model and raises
    ``ConfigError`` for a configuration it cannot run (e.g. ``device="cuda"`` on a host
    without a GPU).
    """

    def __init__(self, config: Any) -> None:
        from engine.core import EngineCore

        self.config = config
        self.engine_core = EngineCore(config)
        self.num_gpu_blocks = self.engine_core.num_gpu_blocks
        self.block_size = self.engine_core.block_size
        self.max_model_len = self.engine_core.max_model_len
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise ClientClosedError("this InprocClient was shut down")

    def add_request(self, request: EngineCoreRequest) -> None:
        """Validate and add; raises InvalidRequestError naming the field (or the engine's
        reason, e.g. a duplicate live id), EngineDeadError after ``shutdown()``. Never
        blocks."""
        self._check_open()
        check_request(
            request,
            max_model_len=self.max_model_len,
            hidden_size=self.config.hidden_size,
            vocab_size=self.config.vocab_size,
        )
        self.engine_core.add_request(request)

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        """One engine step; never blocks (``timeout`` is accepted and unused)."""
        self._check_open()
        per_client = self.engine_core.step()
        if not per_client:
            return EngineCoreOutputs()
        if len(per_client) == 1:
            return next(iter(per_client.values()))
        merged = EngineCoreOutputs()
        for outs in per_client.values():
            merged.outputs.extend(outs.outputs)
        return merged

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort; each live request gets one ABORT output at the next ``get_output()``.
        Unknown and finished ids are ignored; InvalidRequestError for ids that are not a
        list of str. A quiet no-op after ``shutdown()``, as on the multiprocess clients."""
        ids = check_abort_ids(request_ids)
        if ids and not self._closed:
            self.engine_core.abort_requests(ids)

    def call_utility(self, method: str, *args: Any) -> Any:
        """Call the engine method ``method(*args)`` and return its result; a Future result
        is waited for. Raises UtilityCallError ("Call to <method> method failed: <e>")."""
        self._check_open()
        check_utility_call(method)
        try:
            result = self.engine_core.call_utility(method, args)
            if isinstance(result, concurrent.futures.Future):
                result = result.result()
        except Exception as e:
            raise UtilityCallError(f"Call to {method} method failed: {e}") from e
        return result

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """As ``EngineCoreClient.sleep``; ``mode="wait"`` raises InvalidRequestError (a
        ``ValueError``): nothing else steps the engine while this thread waits."""
        if mode == "wait":
            raise InvalidRequestError(
                "sleep(mode='wait') is not supported in-process: there is no concurrent "
                "scheduler to wait for; finish or abort the requests first, or use 'abort'"
            )
        super().sleep(level, mode)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Drop every request and the model's state. Idempotent; later calls raise
        EngineDeadError (``ClientClosedError``)."""
        if not self._closed:
            self._closed = True
            self.engine_core.shutdown()
