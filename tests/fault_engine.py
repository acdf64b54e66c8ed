"""Test-only engine module: shmclient's own engine with faults injected on demand.

Launched like any engine module, ``EngineConfig(engine_module="tests.fault_engine")``
(``python -m tests.fault_engine`` in the engine process, ``make_core`` in-process); the
fault comes from the environment variable ``SHMCLIENT_TEST_FAULT``, which the engine process
inherits from the test (``inject`` sets both). Directives:

* ``raise_in_step:N``: the Nth step that has work raises ``RuntimeError("injected fault
  in step N")`` (in the engine process: ENGINE_CORE_DEAD; in-process: from ``get_output``).
* ``undecodable_output:N``: the Nth output of request ``"bad"`` carries a finish reason
  the client cannot decode (99).
* ``exit_before_ready:CODE``: the engine process exits with CODE once the config arrived.
* ``hang_before_ready``: the engine process never answers READY (as a slow model load),
  but still exits once its frontend is gone.

No directive: the project's engine unchanged. Tests only: nothing in shmclient or
shmclient_engine imports this.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

import shmclient_engine
from shmclient.config import EngineConfig
from shmclient import serve
from shmclient_engine.core import EngineCore

MODULE = "tests.fault_engine"
FAULT_ENV = "SHMCLIENT_TEST_FAULT"


def inject(monkeypatch: Any, directive: str) -> dict[str, str]:
    """Set the directive for engines started from now on (until the test ends) and return
    the config changes that launch this engine: ``cfg(**inject(monkeypatch, "..."))``."""
    parse(directive)
    monkeypatch.setenv(FAULT_ENV, directive)
    return {"engine_module": MODULE}


def parse(directive: str | None) -> tuple[str, int | None]:
    """(name, argument) of a directive; ("", None) for none. ValueError if unknown."""
    if not directive:
        return "", None
    name, _, arg = directive.partition(":")
    if name in ("raise_in_step", "exit_before_ready", "undecodable_output") and arg.lstrip("-").isdigit():
        return name, int(arg)
    if name == "hang_before_ready" and not arg:
        return name, None
    raise ValueError(f"{FAULT_ENV}={directive!r}: unknown fault directive")


def _current() -> tuple[str, int | None]:
    return parse(os.environ.get(FAULT_ENV))


class FaultCore(EngineCore):
    """The project's core, whose ``fail_at``-th step with work raises."""

    def __init__(self, config: EngineConfig, *, supports_wait: bool = False,
                 fail_at: int) -> None:
        super().__init__(config, supports_wait=supports_wait)
        self.fail_at = fail_at
        self.work_steps = 0

    def step(self) -> dict:
        if self.has_work():
            self.work_steps += 1
            if self.work_steps >= self.fail_at:
                raise RuntimeError(f"injected fault in step {self.work_steps}")
        return super().step()


class CorruptingCore(EngineCore):
    """The project's core, whose ``at``-th output of request "bad" carries a finish
    reason that does not decode."""

    def __init__(self, config: EngineConfig, *, supports_wait: bool = False, at: int) -> None:
        super().__init__(config, supports_wait=supports_wait)
        self.at = at
        self.seen = 0

    def step(self) -> dict:
        per_client = super().step()
        for outs in per_client.values():
            for o in outs.outputs:
                if o.request_id == "bad":
                    self.seen += 1
                    if self.seen == self.at:
                        o.finish_reason = 99
        return per_client


def make_core(config: EngineConfig, *, supports_wait: bool = False) -> Any:
    """The entry point: the project's core, or a ``FaultCore`` under ``raise_in_step``
    (a ``CorruptingCore`` under ``undecodable_output``)."""
    name, arg = _current()
    if name == "raise_in_step":
        assert arg is not None
        return FaultCore(config, supports_wait=supports_wait, fail_at=arg)
    if name == "undecodable_output":
        assert arg is not None
        return CorruptingCore(config, supports_wait=supports_wait, at=arg)
    return shmclient_engine.make_core(config, supports_wait=supports_wait)


def _before_ready(config: EngineConfig) -> None:
    name, arg = _current()
    if name == "exit_before_ready":
        raise SystemExit(arg)
    if name == "hang_before_ready":
        parent, slice_ = int(sys.argv[2]), threading.Event()  # argv: address, frontend pid
        while os.getppid() == parent:
            slice_.wait(0.1)
        raise SystemExit(0)


if __name__ == "__main__":
    serve.main(sys.argv[1:], make_core=make_core, on_config=_before_ready)
