"""``InprocClient``: the EngineCore in this process, no transport.

Top layer: imports client and the engine (at construction, not at module load).
``get_output()`` runs exactly one engine step and never blocks: with nothing scheduled it
returns an empty ``EngineCoreOutputs``. Everything else forwards directly, after the same
door checks as the multiprocess clients (``shmclient.validate``).
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

from .client import (
    SyncEngineCoreClient,
    check_abort_ids,
    check_request,
    check_utility_call,
    shutdown_timeout,
)
from .errors import ClientClosedError, UtilityCallError
from .messages import EngineCoreOutputs, EngineCoreRequest


class InprocClient(SyncEngineCoreClient):
    """The engine core in the caller's process, driven by the caller's thread.

    For tests and single-process frontends (vLLM's ``InprocClient``). Nothing runs in the
    background: ``get_output()`` is one engine step, so outputs only advance while the
    caller calls it. Not thread-safe. Construction builds the model and raises
    ``ConfigError`` for a configuration it cannot run (e.g. ``device="cuda"`` on a host
    without a GPU).
    """

    def __init__(self, config: Any) -> None:
        from shmclient_engine.core import EngineCore, WaitNotSupportedError

        self.config = config
        self._refused = WaitNotSupportedError
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
        """Call the engine method ``method(*args)`` and return its result. Raises
        UtilityCallError ("Call to <method> method failed: <e>"), except for
        ``mode="wait"`` of ``sleep`` / ``pause_scheduler``, which the engine refuses
        in-process with InvalidRequestError (a ``ValueError``, as vLLM's
        ``InprocClient.sleep``): nothing else steps the engine while this thread waits."""
        self._check_open()
        check_utility_call(method)
        try:
            result = self.engine_core.call_utility(method, args)
            if isinstance(result, concurrent.futures.Future):
                if not result.done():
                    # Only the caller's own get_output() steps this engine: waiting here
                    # would never end.
                    result.cancel()
                    raise RuntimeError(
                        "the method returned a Future that only later engine steps can "
                        "complete, and in-process nothing steps the engine meanwhile")
                result = result.result()
        except self._refused:
            raise
        except Exception as e:
            raise UtilityCallError(f"Call to {method} method failed: {e}") from e
        return result

    def shutdown(self, timeout: float | None = None) -> None:
        """Drop every request and the model's state. Idempotent; later calls raise
        EngineDeadError (``ClientClosedError``). ``timeout`` is checked and unused
        (nothing runs in the background)."""
        shutdown_timeout(timeout)
        if not self._closed:
            self._closed = True
            self.engine_core.shutdown()
