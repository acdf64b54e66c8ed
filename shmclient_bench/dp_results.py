"""The typed result of the data-parallelism benchmark (``shmclient_bench.dp``): ``DpBench``.

Throughput of one and two engines (requests and tokens per second, per client), the DP
layer's own cost without a step delay, and how two engines shared a skewed load. It
encodes (``msgspec.json``) to the layout results.json has always had for the section.
Only ``msgspec`` here, nothing that measures.
"""

from __future__ import annotations

import msgspec

from .section_results import SectionHost


class Settings(msgspec.Struct, frozen=True):
    """Requests of a burst, tokens a request, rounds, the engines' step delay and size."""

    requests: int
    max_tokens: int
    rounds: int
    step_delay_s: float
    max_num_seqs: int


class Rate(msgspec.Struct, frozen=True):
    """A client's median rate over the rounds, and each round's requests/s."""

    requests_per_s: float
    tokens_per_s: float
    rounds: tuple[float, ...] = ()


class RequestRate(msgspec.Struct, frozen=True):
    """A client's median requests/s of 1-token requests, and each round's."""

    requests_per_s: float
    rounds: tuple[float, ...] = ()


class Overhead(msgspec.Struct, frozen=True):
    """1-token requests with no step delay, one engine: AsyncMPClient against the DP
    layer over it, and the µs the layer adds per request."""

    requests: int
    async_1_engine: RequestRate
    dp_lb_1_engine: RequestRate
    us_per_request_added: float


class BalancePinned(msgspec.Struct, frozen=True):
    """Two engines, a share of the requests naming rank 0: the shares each rank got, and
    what round robin would have given."""

    pinned_to_rank_0: float
    request_share: tuple[float, float]
    token_share: tuple[float, float]
    round_robin_request_share: tuple[float, float]
    elapsed_s: float


class BalanceAlternating(msgspec.Struct, frozen=True):
    """Two engines, long and short requests in turn: the shares each rank got, and the
    token shares of round robin."""

    long_tokens: int
    short_tokens: int
    request_share: tuple[float, float]
    token_share: tuple[float, float]
    round_robin_token_share: tuple[float, float]
    elapsed_s: float


class DpBench(msgspec.Struct, frozen=True):
    """Every figure of the data-parallelism benchmark; ``throughput`` by client
    (``async_1_engine``, ``dp_lb_1_engine``, ``dp_lb_2_engines``)."""

    settings: Settings
    throughput: dict[str, Rate]
    speedup_2_vs_1_engine: float
    dp_layer_cost: float
    balance_pinned: BalancePinned
    balance_alternating: BalanceAlternating
    overhead_no_delay: Overhead | None = None
    machine: SectionHost | None = None
