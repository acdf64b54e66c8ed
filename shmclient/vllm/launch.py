"""The ``vllm serve`` parent's part of the plug-in, with several API servers.

Imports ``shmclient.channel_handles``, ``shmclient.shm`` and the plug-in's ``wire`` and
``link`` (its settings); vLLM and ``engine_link`` (the DP coordinator's entry) only
inside ``install``. With ``--api-server-count M > 1`` (vLLM's default under data
parallelism) vLLM's CLI parent binds a ZMQ listener pair per API server, starts the
engine cores (and the DP coordinator) inside ``launch_core_engines`` and spawns the M
API servers inside that context. ``install`` wraps ``launch_core_engines`` so that, for
such a launch, the parent first makes one channel per (API server, engine) pair
(``ChannelHandles``: it maps none of them) and a "parked" flag per pair, and keeps their
specs in the environment while the engines and API servers start: each engine takes its
M channels from ``SHMCLIENT_VLLM_SPEC``, each API server its N from
``SHMCLIENT_VLLM_FRONTEND_SPEC``. Both sides attach through this process's
/proc/<pid>/fd and write one byte to its "attached" pipe; a thread here releases every
handle once all 2 x M x N have (the handles also go when this process ends, whatever
ends it: nothing is named). Which launches keep vLLM's transport: docs/design.md,
"Module notes", ``shmclient.vllm.launch``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Any

from ..channel_handles import ChannelHandles
from ..shm import Segment, fd_ready, make_pipe
from . import wire
from .link import PAGE_BYTES, _Settings

SERVE_MODULE = "vllm.entrypoints.cli.serve"
UTILS_MODULE = "vllm.v1.engine.utils"
COORDINATOR_MODULE = "vllm.v1.engine.coordinator"
#: How often (s) the release thread checks that it should still wait.
POLL_S = 1.0


class _Rings:
    """The channels of one launch: M API servers x N engines."""

    def __init__(self, api_servers: int, engines: "list[int]") -> None:
        settings = _Settings()
        self._read_fd, self._write_fd, attached = make_pipe()
        self._handles: list[Any] = []
        self._lock = threading.Lock()
        self._released = False
        self.expected = 2 * api_servers * len(engines)
        self.engine_specs: list[wire.EngineSpec] = []
        self.frontend_specs: list[wire.FrontendSpec] = []
        try:
            for client in range(api_servers):
                for engine in engines:
                    channel = ChannelHandles(ring_capacity=settings.capacity, arena_bytes=settings.arena,
                                             spin_us=settings.spin_us, enable_cuda_ipc=settings.cuda_ipc)
                    self._handles.append(channel)
                    parked = ""
                    if settings.prewake:
                        seg = Segment.create(PAGE_BYTES, prefix="shmc-vllm-parked")
                        seg.close()  # the handle stays open, the mapping goes
                        self._handles.append(seg)
                        parked = seg.name
                    common = dict(output_mode=settings.output_mode, parked=parked, arenas=settings.arena > 0,
                                  tensor_min_bytes=settings.tensor_min_bytes,
                                  inline_max_outputs=settings.inline_max_outputs, engine_index=engine,
                                  client_index=client, launcher_pid=os.getpid(), attached_pipe=attached)
                    # The API servers' GPUs are not known here: CUDA tensors towards them
                    # travel as host copies.
                    self.engine_specs.append(wire.EngineSpec(channel=channel.engine_spec, frontend_pid=0, **common))
                    self.frontend_specs.append(wire.FrontendSpec(channel=channel.frontend_spec, **common))
            self.environment = {wire.ENV_SPEC: wire.encode_specs(self.engine_specs),
                                wire.ENV_FRONTEND_SPEC: wire.encode_specs(self.frontend_specs)}
        except BaseException:
            self.release()
            raise

    def too_long(self) -> "str | None":
        """Why the specs cannot be handed on in the environment (one variable over what
        Linux passes: some 115 to 135 pairs of API server and engine), or None."""
        for variable, value in self.environment.items():
            reason = wire.too_long(variable, value)
            if reason is not None:
                return reason
        return None

    @contextlib.contextmanager
    def in_environment(self):
        """The specs in this process's environment (engines and API servers started
        meanwhile inherit them)."""
        os.environ.update(self.environment)
        try:
            yield
        finally:
            os.environ.pop(wire.ENV_SPEC, None)
            os.environ.pop(wire.ENV_FRONTEND_SPEC, None)

    def release_when_attached(self) -> threading.Thread:
        """Release every handle once each side of each channel has attached, in a daemon
        thread (returned); until then the handles stay (at most as long as this
        process)."""
        thread = threading.Thread(target=self._wait_then_release, name="ShmLauncherRelease", daemon=True)
        thread.start()
        return thread

    def _wait_then_release(self) -> None:
        seen = 0
        while seen < self.expected:
            with self._lock:
                if self._released:
                    return
                fd = self._read_fd
            try:
                if fd_ready(fd, POLL_S):
                    seen += len(os.read(fd, 4096))
            except OSError:  # (closed by release() meanwhile)
                return
        self.release()

    def release(self) -> None:
        """Close every handle and the pipe (idempotent; never blocks)."""
        with self._lock:
            if self._released:
                return
            self._released = True
            for m in self._handles:
                if isinstance(m, ChannelHandles):
                    m.release()
                else:
                    m.release_handle()
            for fd in (self._read_fd, self._write_fd):
                os.close(fd)


def _why_not(vllm_config, addresses) -> "str | None":
    """Why a launch keeps vLLM's transport (None: the rings carry it)."""
    from . import _not_on_rings

    try:
        import vllm.envs as envs

        if envs.VLLM_USE_RUST_FRONTEND:
            return "vLLM's Rust frontend is not on the rings"
    except (ImportError, AttributeError):
        pass
    return _not_on_rings(vllm_config.parallel_config, None)


