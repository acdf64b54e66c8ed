"""``EngineCore``: one engine, driven one ``step()`` at a time, with no IO of its own.

Engine layer, top of ``shmclient_engine`` below the process main (``proc``), built through
``shmclient_engine.make_core``: imports the config, the request checks, the scheduler, the
models, ``shmclient.messages`` / ``shmclient.errors`` only, and torch only when something
needs it (a CUDA device, a saved state, a model that computes); never a transport, a
socket, a thread, or a shmclient client module. It owns the model, the scheduler and the
request lifecycle: validation at add time, aborts, turning sampled tokens into
``EngineCoreOutputs`` per client, and the utility methods a frontend may call by name
(``UTILITY_METHODS`` / ``call_utility``, plus those a user adds with ``register_utility``).
Every method runs synchronously and returns when its work is done; none waits for anything
outside the process. The one utility that must outlast its call, a pause or sleep in
``mode="wait"``, returns a ``concurrent.futures.Future`` that ``step()`` completes once the
running requests have drained (the engine process answers the call then); in-process, where
nothing steps the engine while its caller waits, "wait" is refused (as vLLM's in-process
engine does).
"""

from __future__ import annotations

import concurrent.futures
import importlib
import logging
import os
import time
from typing import Any, Callable

import msgspec

from shmclient.errors import ConfigError, DuplicateRequestError, WaitNotSupportedError
from shmclient.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    LoRARequest,
    SamplingParams,
    SchedulerStats,
)

from shmclient.config import EngineConfig
from .model import SAMPLING_EPS, Model, ScheduledChunk, build_model
from .model import torch_module as _torch
from .request import Request, check_request, derive_seed
from .scheduler import PauseState, Scheduler

log = logging.getLogger("shmclient_engine")

SUPPORTED_TASKS = ("generate", "embed")
SLEEP_TAGS = frozenset({"weights", "kv_cache"})
#: ``wake_up`` tag that resumes scheduling only (vLLM's level-0 sleep).
SCHEDULING_TAG = "scheduling"
PAUSE_MODES = ("abort", "wait", "keep")

#: Methods a frontend may call through ``call_utility``.
UTILITY_METHODS = frozenset({
    "echo", "profile", "reset_prefix_cache", "reset_mm_cache", "reset_encoder_cache",
    "sleep", "wake_up", "is_sleeping", "pause_scheduler", "resume_scheduler",
    "is_scheduler_paused", "execute_dummy_batch", "collective_rpc", "save_sharded_state",
    "get_supported_tasks", "add_lora", "remove_lora", "list_loras", "pin_lora",
    "set_weight_version", "get_weight_version", "release_kv_cache_memory",
})

#: Utilities added with ``register_utility``: name -> fn(core, *args).
_USER_UTILITIES: dict[str, Callable[..., Any]] = {}


def register_utility(name: str | Callable[..., Any] | None = None) -> Any:
    """Make ``fn(core, *args)`` callable by name on every client:
    ``client.call_utility(name, *args)`` (``await client.call_utility_async(...)``).

    Use as ``@register_utility`` (the function's name) or ``@register_utility("name")``.
    ``fn`` runs in the engine's loop with the ``EngineCore`` as first argument; its
    return value travels back as a built-in utility's does (a ``Future`` is answered when
    it completes), and what it raises fails that call alone
    (``UtilityCallError: Call to <name> method failed: <message>``).

    How a registration reaches the engine: the multiprocess clients run the engine in a
    fresh interpreter, so a registration made in the frontend's process is not seen
    there. Put the import path of the module that holds the decorated functions in
    ``EngineConfig.utility_modules``; every ``EngineCore`` imports those modules when it
    starts (in the engine process for the multiprocess clients, in the caller's process
    for ``InprocClient``), and importing runs the decorators. A module that cannot be
    imported makes start-up fail with ``ConfigError`` naming it. Registering a built-in
    utility's name, or a second function under a taken name, raises ``ValueError``.
    """

    def register(fn: Callable[..., Any], key: str) -> Callable[..., Any]:
        if not callable(fn):
            raise TypeError(f"register_utility: {fn!r} is not callable")
        if not isinstance(key, str) or not key.isidentifier() or key.startswith("_"):
            raise ValueError(f"register_utility: name {key!r} must be a public identifier")
        if key in UTILITY_METHODS:
            raise ValueError(f"register_utility: {key!r} is a built-in utility")
        old = _USER_UTILITIES.get(key)
        if old is not None and _ident(old) != _ident(fn):
            raise ValueError(f"register_utility: {key!r} is already registered "
                             f"({old.__module__}.{old.__qualname__})")
        _USER_UTILITIES[key] = fn
        return fn

    if callable(name):
        return register(name, name.__name__)
    return lambda fn: register(fn, name if name is not None else fn.__name__)


