"""The typed result of the ``vllm`` section (``shmclient_bench.vllm``): ``VllmComparison``,
or ``Skipped`` without vLLM (``VllmResult``, tagged by ``status``).

Per configuration (``sync-stock``, ``async-shm`` ...) the output hop (µs) and the TTFT
and TPOT (ms) at 1 and 16 streams, as percentiles; the same again on a busy host and
with data parallelism when those parts ran. Sizes of streams are the keys of the TTFT
and TPOT figures ("1", "16" in the JSON). Only ``msgspec`` here: this imports neither
vLLM nor the code that measures.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from .section_results import STATUS, Skipped


class Percentiles(msgspec.Struct, frozen=True, omit_defaults=True):
    """Percentiles of one figure; only ``n`` (0) when nothing was measured."""

    n: int
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    mean: float | None = None


class ConfigFigures(msgspec.Struct, frozen=True):
    """One configuration: the output hop, TTFT and TPOT by streams, and a sample of the
    hops (every k-th, up to about 2000) for the CDF plot."""

    hop_us: Percentiles
    ttft_ms: dict[int, Percentiles]
    tpot_ms: dict[int, Percentiles]
    hops_sample_us: list[float]


class BusyHost(msgspec.Struct, frozen=True, omit_defaults=True):
    """Stock and the plug-in with ``processes`` busy processes, one pinned to each CPU:
    ``configs`` over every pass, ``pairs`` each pair of passes on its own (one pass of
    every configuration, the order reversed from one pair to the next; without their hop
    samples), from which the per-pair ratios and their spread are taken."""

    processes: int
    configs: dict[str, ConfigFigures]
    pairs: list[dict[str, ConfigFigures]] = []


class DataParallel(msgspec.Struct, frozen=True):
    """AsyncLLM with ``engines`` engine cores, stock and the plug-in."""

    engines: int
    configs: dict[str, ConfigFigures]


class VllmComparison(msgspec.Struct, frozen=True, omit_defaults=True, tag_field=STATUS, tag="measured"):
    """Every figure of the section: the vLLM version, the run's size, the model's
    config.json, the quiet configurations with the load average before and after them,
    and the busy and data-parallel parts where they ran."""

    vllm_version: str
    rounds: int
    tokens: int
    streams: list[int]
    model: dict[str, Any]
    configs: dict[str, ConfigFigures]
    passes: int
    load_before: tuple[float, ...]
    load_after: tuple[float, ...]
    busy: BusyHost | None = None
    dp: DataParallel | None = None


#: What the section hands back.
VllmResult = Union[VllmComparison, Skipped]