def make_rings(vllm_config, addresses) -> "_Rings | None":
    """The channels for a launch of several API servers, or None (vLLM's transport)
    when this launch is not one the plug-in carries (one WARNING names why)."""
    from . import _fallback, _runs_here, enabled, log

    api_servers = len(getattr(addresses, "inputs", ()) or ())
    if api_servers < 2 or not (enabled() and _runs_here()):
        return None
    reason = _why_not(vllm_config, addresses)
    if reason is not None:
        _fallback(reason)
        return None
    parallel = vllm_config.parallel_config
    first = parallel.data_parallel_rank
    engines = list(range(first, first + parallel.data_parallel_size_local))
    rings = _Rings(api_servers, engines)
    reason = rings.too_long()
    if reason is not None:
        rings.release()
        _fallback(f"{reason} ({api_servers} API servers x {len(engines)} engine cores)")
        return None
    log.info("shmclient.vllm: the launcher made shared-memory rings for %d API servers x %d engine core%s",
             api_servers, len(engines), "" if len(engines) == 1 else "s")
    return rings


def _wrap(stock):
    if getattr(stock, "_shmclient", False):
        return stock

    @contextlib.contextmanager
    def launch_core_engines(vllm_config, executor_class, log_stats, addresses, *args, **kwargs):
        rings = make_rings(vllm_config, addresses)
        if rings is None:
            with stock(vllm_config, executor_class, log_stats, addresses, *args, **kwargs) as launch:
                yield launch
            return
        try:
            with rings.in_environment(), \
                    stock(vllm_config, executor_class, log_stats, addresses, *args, **kwargs) as launch:
                yield launch
        except BaseException:
            rings.release()
            raise
        rings.release_when_attached()

    launch_core_engines._shmclient = True  # type: ignore[attr-defined]
    launch_core_engines.__wrapped__ = stock  # type: ignore[attr-defined]
    return launch_core_engines


def install() -> None:
    """Wrap vLLM's ``launch_core_engines`` where the CLI's multi-API-server launch finds
    it (idempotent): in its own module (for a CLI module imported later) and in the CLI
    module, when that is imported already. Only a launch with several frontends is
    changed; a client that starts its own engines calls it with one. Also wraps the DP
    coordinator's process entry (every launch's: the one-frontend client's too), which
    vLLM starts inside the launch, forked by default, with the channels' fds and specs."""
    import importlib

    utils = importlib.import_module(UTILS_MODULE)
    utils.launch_core_engines = _wrap(utils.launch_core_engines)
    serve = sys.modules.get(SERVE_MODULE)
    if serve is not None and hasattr(serve, "launch_core_engines"):
        serve.launch_core_engines = _wrap(serve.launch_core_engines)
    from .engine_link import entry_dropping_inherited

    coordinator = getattr(importlib.import_module(COORDINATOR_MODULE), "DPCoordinatorProc", None)
    entry = getattr(coordinator, "run_coordinator", None)
    if entry is not None:  # (a vLLM without it: the coordinator keeps the fds, nothing else changes)
        coordinator.run_coordinator = staticmethod(entry_dropping_inherited(entry, keep_specs=False))
