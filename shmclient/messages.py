"""Wire schemas, with vLLM v1's names and meanings (``vllm/v1/engine/__init__.py``).

Lowest layer: imports only msgspec and the standard library (tensors are typed ``Any`` so
that this module does not import torch; the codec's extension hook carries them).
Every struct is ``array_like`` (a msgpack array in field order) and declares
``omit_defaults`` as vLLM's do; msgspec does not yet honour ``omit_defaults`` for
array-like structs (msgspec issue #720), so today every field is written, which keeps
encoding in C. Fields are only ever appended, and a decoder reading an older, shorter
message fills the missing trailing fields with their defaults (tests/test_messages.py).
"""

from __future__ import annotations

import enum
import time
from typing import Any

import msgspec

#: Bumped on an incompatible change of the wire format; checked at the engine's ``Hello``.
PROTOCOL_VERSION = 3


class EngineCoreRequestType(enum.Enum):
    """Request-type byte in front of each client → engine message (as in vLLM).

    ``EXECUTOR_FAILED`` and ``WAKEUP`` are internal sentinels and never travel.
    """

    ADD = b"\x00"
    ABORT = b"\x01"
    START_DP_WAVE = b"\x02"
    UTILITY = b"\x03"
    EXECUTOR_FAILED = b"\x04"
    WAKEUP = b"\x05"

    @property
    def code(self) -> int:
        """The type as an int, as written into a ring record header."""
        return self.value[0]


class EngineCoreEventType(enum.IntEnum):
    QUEUED = 1
    SCHEDULED = 2
    PREEMPTED = 3


class FinishReason(enum.IntEnum):
    """Why a request finished, with vLLM's values. ``str()`` gives the OpenAI API spelling.

    ``ERROR``: the engine refused or could not decode the request; that output's
    ``stop_reason`` holds the reason as text. ``REPETITION`` exists for vLLM
    compatibility (repetition detection); this engine does not emit it.
    """

    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3
    REPETITION = 4

    def __str__(self) -> str:
        return self.name.lower()


class SamplingParams(
    msgspec.Struct, array_like=True, omit_defaults=True, gc=False, kw_only=True
):  # type: ignore[call-arg]
    """Sampling settings. ``temperature == 0`` is greedy; ``top_k == 0`` means off."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False


class PoolingParams(
    msgspec.Struct, array_like=True, omit_defaults=True, gc=False, kw_only=True
):  # type: ignore[call-arg]
    """Ask for one pooled vector instead of generated tokens."""

    task: str = "embed"
    normalize: bool = False


class LoRARequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    lora_name: str
    lora_int_id: int
    lora_path: str = ""


class EngineCoreRequest(
    msgspec.Struct, array_like=True, omit_defaults=True, gc=False, kw_only=True
):  # type: ignore[call-arg]
    """One request from the frontend. Give ``prompt_token_ids`` or ``prompt_embeds``."""

    request_id: str
    prompt_token_ids: list[int] | None = None
    sampling_params: SamplingParams | None = None
    pooling_params: PoolingParams | None = None
    eos_token_id: int | None = None
    arrival_time: float = 0.0
    lora_request: LoRARequest | None = None
    cache_salt: str | None = None
    data_parallel_rank: int | None = None
    #: torch.Tensor of shape [num_tokens, hidden_size], or None.
    prompt_embeds: Any = None
    client_index: int = 0
    current_wave: int = 0
    priority: int = 0


class EngineCoreOutput(
    msgspec.Struct, array_like=True, omit_defaults=True, gc=False, kw_only=True
):  # type: ignore[call-arg]
    """New tokens (or a pooled vector) of one request in one step."""

    request_id: str
    new_token_ids: list[int] = []
    new_logprobs: Any = None
    #: torch.Tensor, set once for a pooling request.
    pooling_output: Any = None
    finish_reason: FinishReason | None = None
    #: The stop token (STOP), or the reason text when ``finish_reason`` is ERROR.
    stop_reason: int | str | None = None
    events: list[Any] | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class UtilityOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Reply to one utility call: a result or a failure message."""

    call_id: int
    failure_message: str | None = None
    result: Any = None


class SchedulerStats(
    msgspec.Struct, array_like=True, omit_defaults=True, gc=False, kw_only=True
):  # type: ignore[call-arg]
    """An engine's load after a step, with vLLM's names (``vllm/v1/metrics/stats.py``).

    ``num_running_reqs`` / ``num_waiting_reqs``: requests in the running batch and in
    the waiting queue; ``kv_cache_usage``: the fraction of KV cache blocks in use, 0..1.
    The data-parallel load balancer reads them (``shmclient.client_dp``).
    """

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0


class EngineCoreOutputs(
    msgspec.Struct, array_like=True, omit_defaults=True, gc=False, kw_only=True
):  # type: ignore[call-arg]
    """One batch from the engine to one client. ``timestamp`` defaults to now.

    ``engine_index``: the data-parallel rank of the engine that sent it (0 without data
    parallelism). ``scheduler_stats``: that engine's load after the step, on every batch
    of step outputs (None on utility replies)."""

    engine_index: int = 0
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    utility_output: UtilityOutput | None = None
    finished_requests: set[str] | None = None
    wave_complete: int | None = None
    start_wave: int | None = None

    def __post_init__(self) -> None:
        if self.timestamp == 0.0:
            self.timestamp = time.monotonic()


class UtilityRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Payload of a UTILITY request: ``(client_index, call_id, method, args)``."""

    client_index: int
    call_id: int
    method: str
    args: tuple[Any, ...] = ()


#: The engine methods a frontend may call by name (``call_utility``): part of the wire
#: contract (an engine serves these names; ``shmclient.client`` re-exports the tuple).
UTILITY_METHODS = (
    "echo",
    "profile",
    "reset_prefix_cache",
    "reset_mm_cache",
    "reset_encoder_cache",
    "sleep",
    "wake_up",
    "is_sleeping",
    "pause_scheduler",
    "resume_scheduler",
    "is_scheduler_paused",
    "execute_dummy_batch",
    "collective_rpc",
    "save_sharded_state",
    "get_supported_tasks",
    "add_lora",
    "remove_lora",
    "list_loras",
    "pin_lora",
    "set_weight_version",
    "release_kv_cache_memory",
    "get_weight_version",
)
