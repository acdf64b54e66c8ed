"""shmclient's own engine, and the contract every engine module a client launches keeps.

Engine layer: the scheduler, the models and the core; it imports shmclient's config,
messages, errors and its protocol end (``shmclient.serve``) but never a client module,
and shmclient never imports it. Importing this package is cheap (no torch): ``make_core`` imports the core
when called.

``EngineConfig.engine_module`` names the engine a client uses (this package by default).
An engine module provides:

* ``make_core(config, *, supports_wait=False)``: the in-process engine core
  (``InprocClient`` calls it), an object with ``add_request``, ``abort_requests``,
  ``step() -> {client_index: EngineCoreOutputs}``, ``call_utility(method, args)``,
  ``shutdown()`` and the attributes ``num_gpu_blocks``, ``block_size`` and
  ``max_model_len``, as ``shmclient_engine.core.EngineCore``. It raises ``ConfigError``
  for a config it cannot run, and ``shmclient.errors.WaitNotSupportedError`` for a
  ``mode="wait"`` that nobody steps through (the client passes it on unwrapped).
* ``python -m <engine_module> <control address> <frontend pid>``: the engine process of
  the multiprocess clients. shmclient serves the protocol (``shmclient.serve.main``); an
  engine module's ``__main__`` calls it with its own ``make_core`` (and, if it must, an
  ``on_config`` hook), as this package's does. ``shmclient.serve.EngineCore`` is the
  Protocol the core keeps.
"""

from __future__ import annotations

from typing import Any

__all__ = ["make_core"]


def make_core(config: Any, *, supports_wait: bool = False) -> Any:
    """Build this engine's ``EngineCore`` for ``config`` (an ``EngineConfig``).

    Blocks while the model is built; raises ``ConfigError`` for a config this host cannot
    run (e.g. ``device="cuda"`` without a GPU, a ``utility_modules`` entry that does not
    import). ``supports_wait``: something keeps calling ``step()`` while a pause or sleep
    in ``mode="wait"`` drains (the engine process's loop does; in-process nothing does).
    """
    from .core import EngineCore

    return EngineCore(config, supports_wait=supports_wait)
