"""``InprocClient``: the EngineCore in this process, no transport.

Top layer: imports client, errors and messages; never an engine module by name. The engine
is ``EngineConfig.engine_module`` (the project's ``shmclient_engine`` by default), imported
with importlib at construction; its entry point ``make_core(config, supports_wait=False)``
builds the core (the contract is in ``shmclient_engine``'s docstring; nothing steps the core
while a ``mode="wait"`` pause drains, hence ``False``).
``get_output()`` runs exactly one engine step and never blocks: with nothing scheduled it
returns an empty ``EngineCoreOutputs``. Everything else forwards directly, after the same
door checks as the multiprocess clients (``shmclient.validate``) and their live-id
bookkeeping, so that any engine (the project's or a user's own) is refused a duplicate
live id and ignores aborts it refuses, as behind the engine process's loop.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import inspect
import logging
from typing import Any

from .config import EngineConfig
from .client import (
    SyncEngineCoreClient,
    check_abort_ids,
    check_request,
    check_timeout,
    check_utility_call,
    shutdown_timeout,
)
from .errors import (ClientClosedError, ConfigError, DuplicateRequestError, UtilityCallError,
                     WaitNotSupportedError)
from .messages import EngineCoreOutputs, EngineCoreRequest

log = logging.getLogger(__name__)


class InprocClient(SyncEngineCoreClient):
    """The engine core in the caller's process, driven by the caller's thread.

    For tests and single-process frontends (vLLM's ``InprocClient``). Nothing runs in the
    background: ``get_output()`` is one engine step, so outputs only advance while the
    caller calls it. Not thread-safe. Construction imports ``config.engine_module``, builds
    the model (blocking meanwhile) and raises ``ConfigError`` for a configuration it
    cannot run (e.g. ``device="cuda"`` on a host without a GPU, an ``engine_module`` that
    does not exist or has no ``make_core``).
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.engine_core = _make_core(load_engine(config.engine_module).make_core, config)
        self.num_gpu_blocks = self.engine_core.num_gpu_blocks
        self.block_size = self.engine_core.block_size
        self.max_model_len = self.engine_core.max_model_len
        #: The ids added and not finished yet (their output with a finish reason not
        #: returned by ``get_output()``), as the multiprocess clients keep them: an engine
        #: need not refuse a duplicate itself.
        self._live: set[str] = set()
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise ClientClosedError("this InprocClient was shut down")

    def add_request(self, request: EngineCoreRequest, timeout: float | None = None) -> None:
        """Validate and add; raises InvalidRequestError naming the field (or the engine's
        reason), DuplicateRequestError (an InvalidRequestError, as the multiprocess clients
        raise) for the id of a request whose final output ``get_output()`` has not returned
        yet, EngineDeadError after ``shutdown()``. Never blocks (``timeout`` is checked, as
        the other clients check it, and unused)."""
        check_timeout("add_request", timeout)
        self._check_open()
        check_request(
            request,
            max_model_len=self.max_model_len,
            hidden_size=self.config.hidden_size,
            vocab_size=self.config.vocab_size,
        )
        if request.request_id in self._live:
            raise DuplicateRequestError(f"request id {request.request_id!r} is already live")
        self.engine_core.add_request(request)
        self._live.add(request.request_id)

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        """One engine step; never blocks (``timeout`` is checked, as the other clients
        check it, and unused)."""
        check_timeout("get_output", timeout)
        self._check_open()
        per_client = self.engine_core.step()
        if not per_client:
            return EngineCoreOutputs()
        if len(per_client) == 1:
            merged = next(iter(per_client.values()))
        else:
            merged = EngineCoreOutputs()
            for outs in per_client.values():
                merged.outputs.extend(outs.outputs)
        for o in merged.outputs:
            if o.finish_reason is not None:
                self._live.discard(o.request_id)
        return merged

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort; each live request gets one ABORT output at the next ``get_output()``
        (with the project's engine). Unknown and finished ids are ignored: an engine that
        raises for them has the abort dropped with a warning, as the engine process's loop
        drops it. InvalidRequestError for ids that are not a list of str. A quiet no-op
        after ``shutdown()``, as on the multiprocess clients."""
        ids = check_abort_ids(request_ids)
        if ids and not self._closed:
            try:
                self.engine_core.abort_requests(ids)
            except Exception:  # noqa: BLE001 - an engine refusing an abort (an unknown id)
                log.warning("dropped an abort of %d request(s) that the engine core refused",
                            len(ids), exc_info=True)

    def call_utility(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        """Call the engine method ``method(*args)`` and return its result. Raises
        UtilityCallError ("Call to <method> method failed: <e>"), except for
        ``mode="wait"`` of ``sleep`` / ``pause_scheduler``, which the engine refuses
        in-process with InvalidRequestError (a ``ValueError``, as vLLM's
        ``InprocClient.sleep``): nothing else steps the engine while this thread waits.
        ``timeout`` is checked and unused: the method runs in this thread."""
        check_timeout("call_utility", timeout)
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
        except WaitNotSupportedError:
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


def load_engine(name: str) -> Any:
    """Import the engine module ``name`` and check its entry point ``make_core``. Raises
    ``ConfigError`` naming ``EngineConfig.engine_module`` when no module of that name
    exists or it has no callable ``make_core``; any other failure of its import
    propagates unchanged. Blocks while the module imports."""
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as e:
        missing = e.name or ""
        if missing and (name == missing or name.startswith(missing + ".")):
            raise ConfigError(
                f"EngineConfig.engine_module={name!r} is invalid: no module {missing!r} is "
                "importable here") from e
        raise
    if not callable(getattr(module, "make_core", None)):
        raise ConfigError(
            f"EngineConfig.engine_module={name!r} is invalid: it has no make_core(config), "
            "the entry point an in-process client calls")
    return module


def _make_core(make_core: Any, config: EngineConfig) -> Any:
    """``make_core(config, supports_wait=False)`` where ``make_core`` takes the keyword
    (the contract's ``make_core(config, *, supports_wait)`` need not give it a default:
    nothing steps an in-process core while a ``mode="wait"`` pause drains, hence
    False), else ``make_core(config)`` (an engine written to take the config only)."""
    try:
        params = inspect.signature(make_core).parameters.values()
    except (TypeError, ValueError):  # (no signature to read: a builtin; the keyword is the contract)
        return make_core(config, supports_wait=False)
    if any(p.name == "supports_wait" or p.kind is p.VAR_KEYWORD for p in params):
        return make_core(config, supports_wait=False)
    return make_core(config)