def _ident(fn: Callable[..., Any]) -> tuple[str, str]:
    # A module imported twice (reload, or under two names) registers "the same" function.
    return getattr(fn, "__module__", ""), getattr(fn, "__qualname__", repr(fn))



#: The model's methods the core calls itself, refused to ``collective_rpc``, with what
#: to call instead.
_CORE_DRIVEN = {
    "execute": "each step runs it",
    "free": "abort the request instead",
    "pool": "send a request with pooling_params",
    "make_generator": "set SamplingParams.seed",
    "reserve": "each step runs it",
    "sleep": "call the sleep utility",
    "wake_up": "call the wake_up utility",
    "discard_kv_cache": "call the release_kv_cache_memory utility",
}


class EngineCore:
    """Schedules, executes and reports; see the module docstring. Not thread-safe.

    Construction builds the model and sizes the KV cache; it raises ``ConfigError`` when the
    budget cannot hold one block or the device is unusable. ``num_gpu_blocks``,
    ``block_size`` and ``max_model_len`` give the real capacity (for the ready handshake).
    """

    def __init__(self, config: EngineConfig, *, supports_wait: bool = False) -> None:
        """``supports_wait``: something keeps calling ``step()`` while a pause or sleep in
        ``mode="wait"`` is pending (the engine process's loop); without it "wait" raises
        ``WaitNotSupportedError``."""
        for module in config.utility_modules:
            try:
                importlib.import_module(module)
            except Exception as e:
                raise ConfigError(
                    f"EngineConfig.utility_modules: cannot import {module!r}: "
                    f"{type(e).__name__}: {e}") from e
        if config.is_cuda and not _torch().cuda.is_available():
            raise ConfigError(
                f"EngineConfig.device={config.device!r} is invalid: "
                "torch.cuda.is_available() is False")
        self.config = config
        self.model: Model = build_model(config)
        self.block_size = config.block_size
        self.num_gpu_blocks = config.num_gpu_blocks or self._blocks_from_budget()
        self.max_model_len = min(config.max_model_len, self.num_gpu_blocks * self.block_size)
        self.scheduler = Scheduler(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            block_size=self.block_size,
            num_gpu_blocks=self.num_gpu_blocks,
            max_model_len=self.max_model_len,
            on_free=self.model.free,
        )
        # ABORT outputs waiting for the next step(): (client_index, output).
        self._aborted: list[tuple[int, EngineCoreOutput]] = []
        self._aborted_ids: set[str] = set()
        self._asleep: set[str] = set()
        self._loras: dict[int, LoRARequest] = {}
        self._pinned_loras: set[int] = set()
        self.supports_wait = supports_wait
        #: Pauses and sleeps in mode "wait" not yet drained: (future, clear_cache).
        self._pause_waiters: list[tuple[concurrent.futures.Future, bool]] = []
        self._weight_version = "default"
        self.profiling = False
        #: The running profile session (see ``profile``) and the last finished one.
        self._profile: dict[str, Any] | None = None
        self.last_profile: dict[str, Any] | None = None
        self._is_shut_down = False

    def _blocks_from_budget(self) -> int:
        cfg = self.config
        if cfg.is_cuda:
            torch = _torch()
            free, _total = torch.cuda.mem_get_info(torch.device(cfg.device))
            budget = int(free * cfg.gpu_memory_utilization)
            field = f"gpu_memory_utilization={cfg.gpu_memory_utilization} (of {free} free bytes)"
        else:
            budget = cfg.kv_cache_memory_bytes
            field = f"kv_cache_memory_bytes={budget}"
        block_bytes = self.model.kv_bytes_per_token * cfg.block_size
        blocks = budget // block_bytes
        if blocks < 1:
            raise ConfigError(
                f"EngineConfig.{field} is invalid: the KV cache cannot hold one block "
                f"of {block_bytes} bytes")
        return blocks

    # ---------------------------------------------------------------- requests

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request. Raises ``InvalidRequestError`` naming the problem
        (``DuplicateRequestError`` for an id already live); a rejected request changes
        nothing."""
        self._check_open()
        req = self._make_request(request)
        self.scheduler.add_request(req)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort live requests; each gets one ABORT output at the next ``step()``.
        Unknown and finished ids are ignored."""
        for req in self.scheduler.finish_requests(list(request_ids), FinishReason.ABORT):
            self._aborted.append(
                (req.client_index,
                 EngineCoreOutput(request_id=req.request_id, finish_reason=FinishReason.ABORT)))
            self._aborted_ids.add(req.request_id)

    def is_live(self, request_id: str) -> bool:
        """Whether ``request_id`` is live: queued, running, or aborted with its ABORT
        output not sent yet."""
        return request_id in self.scheduler.requests or request_id in self._aborted_ids

    def step(self) -> dict[int, EngineCoreOutputs]:
        """Schedule, execute and update once; outputs keyed by ``client_index``.

        Pending ABORT outputs come first. While sleeping nothing is scheduled, while the
        scheduler is paused only what the pause allows. A pause or sleep in mode "wait"
        completes here once the requests that came before it have finished. Returns an empty dict when there is
        nothing to report. Each batch carries ``engine_index`` (the config's
        ``data_parallel_rank``, 0 without one) and the ``SchedulerStats`` after the step.
        Model errors propagate.
        """
        self._check_open()
        per_client: dict[int, list[EngineCoreOutput]] = {}
        finished: dict[int, set[str]] = {}
        self._take_aborted(per_client, finished)

        if not self._asleep and self.scheduler.has_schedulable_requests():
            batch = self.scheduler.schedule()
            if batch:
                t0 = time.perf_counter()
                self._run(batch, per_client, finished)
                if self._profile is not None:
                    self._profile_step(batch, time.perf_counter() - t0)
        if self._pause_waiters and not self.scheduler.has_schedulable_requests():
            self._finish_waiting_pauses()
        return self._batches(per_client, finished)

    def pending_outputs(self) -> dict[int, EngineCoreOutputs]:
        """The outputs already decided and not sent (the ABORT outputs of aborted
        requests), without a step: what ``step()`` would send first, keyed by
        ``client_index``; an empty dict when there are none. The engine loop sends them
        before a utility's reply, which it sends before the next step (as vLLM)."""
        self._check_open()
        per_client: dict[int, list[EngineCoreOutput]] = {}
        finished: dict[int, set[str]] = {}
        self._take_aborted(per_client, finished)
        return self._batches(per_client, finished)

    def _take_aborted(self, per_client: dict, finished: dict) -> None:
        for client, out in self._aborted:
            per_client.setdefault(client, []).append(out)
            finished.setdefault(client, set()).add(out.request_id)
        self._aborted.clear()
        self._aborted_ids.clear()

    def _batches(self, per_client: dict, finished: dict) -> dict[int, EngineCoreOutputs]:
        if not per_client:
            return {}
        # Every batch says which data-parallel engine sent it and its load after the
        # step (what the client's load balancer reads).
        index = self.config.data_parallel_rank or 0
        sched = self.scheduler
        stats = SchedulerStats(
            num_running_reqs=len(sched.running), num_waiting_reqs=len(sched.waiting),
            kv_cache_usage=1.0 - sched.num_free_blocks / sched.num_gpu_blocks)
        return {
            client: EngineCoreOutputs(engine_index=index, outputs=outs,
                                      scheduler_stats=stats,
                                      finished_requests=finished.get(client))
            for client, outs in per_client.items()
        }

    def _run(self, batch: list[ScheduledChunk], per_client: dict, finished: dict) -> None:
        sampled = self.model.execute(batch)
        pooled = {}
        for chunk in batch:
            if chunk.pool_done:
                req = self.scheduler.requests[chunk.request_id]
                pooled[chunk.request_id] = self.model.pool(
                    req.request_id, req.prompt_token_ids, req.prompt_embeds,
                    req.pooling_params)
        for req in self.scheduler.update(batch, sampled):
            if req.pooling_params is not None:
                out = EngineCoreOutput(request_id=req.request_id,
                                       pooling_output=pooled[req.request_id],
                                       finish_reason=req.finish_reason)
            else:
                out = EngineCoreOutput(request_id=req.request_id,
                                       new_token_ids=[req.output_token_ids[-1]],
                                       finish_reason=req.finish_reason,
                                       stop_reason=req.stop_reason)
            per_client.setdefault(req.client_index, []).append(out)
            if req.finish_reason is not None:
                finished.setdefault(req.client_index, set()).add(req.request_id)

    def has_unfinished_requests(self) -> bool:
        """True while a request is queued or running, or an ABORT output is pending
        (also while sleeping or paused, when ``step()`` makes no progress on them)."""
        return self.scheduler.has_unfinished_requests() or bool(self._aborted)

    def has_work(self) -> bool:
        """Whether ``step()`` would make progress now: an ABORT output to send, a pause
        in mode "wait" to complete, or a request the (un)paused scheduler may run. The
        engine process steps while this is True and waits for messages otherwise."""
        schedulable = self.scheduler.has_schedulable_requests()
        return (bool(self._aborted) or (bool(self._pause_waiters) and not schedulable)
                or (not self._asleep and schedulable))

    def shutdown(self) -> None:
        """Drop every request (no outputs) and the model's state. Idempotent."""
        if self._is_shut_down:
            return
        self._is_shut_down = True
        self.scheduler.finish_requests(list(self.scheduler.requests), FinishReason.ABORT)
        self._aborted.clear()
        self._aborted_ids.clear()
        for fut, _ in self._pause_waiters:
            fut.cancel()
        self._pause_waiters.clear()
        self.model.sleep(2)

    def _check_open(self) -> None:
        if self._is_shut_down:
            raise RuntimeError("EngineCore was shut down")

    # ---------------------------------------------------------------- validation

    def _make_request(self, r: EngineCoreRequest) -> Request:
        # The live-id check comes first, whatever else is wrong with the request: a
        # frontend told of any other fault under a live id would take that request as
        # finished while it goes on (or see it finish twice, ERROR then ABORT).
        rid = r.request_id
        if type(rid) is str and (rid in self.scheduler.requests or rid in self._aborted_ids):
            # (an aborted id is live until its ABORT output is out)
            raise DuplicateRequestError(f"request_id {rid!r} is already live")
        check_request(r, vocab_size=self.model.vocab_size, hidden_size=self.model.hidden_size,
                      max_model_len=self.max_model_len)
        generator = None
        sp = None if r.pooling_params is not None else r.sampling_params or SamplingParams()
        if sp is not None and sp.temperature >= SAMPLING_EPS:
            seed = sp.seed if sp.seed is not None else derive_seed(self.config.seed, rid)
            generator = self.model.make_generator(seed)
        eos = r.eos_token_id if r.eos_token_id is not None else self.config.eos_token_id
        return Request(rid, prompt_token_ids=r.prompt_token_ids or None,
                       prompt_embeds=r.prompt_embeds, sampling_params=sp,
                       pooling_params=r.pooling_params, eos_token_id=eos,
                       client_index=r.client_index, generator=generator)

    # ---------------------------------------------------------------- utilities

    def call_utility(self, method: str, args: tuple = ()) -> Any:
        """Call the utility ``method`` with ``args``: a built-in (``UTILITY_METHODS``) or
        one added with ``register_utility``. Raises ``ValueError`` for any other name and
        whatever the method raises."""
        if method in UTILITY_METHODS:
            return getattr(self, method)(*args)
        fn = _USER_UTILITIES.get(method)
        if fn is None:
            raise ValueError(f"unknown utility method {method!r}")
        return fn(self, *args)

    def echo(self, x: Any) -> Any:
        return x

    # -- profiling ------------------------------------------------------------------
    def profile(self, is_start: bool = True, profile_prefix: str | None = None,
                delay_iterations: int | None = None,
                max_iterations: int | None = None) -> None:
        """Start (``is_start``) or stop the engine's step profiler (vLLM's signature).

        A session counts the steps that ran a batch, the tokens they scheduled and the
        time the model took, after skipping the first ``delay_iterations`` steps and
        stopping by itself after ``max_iterations``. Stopping logs the summary under
        ``profile_prefix`` and keeps it in ``last_profile``; stopping with no session
        running does nothing. Starting while one runs restarts it."""
        if not isinstance(is_start, bool):
            raise ValueError(f"profile: is_start must be a bool, got {is_start!r}")
        if profile_prefix is not None and not isinstance(profile_prefix, str):
            raise ValueError(f"profile: profile_prefix must be a str or None, "
                             f"got {profile_prefix!r}")
        for name, v in (("delay_iterations", delay_iterations),
                        ("max_iterations", max_iterations)):
            if v is not None and (type(v) is not int or v < 0):
                raise ValueError(f"profile: {name} must be an int >= 0 or None, got {v!r}")
        if not is_start:
            self._stop_profile()
            return
        self._profile = {"prefix": profile_prefix or "", "delay": delay_iterations or 0,
                         "max": max_iterations, "steps": 0, "tokens": 0, "seconds": 0.0}
        self.profiling = True

    def _profile_step(self, batch: list[ScheduledChunk], seconds: float) -> None:
        p = self._profile
        if p["delay"] > 0:
            p["delay"] -= 1
            return
        p["steps"] += 1
        p["tokens"] += sum(c.num_tokens for c in batch)
        p["seconds"] += seconds
        if p["max"] is not None and p["steps"] >= p["max"]:
            self._stop_profile()

    def _stop_profile(self) -> None:
        p, self._profile = self._profile, None
        self.profiling = False
        if p is None:
            return
        self.last_profile = {k: p[k] for k in ("prefix", "steps", "tokens", "seconds")}
        log.info("profile %s: %d steps, %d tokens, %.6f s in the model", p["prefix"] or "-",
                 p["steps"], p["tokens"], p["seconds"])

    # -- caches ---------------------------------------------------------------------
    def reset_prefix_cache(self, reset_running_requests: bool = False,
                           reset_connector: bool = False) -> bool:
        """Drop the cached KV (vLLM's signature and result).

        This engine shares no KV block between requests (it has no prefix cache of
        finished requests), so the only KV to drop is that of the running requests. As
        vLLM, whose reset fails while a block is in use: with requests running and
        ``reset_running_requests`` False nothing changes and the answer is False; with
        ``reset_running_requests`` True every running request is preempted (its KV
        freed, its tokens kept; it is recomputed when scheduled again) and the answer is
        True. There is no KV connector, so ``reset_connector`` always succeeds."""
        for name, v in (("reset_running_requests", reset_running_requests),
                        ("reset_connector", reset_connector)):
            if not isinstance(v, bool):
                raise ValueError(f"reset_prefix_cache: {name} must be a bool, got {v!r}")
        if self.scheduler.running:
            if not reset_running_requests:
                return False
            self.scheduler.preempt_all()
        return True

    def reset_mm_cache(self) -> None:
        """vLLM's multi-modal cache reset. This engine takes no multi-modal inputs, so
        it caches none: nothing to drop."""

    def reset_encoder_cache(self) -> None:
        """vLLM's encoder cache reset. The models here have no encoder, so there are no
        encoder outputs to drop."""

    def _reset_caches(self) -> None:
        self.reset_prefix_cache(reset_running_requests=True, reset_connector=True)
        self.reset_mm_cache()
        self.reset_encoder_cache()

    # -- pausing and sleeping ---------------------------------------------------------
    def pause_scheduler(self, mode: str = "abort",
                        clear_cache: bool = True) -> concurrent.futures.Future | None:
        """Stop scheduling new work until ``resume_scheduler`` (vLLM's semantics).

        Requests added while paused are queued. ``mode="abort"``: abort every request
        (each gets its ABORT output), then pause. ``"wait"``: admit nothing that arrives
        from now on, but run the requests already here (running or queued) to their end;
        returns a Future completed once they all finished (None if there are none), so
        the call is answered then. ``"keep"``: schedule nothing at
        all; every request keeps its tokens so far. ``clear_cache`` then drops the cached
        KV (``reset_prefix_cache(reset_running_requests=True)``: a kept running request
        is recomputed after the resume)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be 'abort', 'wait' or 'keep', got {mode!r}")
        if not isinstance(clear_cache, bool):
            raise ValueError(f"pause_scheduler: clear_cache must be a bool, got {clear_cache!r}")
        if mode == "wait" and not self.supports_wait:
            raise WaitNotSupportedError(
                "pause mode 'wait' is not supported in-process: nothing steps the engine "
                "while the caller waits; finish or abort the requests first, or use 'abort' "
                "or 'keep'")
        if mode == "wait" and self._asleep and self.scheduler.has_unfinished_requests():
            # Its requests cannot run before wake_up, which resumes scheduling and so
            # ends the pause unfinished: the call could only fail, after waiting for it.
            raise ValueError(
                "pause mode 'wait' while the engine sleeps with requests kept: they cannot "
                "drain before wake_up; wake it up first, or use 'abort' or 'keep'")
        if mode == "abort":
            self.abort_requests(list(self.scheduler.requests))
        self.scheduler.set_pause_state(PauseState.PAUSED_ALL if mode == "keep"
                                       else PauseState.PAUSED_NEW)
        if mode == "wait" and self.scheduler.has_schedulable_requests():
            fut: concurrent.futures.Future = concurrent.futures.Future()
            self._pause_waiters.append((fut, clear_cache))
            return fut
        if clear_cache:
            self._reset_caches()
        return None

    def _finish_waiting_pauses(self) -> None:
        waiters, self._pause_waiters = self._pause_waiters, []
        for fut, clear_cache in waiters:
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                if clear_cache:
                    self._reset_caches()
            except Exception as e:  # noqa: BLE001 - fails that call alone
                fut.set_exception(e)
            else:
                fut.set_result(None)

    def resume_scheduler(self) -> None:
        """Schedule again: what was queued or kept while paused runs from here on. A
        ``"wait"`` pause or sleep still draining ends here: its call fails with
        RuntimeError (a sleep frees nothing then: the model stays awake) instead of
        completing later, after the resume (a sleep would then put the model to sleep
        after ``wake_up`` said it was awake, and under steady traffic a pause's call
        might never return)."""
        self.scheduler.set_pause_state(PauseState.UNPAUSED)
        waiters, self._pause_waiters = self._pause_waiters, []
        for fut, _ in waiters:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(RuntimeError(
                    "the scheduler was resumed (resume_scheduler or wake_up) before the "
                    "running requests had drained: this pause ended there"))

    def is_scheduler_paused(self) -> bool:
        return self.scheduler.pause_state is not PauseState.UNPAUSED

    def sleep(self, level: int = 1, mode: str = "abort") -> concurrent.futures.Future | None:
        """Pause the scheduler (``pause_scheduler(mode)``, see there for the modes), then
        free memory: level 0 pauses only; level 1 also frees the KV cache and moves the
        weights off the device, level 2 drops them. Requests kept ("keep", or queued
        after a "wait") lose their KV and are recomputed after ``wake_up``. In mode
        "wait" the memory is freed once the running requests have finished, and the
        returned Future completes then."""
        if type(level) is not int or level not in (0, 1, 2):
            raise ValueError(f"sleep level must be 0, 1 or 2, got {level!r}")
        if mode not in PAUSE_MODES:
            raise ValueError(f"sleep mode must be 'abort', 'wait' or 'keep', got {mode!r}")
        paused = self.pause_scheduler(mode, clear_cache=level >= 1)
        if level == 0:
            return paused
        if paused is None:
            self._sleep_model(level)
            return None
        done: concurrent.futures.Future = concurrent.futures.Future()

        def after_pause(f: concurrent.futures.Future) -> None:
            try:
                f.result()
                done.set_result(self._sleep_model(level))
            except BaseException as e:  # noqa: BLE001 - reported to the caller
                if not done.done():
                    done.set_exception(e)

        paused.add_done_callback(after_pause)
        return done

    def _sleep_model(self, level: int) -> None:
        self.scheduler.preempt_all()
        self.model.sleep(level)
        self._asleep = set(SLEEP_TAGS)

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Undo ``sleep`` for ``tags`` ("weights", "kv_cache", "scheduling"; None: all).
        Scheduling resumes once nothing is asleep any more (which ends a ``"wait"``
        sleep still draining, see ``resume_scheduler``). Returns whether the engine is
        fully awake (vLLM's result)."""
        if tags is not None and (not isinstance(tags, (list, tuple))
                                 or not all(isinstance(t, str) for t in tags)):
            raise ValueError(f"wake_up tags must be a list of str or None, got {tags!r}")
        wake = set(SLEEP_TAGS if tags is None else tags) - {SCHEDULING_TAG}
        if not wake <= SLEEP_TAGS:
            raise ValueError(f"unknown wake_up tags {sorted(wake - SLEEP_TAGS)}; "
                             f"valid: {sorted(SLEEP_TAGS | {SCHEDULING_TAG})}")
        self.model.wake_up(wake & self._asleep)
        self._asleep -= wake
        if not self._asleep:
            self.resume_scheduler()
        return not self._asleep

    def release_kv_cache_memory(self) -> None:
        """Drop the KV cache's memory (vLLM's): only once a pause has completed, with no
        request left and the rest of the engine's memory resident (else RuntimeError,
        nothing dropped). The engine then counts as asleep on "kv_cache":
        ``wake_up(["kv_cache"])`` (or ``wake_up()``) makes it whole again and, nothing
        else asleep, resumes scheduling."""
        if not self.is_scheduler_paused() or self.scheduler.has_unfinished_requests() \
                or self._pause_waiters:
            raise RuntimeError("release_kv_cache_memory() requires a completed pause first")
        if self._asleep:
            raise RuntimeError("release_kv_cache_memory() requires all executor memory to be resident")
        self._reset_caches()
        self.model.discard_kv_cache()
        self._asleep = {"kv_cache"}

    def is_sleeping(self) -> bool:
        """Asleep at any level: memory freed, or (level 0) the scheduler paused."""
        return bool(self._asleep) or self.is_scheduler_paused()

    # -- weights ----------------------------------------------------------------------
    def set_weight_version(self, weight_version: str) -> None:
        """Record the version of the weights now loaded (a label the frontend reads
        back with ``get_weight_version``; "default" until set)."""
        if not isinstance(weight_version, str):
            raise ValueError(f"weight_version must be a str, got {weight_version!r}")
        self._weight_version = weight_version

    def get_weight_version(self) -> str:
        return self._weight_version

    def execute_dummy_batch(self) -> None:
        """Run the model once on one token of a throw-away request (warm-up)."""
        if self._asleep:
            return
        rid = f"\x00dummy-{id(self)}"
        chunk = ScheduledChunk(rid, [0], None, 0, True, SamplingParams(temperature=0.0), None)
        try:
            self.model.execute([chunk])
        finally:
            self.model.free(rid)

    def collective_rpc(self, method: str, timeout: float | None = None,
                       args: tuple = (), kwargs: dict | None = None) -> list:
        """Call ``method`` on every model worker (one here); a list of their results.
        ValueError for a private name or one of the methods the core drives the model
        with (a call behind the core's back leaves the model out of step with the
        scheduler: the next step would fail and the engine die)."""
        if not isinstance(method, str) or method.startswith("_"):
            raise ValueError(f"collective_rpc method must be a public name, got {method!r}")
        if method in _CORE_DRIVEN:
            raise ValueError(
                f"collective_rpc cannot call the model's {method!r}: the engine core drives "
                f"it ({_CORE_DRIVEN[method]})")
        fn = getattr(self.model, method)
        if not callable(fn):
            raise ValueError(f"model attribute {method!r} is not callable")
        return [fn(*args, **(kwargs or {}))]

    def save_sharded_state(self, path: str, pattern: str | None = None,
                           max_size: int | None = None) -> None:
        """torch.save the model state dict under ``path``, split into parts of at most
        ``max_size`` bytes (a single tensor larger than that gets a part of its own)."""
        torch = _torch()
        pattern = pattern or "model-rank-{rank}-part-{part}.pt"
        os.makedirs(path, exist_ok=True)
        parts: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for name, t in self.model.state_dict().items():
            nbytes = t.numel() * t.element_size()
            if max_size is not None and parts[-1] and size + nbytes > max_size:
                parts.append({})
                size = 0
            parts[-1][name] = t.detach().cpu()
            size += nbytes
        for i, part in enumerate(parts):
            torch.save(part, os.path.join(path, pattern.format(rank=0, part=i)))

    def get_supported_tasks(self) -> tuple[str, ...]:
        return SUPPORTED_TASKS

    def add_lora(self, lora_request: Any) -> bool:
        lora = msgspec.convert(lora_request, LoRARequest) if not isinstance(
            lora_request, LoRARequest) else lora_request
        self._loras[lora.lora_int_id] = lora
        return True

    def remove_lora(self, lora_id: int) -> bool:
        self._pinned_loras.discard(lora_id)
        return self._loras.pop(lora_id, None) is not None

    def list_loras(self) -> set[int]:
        return set(self._loras)

    def pin_lora(self, lora_id: int) -> bool:
        if lora_id not in self._loras:
            return False
        self._pinned_loras.add(lora_id)
        return True
