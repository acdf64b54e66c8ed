"""One request inside the engine: the scheduler's ``Request``, and the add-time checks.

Engine layer, below the scheduler and the core: imports torch (for ``isinstance`` checks
of prompt embeds), ``shmclient.messages`` and ``shmclient.errors`` only; never the models,
the scheduler, the core or a shmclient client module. ``check_request`` holds every rule
that can be decided from the request and the engine's shape alone (the core adds the
live-id check); each failure is an ``InvalidRequestError`` naming the request and field.
"""

from __future__ import annotations

import enum
import hashlib
import math
from typing import Any

import torch

from shmclient.errors import InvalidRequestError
from shmclient.messages import EngineCoreRequest, FinishReason, PoolingParams, SamplingParams

#: Pooling tasks a request may ask for.
POOLING_TASKS = ("embed",)


def derive_seed(config_seed: int, request_id: str) -> int:
    """The sampling seed of a request that gave none: stable across processes and runs."""
    digest = hashlib.blake2b(f"{config_seed}/{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


class Request:
    """The scheduler's view of one request: prompt, outputs so far, progress, blocks."""

    __slots__ = (
        "request_id", "client_index", "prompt_token_ids", "prompt_embeds",
        "num_prompt_tokens", "sampling_params", "pooling_params", "eos_token_id",
        "generator", "output_token_ids", "num_computed_tokens", "num_blocks", "status",
        "finish_reason", "stop_reason", "num_preemptions", "max_tokens",
    )

    def __init__(
        self,
        request_id: str,
        *,
        prompt_token_ids: list[int] | None = None,
        prompt_embeds: Any = None,
        sampling_params: SamplingParams | None = None,
        pooling_params: PoolingParams | None = None,
        eos_token_id: int | None = None,
        client_index: int = 0,
        generator: Any = None,
    ) -> None:
        self.request_id = request_id
        self.client_index = client_index
        self.prompt_token_ids = prompt_token_ids
        self.prompt_embeds = prompt_embeds
        self.num_prompt_tokens = (
            len(prompt_token_ids) if prompt_embeds is None else int(prompt_embeds.shape[0])
        )
        if sampling_params is None and pooling_params is None:
            sampling_params = SamplingParams()
        self.sampling_params = sampling_params
        self.pooling_params = pooling_params
        self.eos_token_id = eos_token_id
        self.generator = generator
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_blocks = 0
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | None = None
        self.num_preemptions = 0
        self.max_tokens = sampling_params.max_tokens if pooling_params is None else 0

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids)

    def inputs(self, start: int, end: int) -> tuple[list[int], Any]:
        """(token ids, embeds rows or None) of positions ``[start, end)``."""
        p = self.num_prompt_tokens
        if self.prompt_embeds is not None:
            embeds = self.prompt_embeds[start:min(end, p)] if start < p else None
            ids = self.output_token_ids[max(start - p, 0):end - p] if end > p else []
            return ids, embeds
        if end <= p:
            return self.prompt_token_ids[start:end], None
        if start >= p:
            return self.output_token_ids[start - p:end - p], None
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p], None

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.num_blocks})")


def check_request(r: EngineCoreRequest, *, vocab_size: int, hidden_size: int,
                  max_model_len: int) -> None:
    """Raise ``InvalidRequestError`` if ``r`` can never be served; changes nothing."""
    rid = r.request_id
    if not isinstance(rid, str) or not rid:
        raise InvalidRequestError(f"request_id must be a non-empty str, got {rid!r}")
    if type(r.client_index) is not int or r.client_index < 0:
        raise InvalidRequestError(
            f"{rid}: client_index must be an int >= 0, got {r.client_index!r}")
    ids = r.prompt_token_ids or None
    embeds = r.prompt_embeds
    if ids is None and embeds is None:
        raise InvalidRequestError(f"{rid}: empty prompt: give prompt_token_ids or prompt_embeds")
    if ids is not None and embeds is not None:
        raise InvalidRequestError(f"{rid}: give prompt_token_ids or prompt_embeds, not both")
    if embeds is not None:
        _check_embeds(rid, embeds, hidden_size)
        n = int(embeds.shape[0])
    elif not isinstance(ids, list):
        raise InvalidRequestError(
            f"{rid}: prompt_token_ids must be a list of int, got {type(ids).__name__}")
    else:
        n = len(ids)
    if n > max_model_len:
        raise InvalidRequestError(
            f"{rid}: prompt of {n} tokens is longer than max_model_len={max_model_len}")
    if ids is not None:
        for i, t in enumerate(ids):
            if type(t) is not int or not 0 <= t < vocab_size:
                raise InvalidRequestError(
                    f"{rid}: prompt_token_ids[{i}]={t!r} is outside the vocabulary "
                    f"[0, {vocab_size})")
    if r.sampling_params is not None and r.pooling_params is not None:
        raise InvalidRequestError(f"{rid}: give sampling_params or pooling_params, not both")
    if r.pooling_params is not None:
        _check_pooling(rid, r.pooling_params)
    elif r.sampling_params is not None:
        _check_sampling(rid, r.sampling_params)


def _check_embeds(rid: str, embeds: Any, hidden: int) -> None:
    if not isinstance(embeds, torch.Tensor):
        raise InvalidRequestError(
            f"{rid}: prompt_embeds must be a torch.Tensor, got {type(embeds).__name__}")
    if embeds.ndim != 2 or embeds.shape[1] != hidden:
        raise InvalidRequestError(
            f"{rid}: prompt_embeds must have shape [num_tokens, {hidden}] "
            f"(expected hidden size {hidden}), got {list(embeds.shape)}")
    if not embeds.dtype.is_floating_point:
        raise InvalidRequestError(
            f"{rid}: prompt_embeds must be floating point, got {embeds.dtype}")
    if embeds.shape[0] == 0:
        raise InvalidRequestError(f"{rid}: empty prompt: prompt_embeds has no rows")


def _check_sampling(rid: str, sp: SamplingParams) -> None:
    def bad(field: str, why: str) -> None:
        raise InvalidRequestError(
            f"{rid}: sampling_params.{field}={getattr(sp, field)!r} is invalid: {why}")

    if type(sp.max_tokens) is not int or sp.max_tokens < 1:
        bad("max_tokens", "must be an int >= 1")
    if not isinstance(sp.temperature, (int, float)) or not (
            math.isfinite(sp.temperature) and sp.temperature >= 0):
        bad("temperature", "must be a finite number >= 0")
    if not isinstance(sp.top_p, (int, float)) or not 0 < sp.top_p <= 1:
        bad("top_p", "must be in (0, 1]")
    if type(sp.top_k) is not int or sp.top_k < -1:
        bad("top_k", "must be an int >= 0 (0 or -1: off)")
    if sp.seed is not None and (type(sp.seed) is not int or not -2**63 <= sp.seed < 2**64):
        bad("seed", "must be an int in [-2**63, 2**64) or None")
    if not all(type(t) is int for t in sp.stop_token_ids):
        bad("stop_token_ids", "must be a list of int")


def _check_pooling(rid: str, pp: PoolingParams) -> None:
    if pp.task not in POOLING_TASKS:
        raise InvalidRequestError(
            f"{rid}: pooling_params.task={pp.task!r} is not supported; supported: "
            f"{', '.join(map(repr, POOLING_TASKS))}")
