"""``TinyModel``: a small decoder-only transformer in torch, seeded, nothing downloaded.

Engine layer, beside ``shmclient_engine.model`` (whose ``Model`` interface it implements): imports
torch, ``shmclient.config``, ``shmclient_engine.model`` and ``shmclient.messages`` only; never the
scheduler, the core or a shmclient client module. It owns its weights and a KV cache per
request (grown a block at a time as the scheduler grants blocks, so its block accounting
bounds the caches' total size).

Architecture: token embedding plus sinusoidal positions, ``num_layers`` pre-norm blocks
(causal multi-head self-attention, GELU MLP of 4x width), a final LayerNorm and a
separate LM head (logits of std ~2 over the vocabulary, so greedy decoding does not just
repeat its input). float32 on ``config.device``. Weights come from a local
``torch.Generator`` seeded with ``config.seed`` on cpu, so they are the same on every
device and the global torch RNG is never touched. Chunks run one request at a time.
Sampling: greedy below ``SAMPLING_EPS`` temperature, else temperature, top-k, top-p and
``torch.multinomial`` with the request's own generator.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from shmclient.messages import PoolingParams, SamplingParams

from shmclient.config import EngineConfig
from .model import SAMPLING_EPS, Model, ScheduledChunk, kv_bytes_per_token


class _KVCache:
    """K and V of every layer for one request: ``[num_heads, capacity, head_dim]``."""

    __slots__ = ("k", "v", "length")

    def __init__(self, num_layers: int, num_heads: int, head_dim: int, capacity: int,
                 device: torch.device) -> None:
        shape = (num_heads, capacity, head_dim)
        self.k = [torch.empty(shape, device=device) for _ in range(num_layers)]
        self.v = [torch.empty(shape, device=device) for _ in range(num_layers)]
        self.length = 0

    def reserve(self, needed: int, block_size: int) -> None:
        """Room for ``needed`` positions, in whole blocks of ``block_size``: the blocks the
        scheduler has granted the request, so the caches never hold more than its block
        accounting (grown by doubling they held up to ~1.6x the KV budget). A grow copies
        the cache once per block of new positions, a small share of attention's own
        reads of it."""
        cap = self.k[0].shape[1]
        if needed <= cap:
            return
        new_cap = -(-needed // block_size) * block_size
        for bufs in (self.k, self.v):
            for i, old in enumerate(bufs):
                new = old.new_empty((old.shape[0], new_cap, old.shape[2]))
                new[:, :self.length] = old[:, :self.length]
                bufs[i] = new


class TinyModel(Model):
    """See the module docstring. ``execute`` raises if a chunk skips positions."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.hidden_size = config.hidden_size
        self.vocab_size = config.vocab_size
        self.num_layers = config.num_layers
        self.num_heads = config.num_heads
        self.head_dim = config.hidden_size // config.num_heads
        self.kv_bytes_per_token = kv_bytes_per_token(config)
        self.device = torch.device(config.device)
        self.weights: dict[str, torch.Tensor] | None = self._init_weights()
        self._weights_on_cpu: dict[str, torch.Tensor] | None = None
        self._caches: dict[str, _KVCache] = {}
        self._pool_sums: dict[str, tuple[torch.Tensor, int]] = {}

    def _init_weights(self) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.config.seed)
        h, f = self.hidden_size, 4 * self.hidden_size
        out_std = 1.0 / math.sqrt(2 * self.num_layers)

        def normal(*shape: int, std: float) -> torch.Tensor:
            return torch.randn(*shape, generator=g) * std

        w = {"wte": normal(self.vocab_size, h, std=1.0)}
        for i in range(self.num_layers):
            p = f"layers.{i}."
            w[p + "ln1.weight"], w[p + "ln1.bias"] = torch.ones(h), torch.zeros(h)
            w[p + "qkv.weight"] = normal(3 * h, h, std=h ** -0.5)
            w[p + "proj.weight"] = normal(h, h, std=h ** -0.5 * out_std)
            w[p + "ln2.weight"], w[p + "ln2.bias"] = torch.ones(h), torch.zeros(h)
            w[p + "fc1.weight"] = normal(f, h, std=h ** -0.5)
            w[p + "fc2.weight"] = normal(h, f, std=f ** -0.5 * out_std)
        w["ln_f.weight"], w["ln_f.bias"] = torch.ones(h), torch.zeros(h)
        w["lm_head.weight"] = normal(self.vocab_size, h, std=2 * h ** -0.5)
        return {k: v.to(self.device) for k, v in w.items()}

    # ---------------------------------------------------------------- Model API

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledChunk]) -> list[int | None]:
        out: list[int | None] = []
        for chunk in batch:
            hidden = self._forward(chunk)
            if chunk.pooling_params is not None:
                total, count = self._pool_sums.get(chunk.request_id, (0, 0))
                self._pool_sums[chunk.request_id] = (total + hidden.sum(0), count + len(hidden))
            if chunk.sample:
                logits = F.linear(hidden[-1], self.weights["lm_head.weight"])
                out.append(sample(logits, chunk.sampling_params, chunk.generator))
            else:
                out.append(None)
        return out

    def free(self, request_id: str) -> None:
        self._caches.pop(request_id, None)
        self._pool_sums.pop(request_id, None)

    @torch.inference_mode()
    def pool(self, request_id: str, prompt_token_ids: list[int] | None, prompt_embeds: Any,
             params: PoolingParams) -> torch.Tensor:
        """Mean of the final hidden states over the prompt (already run by ``execute``)."""
        total, count = self._pool_sums.pop(request_id)
        out = total / count
        if params.normalize:
            out = F.normalize(out, dim=0)
        return out

    def make_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.weights or {})

    def num_cached_requests(self) -> int:
        return len(self._caches)

    def sleep(self, level: int) -> None:
        self._caches.clear()
        self._pool_sums.clear()
        if self.weights is None:
            return
        if level >= 2:
            self.weights = None
        elif self.device.type != "cpu":
            self._weights_on_cpu = {k: v.cpu() for k, v in self.weights.items()}
            self.weights = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def discard_kv_cache(self) -> None:
        self._caches.clear()  # (built again per request as it runs)
        self._pool_sums.clear()
        if self.device.type == "cuda":  # the freed blocks go back to the device
            torch.cuda.empty_cache()

    def wake_up(self, tags: set[str]) -> None:
        if "weights" not in tags or self.weights is not None:
            return
        if self._weights_on_cpu is not None:
            self.weights = {k: v.to(self.device) for k, v in self._weights_on_cpu.items()}
            self._weights_on_cpu = None
        else:
            self.weights = self._init_weights()

    # ---------------------------------------------------------------- forward

    def _inputs(self, chunk: ScheduledChunk) -> torch.Tensor:
        parts = []
        if chunk.embeds is not None and len(chunk.embeds):
            parts.append(chunk.embeds.to(self.device, torch.float32))
        if chunk.token_ids:
            ids = torch.tensor(chunk.token_ids, dtype=torch.long, device=self.device)
            parts.append(self.weights["wte"][ids])
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _forward(self, chunk: ScheduledChunk) -> torch.Tensor:
        """Final hidden states ``[n, hidden]`` of the chunk; appends its K/V to the cache."""
        if self.weights is None:
            raise RuntimeError("TinyModel is asleep: call wake_up() first")
        w = self.weights
        x = self._inputs(chunk)
        n, start = x.shape[0], chunk.start_pos
        cache = self._caches.get(chunk.request_id)
        if cache is None:
            blocks = -(-(start + n) // self.config.block_size)
            cache = self._caches[chunk.request_id] = _KVCache(
                self.num_layers, self.num_heads, self.head_dim, blocks * self.config.block_size,
                self.device)
        if cache.length != start:
            raise RuntimeError(f"request {chunk.request_id!r}: chunk starts at {start} but "
                               f"{cache.length} positions are cached")
        cache.reserve(start + n, self.config.block_size)
        end = start + n
        pos = torch.arange(start, end, device=self.device)
        x = x + _sinusoid(pos, self.hidden_size)
        mask = None
        if n > 1:
            keys = torch.arange(end, device=self.device)
            mask = keys[None, :] <= pos[:, None]
        h, nh, hd = self.hidden_size, self.num_heads, self.head_dim
        for i in range(self.num_layers):
            p = f"layers.{i}."
            a = F.layer_norm(x, (h,), w[p + "ln1.weight"], w[p + "ln1.bias"])
            q, k, v = F.linear(a, w[p + "qkv.weight"]).view(n, 3, nh, hd).permute(1, 2, 0, 3)
            cache.k[i][:, start:end] = k
            cache.v[i][:, start:end] = v
            att = F.scaled_dot_product_attention(
                q, cache.k[i][:, :end], cache.v[i][:, :end], attn_mask=mask)
            x = x + F.linear(att.transpose(0, 1).reshape(n, h), w[p + "proj.weight"])
            m = F.layer_norm(x, (h,), w[p + "ln2.weight"], w[p + "ln2.bias"])
            x = x + F.linear(F.gelu(F.linear(m, w[p + "fc1.weight"])), w[p + "fc2.weight"])
        cache.length = end
        return F.layer_norm(x, (h,), w["ln_f.weight"], w["ln_f.bias"])


def _sinusoid(pos: torch.Tensor, dim: int) -> torch.Tensor:
    """Classic sinusoidal position encoding ``[len(pos), dim]`` (dim may be odd)."""
    half = (dim + 1) // 2
    freq = torch.exp(torch.arange(half, device=pos.device) * (-math.log(10000.0) / half))
    ang = pos[:, None].float() * freq[None, :]
    return torch.cat([ang.sin(), ang.cos()], dim=1)[:, :dim]


def sample(logits: torch.Tensor, sp: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from ``logits`` [vocab] under ``sp`` (greedy, temperature, top-k, top-p).
    Logits that are not all finite (finite prompt embeddings large enough to overflow)
    give a token too, never an error: NaN counts as the lowest value, inf as the
    highest; so do finite logits that a temperature below 1 would overflow."""
    inf = float("inf")
    logits = logits.float()
    if not bool(torch.isfinite(logits).all()):
        # Only NaN changes: nan_to_num's defaults would also turn +inf and -inf into
        # float32's extremes, and the check for an inf below would never match.
        logits = torch.nan_to_num(logits, nan=-inf, posinf=inf, neginf=-inf)
        if not bool(torch.isfinite(logits).any()) or bool((logits == inf).any()):
            return int(logits.argmax())  # (nothing to weigh: all -inf, or an inf wins)
    if sp.temperature < SAMPLING_EPS:
        return int(logits.argmax())
    scaled = logits / sp.temperature
    if bool((scaled == inf).any()):
        # Finite logits near float32's maximum overflowed (softmax of inf is NaN, which
        # multinomial refuses): shift them so that the highest is 0 first, which leaves
        # softmax's result as it is, then divide.
        scaled = (logits - logits.max()) / sp.temperature
    logits = scaled
    if 0 < sp.top_k < logits.shape[0]:
        kth = torch.topk(logits, sp.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=0)
    if sp.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, 0) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(before > sp.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))
