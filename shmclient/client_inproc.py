"""``InprocClient``: the EngineCore in this process, no transport.

Top layer: imports client and the engine (at construction, not at module load).
``get_output()`` runs exactly one engine step and never blocks: with nothing scheduled it
returns an empty ``EngineCoreOutputs``. Everything else forwards directly.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

from .client import EngineCoreClient, check_request
from .errors import ClientClosedError, UtilityCallError
from .messages import EngineCoreOutputs, EngineCoreRequest


class InprocClient(EngineCoreClient):
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
        """Validate and add; raises InvalidRequestError. Never blocks."""
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
        self._check_open()
        if request_ids:
            self.engine_core.abort_requests(list(request_ids))

    def call_utility(self, method: str, *args: Any) -> Any:
        self._check_open()
        try:
            result = self.engine_core.call_utility(method, args)
            if isinstance(result, concurrent.futures.Future):
                result = result.result()
        except Exception as e:
            raise UtilityCallError(
                f"Call to {method} method failed: {type(e).__name__}: {e}"
            ) from e
        return result

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        if mode == "wait":
            raise ValueError(
                "sleep(mode='wait') is not supported in-process: there is no concurrent "
                "scheduler to wait for; finish or abort the requests first, or use 'abort'"
            )
        super().sleep(level, mode)

    def shutdown(self, timeout: float = 5.0) -> None:
        if not self._closed:
            self._closed = True
            self.engine_core.shutdown()
