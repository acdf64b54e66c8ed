"""One request inside the engine: the scheduler's ``Request``, and the add-time checks.

Engine layer, below the scheduler and the core: imports ``shmclient.messages`` and
``shmclient.validate`` only; never the models, the scheduler, the core or a shmclient
client module. ``check_request`` holds every rule that can be decided from the request and
the engine's shape alone (the core adds the live-id check); each failure is an
``InvalidRequestError`` naming the request and field. The rules themselves live in
``shmclient.validate``, shared with the clients.
"""

from __future__ import annotations

import enum
import hashlib
from typing import Any

from shmclient import validate
from shmclient.messages import EngineCoreRequest, FinishReason, PoolingParams, SamplingParams

#: Pooling tasks a request may ask for.
POOLING_TASKS = validate.POOLING_TASKS


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
        "finish_reason", "stop_reason", "num_preemptions", "max_tokens", "arrival_seq",
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
        #: Order of arrival in the scheduler (set by ``Scheduler.add_request``).
        self.arrival_seq = 0

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
    """Raise ``InvalidRequestError`` if ``r`` can never be served; changes nothing.

    The rules are the clients' own (``shmclient.validate``): a request a client lets
    through is one the engine accepts, and the engine refuses the same things with the
    same words when a request arrives by another way."""
    validate.check_request(r, vocab_size=vocab_size, hidden_size=hidden_size,
                           max_model_len=max_model_len, pooling_tasks=POOLING_TASKS)
