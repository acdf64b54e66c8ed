"""vLLM plug-in: vLLM's own client/engine data path moved from ZMQ to shmclient's rings.

Top of the plug-in: imports vLLM only inside ``register()`` and the client factories (and
in the ``frontend`` and ``engine`` modules they load), so ``import shmclient.vllm`` works
without vLLM. vLLM calls ``register`` (entry point ``shmclient`` in group
``vllm.general_plugins``) in every process it starts; it changes nothing unless
``SHMCLIENT_VLLM=1`` is in the frontend's environment. Then it replaces vLLM's clients
(``frontend``), lets the ``vllm serve`` parent with several API servers make the rings
(``launch``) and moves the engine core's IO threads onto the channel (``engine``). What
each replaces and when, and what travels: docs/design.md, "Module notes",
``shmclient.vllm``.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings

__all__ = ["ENV_SWITCH", "enabled", "register", "supported_version"]

ENV_SWITCH = "SHMCLIENT_VLLM"

_lock = threading.Lock()
_installed = False

#: The plug-in's log: under vLLM's own logger, so its lines come out with vLLM's (one INFO
#: line when the rings take over a client, one WARNING naming the reason when they do not).
log = logging.getLogger("vllm.shmclient")


def _fallback(reason: str) -> None:
    log.warning("shmclient.vllm: %s; vLLM's own ZMQ transport is used", reason)


def _took_over(kind: str) -> None:
    log.info("shmclient.vllm: %s moves engine-core requests and outputs over shared-memory rings "
             "(vLLM's handshake and ENGINE_CORE_DEAD stay on ZMQ)", kind)


def enabled() -> bool:
    """True when this process's environment switches the plug-in on."""
    return os.environ.get(ENV_SWITCH, "") == "1"


_verdict: "bool | None" = None


def _runs_here() -> bool:
    """``supported_version`` of the installed vLLM, computed (and warned about) once per
    process, when the first client is made: vLLM's logging is set up by then."""
    global _verdict
    if _verdict is None:
        import vllm

        _verdict = supported_version(vllm.__version__)
    return _verdict


