"""The model interface the engine core drives, and ``MockModel``, which computes nothing.

Engine layer, below the core and beside the scheduler: imports ``shmclient.config`` and
``shmclient.messages`` / ``shmclient.errors`` only, and torch when a model needs it (the
tiny model, a pooled vector), so that an engine with the mock model starts without it;
never the scheduler, the core or any shmclient client module. A model owns per-request
state (its KV cache, sampling state is owned by the caller) and turns one step's
``ScheduledChunk`` list into sampled tokens. Which chunk comes when, and how many KV blocks
a request may hold, is the scheduler's business; a model trusts that chunks of one request
arrive in order.

``MockModel`` rule (exact, so tests can predict it). For a sequence whose last known
element is at 0-based position ``pos`` and has token id ``last`` (a ``prompt_embeds`` row
counts as ``last = 0``), the next token is::

    t = (31 * last + 7 * pos + 11) % vocab_size
    if t == config.eos_token_id: t = (t + 1) % vocab_size

so the mock never produces the config's EOS by itself (a frontend's "exactly max_tokens"
tests stay exact); give a request its own ``eos_token_id`` to make it stop on a predicted
token. Sampling parameters (temperature, seed, ...) are ignored. Pooling returns
``prompt_embeds.float().mean(0)`` for embeds, else the float32 vector of length
``hidden_size`` whose element ``j`` is ``float(ids[j % len(ids)])`` (the prompt ids,
cycled); both are L2-normalised when ``PoolingParams.normalize`` is set.

``EngineConfig.step_delay_s`` makes the mock sleep that long in every ``execute`` that has
work, standing in for a GPU step in benchmarks and load tests (a busy engine whose
requests are still running when the next call arrives); 0, the default, adds nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from shmclient.messages import PoolingParams, SamplingParams

from shmclient.config import EngineConfig

def torch_module() -> Any:
    """torch, imported on first use (about a second of an engine's start-up otherwise)."""
    import torch

    return torch


#: Temperatures below this sample greedily (as in vLLM).
SAMPLING_EPS = 1e-5


@dataclass(slots=True)
class ScheduledChunk:
    """One request's share of one step: positions ``[start_pos, start_pos + num_tokens)``.

    The chunk's sequence elements are ``embeds`` rows first (prompt-embeds requests, while
    the chunk is inside the prompt), then ``token_ids``. ``sample`` is true when the chunk
    reaches the end of the known sequence, so the next token must be sampled; a pooling
    request's last chunk has ``sample`` false and ``pool_done`` true.
    """

    request_id: str
    token_ids: list[int]
    embeds: Any  # torch.Tensor [rows, hidden_size] or None
    start_pos: int
    sample: bool
    sampling_params: SamplingParams | None
    generator: torch.Generator | None
    pooling_params: PoolingParams | None = None
    pool_done: bool = False

    @property
    def num_tokens(self) -> int:
        rows = 0 if self.embeds is None else int(self.embeds.shape[0])
        return rows + len(self.token_ids)


class Model:
    """What the engine core needs from a model. Every method runs synchronously.

    Subclasses set ``hidden_size``, ``vocab_size``, ``kv_bytes_per_token`` and ``device``
    and implement ``execute``, ``free`` and ``pool``.
    """

    hidden_size: int
    vocab_size: int
    kv_bytes_per_token: int
    device: Any  # a torch.device, or its name where the model holds no tensor (the mock)

    def execute(self, batch: list[ScheduledChunk]) -> list[int | None]:
        """Run one step; entry ``i`` is the token sampled for ``batch[i]`` or ``None``."""
        raise NotImplementedError

    def free(self, request_id: str) -> None:
        """Drop whatever the model holds for ``request_id`` (KV cache); unknown ids: no-op."""
        raise NotImplementedError

    def pool(
        self,
        request_id: str,
        prompt_token_ids: list[int] | None,
        prompt_embeds: Any,
        params: PoolingParams,
    ) -> torch.Tensor:
        """The pooled vector of a request whose whole prompt went through ``execute``."""
        raise NotImplementedError

    def make_generator(self, seed: int) -> torch.Generator | None:
        """A sampling generator for one request (``None`` if the model does not sample)."""
        return None

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def sleep(self, level: int) -> None:
        """Release memory (level 1: weights off the device; level 2: weights dropped)."""

    def wake_up(self, tags: set[str]) -> None:
        """Undo ``sleep`` for ``tags`` ("weights", "kv_cache")."""

    def discard_kv_cache(self) -> None:
        """Release the KV cache's memory (no request runs); ``wake_up({"kv_cache"})``
        makes it usable again."""

    def num_cached_requests(self) -> int:
        """How many requests the model holds state for (tests check it goes to 0)."""
        return 0


def kv_bytes_per_token(config: EngineConfig) -> int:
    """float32 K and V of every layer: what one token of KV cache costs."""
    return 2 * config.num_layers * config.hidden_size * 4


def mock_next_token(last: int, pos: int, vocab_size: int, eos_token_id: int) -> int:
    """The mock rule (see the module docstring); exported so tests can predict outputs."""
    t = (31 * last + 7 * pos + 11) % vocab_size
    if t == eos_token_id:
        t = (t + 1) % vocab_size
    return t


def mock_pool(prompt_token_ids: Any, prompt_embeds: Any, hidden_size: int,
              normalize: bool = False, device: Any = "cpu") -> torch.Tensor:
    """The mock pooling rule (see the module docstring); ids give a tensor on ``device``,
    embeds one on their own device."""
    torch = torch_module()
    if prompt_embeds is not None:
        out = prompt_embeds.float().mean(0)
    else:
        ids = list(prompt_token_ids)
        out = torch.tensor([float(ids[j % len(ids)]) for j in range(hidden_size)],
                           dtype=torch.float32, device=device)
    if normalize:
        out = torch.nn.functional.normalize(out, dim=0)
    return out


class MockModel(Model):
    """No compute and no state: the next token follows ``mock_next_token``; each
    ``execute`` sleeps ``config.step_delay_s`` (blocking the engine, as a GPU step would)."""

    def __init__(self, config: EngineConfig) -> None:
        self.hidden_size = config.hidden_size
        self.vocab_size = config.vocab_size
        self.eos_token_id = config.eos_token_id
        self.kv_bytes_per_token = kv_bytes_per_token(config)
        self.device = config.device  # only where pooled vectors live
        self.step_delay_s = config.step_delay_s

    def execute(self, batch: list[ScheduledChunk]) -> list[int | None]:
        if self.step_delay_s and batch:
            time.sleep(self.step_delay_s)
        out: list[int | None] = []
        for chunk in batch:
            if not chunk.sample:
                out.append(None)
                continue
            last = chunk.token_ids[-1] if chunk.token_ids else 0
            pos = chunk.start_pos + chunk.num_tokens - 1
            out.append(mock_next_token(last, pos, self.vocab_size, self.eos_token_id))
        return out

    def free(self, request_id: str) -> None:
        pass

    def pool(self, request_id, prompt_token_ids, prompt_embeds, params) -> torch.Tensor:
        return mock_pool(prompt_token_ids, prompt_embeds, self.hidden_size, params.normalize,
                         self.device)


def build_model(config: EngineConfig) -> Model:
    """The model ``config.model`` names, on ``config.device``."""
    if config.model == "mock":
        return MockModel(config)
    from .tiny import TinyModel

    return TinyModel(config)
