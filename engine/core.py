"""``EngineCore``: one engine, driven one ``step()`` at a time, with no IO of its own.

Engine layer, top of ``engine`` below the process main (``engine.proc``): imports the
config, the request checks, the scheduler, the models, torch, and ``shmclient.messages``
/ ``shmclient.errors`` only; never a transport, a socket, a thread, or a shmclient client
module. It owns the model, the scheduler and the request lifecycle: validation at add
time, aborts, turning sampled tokens into ``EngineCoreOutputs`` per client, and the
utility methods a frontend may call by name (``UTILITY_METHODS`` / ``call_utility``).
Every method runs synchronously and returns when its work is done; none waits for
anything outside the process.
"""

from __future__ import annotations

import os
from typing import Any

import msgspec
import torch

from shmclient.errors import ConfigError, InvalidRequestError
from shmclient.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    LoRARequest,
    SamplingParams,
)

from .config import EngineConfig
from .model import SAMPLING_EPS, Model, ScheduledChunk, build_model
from .request import Request, check_request, derive_seed
from .scheduler import Scheduler

SUPPORTED_TASKS = ("generate", "embed")
SLEEP_TAGS = frozenset({"weights", "kv_cache"})

#: Methods a frontend may call through ``call_utility``.
UTILITY_METHODS = frozenset({
    "echo", "profile", "reset_prefix_cache", "sleep", "wake_up", "is_sleeping",
    "execute_dummy_batch", "collective_rpc", "save_sharded_state", "get_supported_tasks",
    "add_lora", "remove_lora", "list_loras", "pin_lora",
})


class EngineCore:
    """Schedules, executes and reports; see the module docstring. Not thread-safe.

    Construction builds the model and sizes the KV cache; it raises ``ConfigError`` when the
    budget cannot hold one block or the device is unusable. ``num_gpu_blocks``,
    ``block_size`` and ``max_model_len`` give the real capacity (for the ready handshake).
    """

    def __init__(self, config: EngineConfig) -> None:
        if config.is_cuda and not torch.cuda.is_available():
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
        self.profiling = False
        self._is_shut_down = False

    def _blocks_from_budget(self) -> int:
        cfg = self.config
        if cfg.is_cuda:
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
        """Queue a request. Raises ``InvalidRequestError`` naming the problem; a rejected
        request changes nothing."""
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

    def step(self) -> dict[int, EngineCoreOutputs]:
        """Schedule, execute and update once; outputs keyed by ``client_index``.

        Pending ABORT outputs come first. While sleeping nothing is scheduled. Returns an
        empty dict when there is nothing to report. Model errors propagate.
        """
        self._check_open()
        per_client: dict[int, list[EngineCoreOutput]] = {}
        finished: dict[int, set[str]] = {}
        for client, out in self._aborted:
            per_client.setdefault(client, []).append(out)
            finished.setdefault(client, set()).add(out.request_id)
        self._aborted.clear()
        self._aborted_ids.clear()

        if not self._asleep and self.scheduler.has_unfinished_requests():
            batch = self.scheduler.schedule()
            if batch:
                self._run(batch, per_client, finished)
        return {
            client: EngineCoreOutputs(outputs=outs, finished_requests=finished.get(client))
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
        (also while sleeping, when ``step()`` makes no progress on them)."""
        return self.scheduler.has_unfinished_requests() or bool(self._aborted)

    def shutdown(self) -> None:
        """Drop every request (no outputs) and the model's state. Idempotent."""
        if self._is_shut_down:
            return
        self._is_shut_down = True
        self.scheduler.finish_requests(list(self.scheduler.requests), FinishReason.ABORT)
        self._aborted.clear()
        self._aborted_ids.clear()
        self.model.sleep(2)

    def _check_open(self) -> None:
        if self._is_shut_down:
            raise RuntimeError("EngineCore was shut down")

    # ---------------------------------------------------------------- validation

    def _make_request(self, r: EngineCoreRequest) -> Request:
        check_request(r, vocab_size=self.model.vocab_size, hidden_size=self.model.hidden_size,
                      max_model_len=self.max_model_len)
        rid = r.request_id
        if rid in self.scheduler.requests or rid in self._aborted_ids:
            raise InvalidRequestError(f"request_id {rid!r} is already live")
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
        """Call the utility ``method`` with ``args``; raises ``ValueError`` for a name
        outside ``UTILITY_METHODS`` and whatever the method raises."""
        if method not in UTILITY_METHODS:
            raise ValueError(f"unknown utility method {method!r}")
        return getattr(self, method)(*args)

    def echo(self, x: Any) -> Any:
        return x

    def profile(self, is_start: bool = True) -> None:
        self.profiling = bool(is_start)

    def reset_prefix_cache(self) -> bool:
        return True  # there is no prefix cache, so it is always "reset"

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Free the KV cache (and move/drop weights, level 1/2). ``mode="abort"`` aborts
        every request; ``"wait"``/``"keep"`` keep queued ones, which resume (recomputed)
        after ``wake_up``; draining before a "wait" sleep is the caller's job."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"sleep mode must be 'abort', 'wait' or 'keep', got {mode!r}")
        if mode == "abort":
            self.abort_requests(list(self.scheduler.requests))
        self.scheduler.preempt_all()
        self.model.sleep(level)
        self._asleep = set(SLEEP_TAGS)

    def wake_up(self, tags: list[str] | None = None) -> None:
        wake = set(SLEEP_TAGS if tags is None else tags)
        if not wake <= SLEEP_TAGS:
            raise ValueError(f"unknown wake_up tags {sorted(wake - SLEEP_TAGS)}; "
                             f"valid: {sorted(SLEEP_TAGS)}")
        self.model.wake_up(wake & self._asleep)
        self._asleep -= wake

    def is_sleeping(self) -> bool:
        return bool(self._asleep)

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
        """Call ``method`` on every model worker (one here); a list of their results."""
        if not isinstance(method, str) or method.startswith("_"):
            raise ValueError(f"collective_rpc method must be a public name, got {method!r}")
        fn = getattr(self.model, method)
        if not callable(fn):
            raise ValueError(f"model attribute {method!r} is not callable")
        return [fn(*args, **(kwargs or {}))]

    def save_sharded_state(self, path: str, pattern: str | None = None,
                           max_size: int | None = None) -> None:
        """torch.save the model state dict under ``path``, split into parts of at most
        ``max_size`` bytes (a single tensor larger than that gets a part of its own)."""
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