def supported_version(version: str, fingerprints: "tuple[str, ...] | None" = None) -> bool:
    """Whether the plug-in may run on the installed vLLM (its number ``version``): every
    function of vLLM it depends on must be as in a release it knows (``versions``).
    Otherwise warns (the log's WARNING, and a RuntimeWarning naming what differs) and
    returns False. A release it does not know by number but whose fingerprints match
    runs, with an INFO line saying so."""
    from .versions import check

    verdict = check(version, fingerprints)
    if verdict.ok:
        if "not a tested release" in verdict.message:
            log.info("shmclient.vllm: %s", verdict.message)
        return True
    _fallback(verdict.message)
    warnings.warn(
        f"shmclient.vllm: {verdict.message}: {ENV_SWITCH}=1 is ignored and vLLM's own ZMQ transport is used",
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
        from . import engine

        engine.install()
        if enabled():
            from . import launch

            _install_frontend()
            launch.install()
        _installed = True


def local_ranks(parallel) -> "list[int]":
    """The engine cores a frontend with this parallel config starts on this node (their
    DP ranks): all of them, or with engines on other nodes (``vllm serve --headless``
    there) the ``data_parallel_size_local`` ranks from ``data_parallel_rank``."""
    if parallel.data_parallel_size <= 1:
        return [parallel.data_parallel_rank]
    first = parallel.data_parallel_rank
    return list(range(first, first + parallel.data_parallel_size_local))


def local_only(parallel) -> bool:
    """Whether a frontend talks to the engine cores of its own node only: hybrid load
    balancing (an API server per node over that node's ranks) and external (one ``vllm
    serve`` per DP rank, the load balancer in front of them). vLLM's own test, spelled
    out: ``ParallelConfig.local_engines_only`` is not in every release."""
    return bool(parallel.data_parallel_external_lb or parallel.data_parallel_hybrid_lb)


def _not_on_rings(parallel, client_addresses, frontend_specs=None) -> "str | None":
    """Why an async client with this parallel config keeps vLLM's transport, or None
    when the rings can carry it: one engine, or data parallelism where this frontend
    starts the engines of this node: internal load balancing (the engines on other nodes
    then keep vLLM's ZMQ sockets), hybrid load balancing (this node's engines are all it
    talks to), or the same started by the ``vllm serve`` parent of several API servers
    that made this one's channels (``frontend_specs``: the channels it was handed).
    External load balancing (vLLM's one-engine DP client, which vLLM runs for
    mixture-of-experts models only) is not carried: its data parallelism did not run on
    a CPU host to be tested."""
    dp = parallel.data_parallel_size
    if dp > 1:
        if parallel.data_parallel_external_lb:
            return f"data_parallel_size={dp} with external load balancing is not on the rings yet"
        if parallel.data_parallel_backend != "mp" or getattr(parallel, "enable_elastic_ep", False):
            return (f"data_parallel_size={dp} with the {parallel.data_parallel_backend!r} backend or elastic EP "
                    "is not on the rings yet")
        if parallel.data_parallel_size_local < 1 or (parallel.data_parallel_rank != 0 and not local_only(parallel)):
            return (f"data_parallel_size={dp} with no engine core started by this frontend on this node "
                    f"({parallel.data_parallel_size_local} local from rank {parallel.data_parallel_rank})")
    if client_addresses:
        if not frontend_specs:
            return ("this API server was handed no shared-memory channels (several API servers are on the "
                    "rings when `vllm serve` starts them with the plug-in switched on; externally started "
                    "engines are not)")
        engines = local_ranks(parallel)
        got = [spec.engine_index for spec in frontend_specs]
        if got != engines:
            return f"this API server was handed channels to engines {got}, its engines on this node are {engines}"
    return None


def _ranks(ranks: "list[int]") -> str:
    return ", ".join(map(str, ranks))


def _frontend_specs(client_index: int):
    """This API server's channels from the launcher (``wire.ENV_FRONTEND_SPEC``, removed
    from the environment once read), or None when it was handed none."""
    from . import wire

    text = os.environ.pop(wire.ENV_FRONTEND_SPEC, None)
    if not text:
        return None
    return wire.decode_frontend_specs(text, client_index) or None


def _install_frontend() -> None:
    from vllm.v1.engine.core_client import EngineCoreClient

    stock_make_client = EngineCoreClient.make_client
    stock_make_async = EngineCoreClient.make_async_mp_client

    def make_async_mp_client(vllm_config, executor_class, log_stats, client_addresses=None,
                             client_count=1, client_index=0, renderer=None):
        if not (enabled() and _runs_here()):
            return stock_make_async(vllm_config, executor_class, log_stats, client_addresses,
                                    client_count, client_index, renderer=renderer)
        specs = _frontend_specs(client_index) if client_addresses else None
        reason = _not_on_rings(vllm_config.parallel_config, client_addresses, specs)
        if reason is not None:
            _fallback(reason)
            warnings.warn(f"shmclient.vllm: {reason}; vLLM's own transport is used", RuntimeWarning, stacklevel=2)
            return stock_make_async(vllm_config, executor_class, log_stats, client_addresses,
                                    client_count, client_index, renderer=renderer)
        from .frontend_async import ShmAsyncMPClient, ShmDPLBAsyncMPClient

        parallel = vllm_config.parallel_config
        dp = parallel.data_parallel_size
        where = f"API server {client_index} of {client_count}" if specs else ""
        if dp > 1:
            local = local_ranks(parallel)
            # Hybrid load balancing: the other nodes' ranks have API servers of their own.
            remote = [] if local_only(parallel) else [rank for rank in range(dp) if rank not in local]
            what = [where] if where else []
            if local_only(parallel):
                what.insert(0, f"hybrid load balancing: engine{'s' if len(local) > 1 else ''} {_ranks(local)} "
                               "of this node on the rings")
            if remote:
                what.insert(0, f"engine{'s' if len(local) > 1 else ''} {_ranks(local)} on the rings, "
                               + (f"engines {_ranks(remote)} on other nodes" if len(remote) > 1
                                  else f"engine {remote[0]} on another node") + " on vLLM's ZMQ sockets")
            _took_over(f"DPLBAsyncMPClient ({dp} engines{''.join(', ' + w for w in what)})")
            return ShmDPLBAsyncMPClient(vllm_config, executor_class, log_stats, client_addresses,
                                        client_count, client_index, renderer=renderer, frontend_specs=specs,
                                        local=local)
        _took_over(f"AsyncMPClient ({where})" if where else "AsyncMPClient")
        return ShmAsyncMPClient(vllm_config, executor_class, log_stats, client_addresses,
                                client_count, client_index, renderer=renderer, frontend_specs=specs)

    def make_client(multiprocess_mode, asyncio_mode, vllm_config, executor_class, log_stats, renderer=None):
        if not (enabled() and (asyncio_mode or _runs_here())):
            return stock_make_client(multiprocess_mode, asyncio_mode, vllm_config, executor_class, log_stats,
                                     renderer=renderer)
        if multiprocess_mode and not asyncio_mode and vllm_config.parallel_config.data_parallel_size == 1:
            from .frontend import ShmSyncMPClient

            _took_over("SyncMPClient")
            return ShmSyncMPClient(vllm_config, executor_class, log_stats, renderer=renderer)
        if not multiprocess_mode:
            _fallback("the in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0) has no transport to move")
        elif not asyncio_mode:
            _fallback(f"data_parallel_size={vllm_config.parallel_config.data_parallel_size} is not on the rings yet")
        return stock_make_client(multiprocess_mode, asyncio_mode, vllm_config, executor_class, log_stats,
                                 renderer=renderer)

    EngineCoreClient.make_client = staticmethod(make_client)
    EngineCoreClient.make_async_mp_client = staticmethod(make_async_mp_client)
