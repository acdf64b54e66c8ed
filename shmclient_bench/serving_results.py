"""The typed result of the ``serving`` section (``shmclient_bench.serving``):
``ServingComparison``, or ``Skipped`` without vLLM (``ServingResult``, tagged by ``status``).

Per pair of servers (stock and the plug-in, one after the other) the figures of vLLM's
serving benchmark per transport and rate (``RunFigures``); over the pairs, per metric
and rate, the ratios plug-in / stock with their spread and verdict (``Summary``) and each
target's verdict on the quiet pairs (``Target``). Only ``msgspec`` and the load
monitor's block record here: this imports neither vLLM nor the code that measures.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from .load import Block
from .section_results import STATUS, Skipped


class RunFigures(msgspec.Struct, frozen=True):
    """One benchmark run against one server at one rate: vLLM's figures (throughput in
    requests/s, TTFT, TPOT and ITL in ms), the requests completed and failed, the run's
    duration, and the server's CPU (API server and every descendant) in all and per
    completed request."""

    request_throughput_per_s: float
    median_ttft_ms: float
    p99_ttft_ms: float
    median_tpot_ms: float
    p99_tpot_ms: float
    median_itl_ms: float
    p99_itl_ms: float
    completed: int
    failed: int
    duration_s: float
    server_cpu_s: float
    server_cpu_ms_per_request: float


class Pair(msgspec.Struct, frozen=True):
    """Stock and the plug-in, one server after the other in ``order``: each one's runs by
    rate ("inf", "20"), how long each took to come up, what other processes used
    meanwhile (``load``) and whether that made the pair noisy (None: not judged)."""

    index: int
    order: list[str]
    runs: dict[str, dict[str, RunFigures]]
    server_start_s: dict[str, float]
    load: Block | None
    noisy: bool | None
    #: With rounds: the pair of servers (started once, alternately paused) this round ran
    #: against; None: the pair started its own servers.
    server_pair: int | None = None


class Params(msgspec.Struct, frozen=True):
    """How the section ran: pairs, prompts a run, the random dataset's lengths, the rates,
    the noise threshold, the servers' layout and their command line."""

    pairs: int
    num_prompts: int
    warmup_prompts: int
    input_len_tokens: int
    output_len_tokens: int
    seed: int
    rates: list[str]
    noisy_above_cores: float
    quick: bool
    data_parallel_size: int
    api_servers: int
    server_command: list[str]
    #: Rounds against each pair of servers (1: each pair started its own servers).
    rounds: int = 1


class TokenizerFacts(msgspec.Struct, frozen=True):
    """The model folder's tokenizer: what it is, its size, what it was trained on, and the
    start of its tokenizer.json's SHA-256 (the same for one Python)."""

    kind: str
    vocab_size: int
    special_tokens: list[str]
    trained_on: str
    python: str
    tokenizer_json_sha256_16: str


class Summary(msgspec.Struct, frozen=True):
    """One metric at one rate over the pairs (``ratios``: plug-in / stock, one a pair)."""

    metric: str
    rate: str
    ratios: list[float | None]
    noisy: list[bool | None]
    stock_median: float | None
    plugin_median: float | None
    ratio_median: float | None
    ratio_min: float | None
    ratio_max: float | None
    verdict: str


class Target(msgspec.Struct, frozen=True):
    """One target (``bound`` 1.0 on a metric at a rate), judged on the median ratio over
    the quiet pairs."""

    metric: str
    rate: str
    bound: str
    quiet_pairs: int
    ratio_median_quiet: float | None
    verdict: str


class ServingComparison(msgspec.Struct, frozen=True, tag_field=STATUS, tag="measured"):
    """Every figure of the section; ``load`` is the load monitor's summary of the run
    (``shmclient_bench.load.LoadMonitor.summary``)."""

    vllm_version: str
    units: str
    notes: list[str]
    pairs: list[Pair]
    params: Params
    tokenizer: TokenizerFacts
    summary: list[Summary]
    targets: list[Target]
    load: dict[str, Any]


#: What the section hands back.
ServingResult = Union[ServingComparison, Skipped]
