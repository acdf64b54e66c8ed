"""The ``serving`` section's figures: each pair's ratio plug-in / stock, their median,
spread and verdict per metric and rate, the targets judged on the quiet pairs, and the
table of them all.

``summarize`` and ``judge_targets`` turn the typed pairs into ``Summary`` and ``Target``
records; ``format_table`` renders a ``ServingComparison`` (or the ``Skipped`` in its
place). Arithmetic and text only: it imports the result types, never vLLM, a server or
the benchmark's client.
"""

from __future__ import annotations

import statistics
from typing import Any

from .report import NOT_JUDGED
from .section_results import Skipped, typed
from .serving_results import Pair, ServingResult, Summary, Target
from .tables import table as _text_table

#: Targets are judged on the median over at least this many quiet pairs.
MIN_QUIET_PAIRS = 2
#: (key in vLLM's benchmark result, our name with its unit, which way is better, label)
METRICS = (
    ("request_throughput", "request_throughput_per_s", "higher", "throughput req/s"),
    ("median_ttft_ms", "median_ttft_ms", "lower", "TTFT p50 ms"),
    ("p99_ttft_ms", "p99_ttft_ms", "lower", "TTFT p99 ms"),
    ("median_tpot_ms", "median_tpot_ms", "lower", "TPOT p50 ms"),
    ("p99_tpot_ms", "p99_tpot_ms", "lower", "TPOT p99 ms"),
    ("median_itl_ms", "median_itl_ms", "lower", "ITL p50 ms"),
    ("p99_itl_ms", "p99_itl_ms", "lower", "ITL p99 ms"),
    (None, "server_cpu_ms_per_request", "lower", "server CPU ms/req"),
)
LABELS = {name: label for _, name, _, label in METRICS}
UNITS = ("*_per_s: requests per second; *_ms: milliseconds; server_cpu_ms_per_request: CPU "
         "(user + system) of the API server and all its descendants per completed request; "
         "ratios: plug-in / stock, no unit")
ITL_NOTE = ("ITL is the gap between stream messages as the benchmark's client reads them: "
            "messages that come in one read count ~0 ms, so a median near 0 says most came in "
            "bursts (sent together, or read late on a busy CPU), and a ratio to it means little")


def rate_key(rate: float) -> str:
    return "inf" if rate == float("inf") else f"{rate:g}"


def _rate_label(rate: str) -> str:
    return rate if rate == "inf" else f"{rate} req/s"


def targets_for(rates: list[str]) -> list[tuple[str, str, str]]:
    """(metric, rate, bound) of every target: throughput >= 1.0 at rate inf; TTFT and TPOT
    (median, p99) and server CPU per request <= 1.0 at every rate."""
    out = [("request_throughput_per_s", "inf", ">=")] if "inf" in rates else []
    for rate in rates:
        out += [(m, rate, "<=") for m in ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
                                          "p99_tpot_ms", "server_cpu_ms_per_request")]
    return out


# -- the figures: ratios, spread, verdicts, targets -------------------------------------

def ratio(plugin: float | None, stock: float | None) -> float | None:
    return None if plugin is None or stock is None or not stock > 0 else plugin / stock


def verdict(ratios: list[float | None], better: str) -> str:
    """"no difference" when the ratios' spread covers 1.0, else the side that is better
    in every pair; "-" without a ratio. ``better``: "higher" or "lower"."""
    vals = [r for r in ratios if r is not None]
    if not vals:
        return "-"
    if min(vals) <= 1.0 <= max(vals):
        return "no difference"
    return "plug-in better" if (min(vals) > 1.0) == (better == "higher") else "stock better"


def _median(vals: list[float | None]) -> float | None:
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None


def _value(pair: Pair, transport: str, rate: str, metric: str) -> float | None:
    """The figure ``metric`` (a ``RunFigures`` field) of ``transport`` at ``rate`` in ``pair``."""
    run = pair.runs.get(transport, {}).get(rate)
    return None if run is None else getattr(run, metric)


def summarize(pairs: list[Pair], rates: list[str]) -> list[Summary]:
    out = []
    for rate in rates:
        for _, metric, better, _ in METRICS:
            stock = [_value(p, "stock", rate, metric) for p in pairs]
            plugin = [_value(p, "plugin", rate, metric) for p in pairs]
            ratios = [ratio(b, a) for a, b in zip(stock, plugin)]
            vals = [r for r in ratios if r is not None]
            out.append(Summary(metric, rate, ratios, [p.noisy for p in pairs],
                               _median(stock), _median(plugin), _median(ratios),
                               min(vals, default=None), max(vals, default=None),
                               verdict(ratios, better)))
    return out


def judge_targets(pairs: list[Pair], rates: list[str],
                  min_quiet: int = MIN_QUIET_PAIRS) -> list[Target]:
    """Each target on the median ratio over the quiet pairs (``noisy`` False): "met",
    "NOT met", or not judged with fewer than ``min_quiet`` quiet pairs with the figure."""
    out = []
    for metric, rate, bound in targets_for(rates):
        quiet = [ratio(_value(p, "plugin", rate, metric), _value(p, "stock", rate, metric))
                 for p in pairs if p.noisy is False]
        quiet = [r for r in quiet if r is not None]
        med = _median(quiet)
        if med is None or len(quiet) < min_quiet:
            word = NOT_JUDGED if len(pairs) >= min_quiet else "not judged (too few pairs)"
            text = f"{word}: {len(quiet)} of {len(pairs)} pairs quiet, {min_quiet} needed"
        else:
            text = "met" if (med >= 1.0 if bound == ">=" else med <= 1.0) else "NOT met"
        out.append(Target(metric, rate, bound, len(quiet), med, text))
    return out


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def format_table(results: ServingResult | dict[str, Any]) -> str:
    """The section's table; ``results`` a ``ServingComparison``, a ``Skipped`` or the
    JSON form of either."""
    results = typed(results, ServingResult)
    if isinstance(results, Skipped):
        return f"serving: skipped: {results.reason}"
    p = results.params
    dp, servers = p.data_parallel_size, p.api_servers
    layout = [f"{dp} engine cores, data parallelism"] if dp > 1 else []
    layout += [f"{servers} API servers, vllm serve"] if servers > 1 else []
    lines = [f"vLLM {results.vllm_version} OpenAI server"
             + (f" ({'; '.join(layout)})" if layout else "") + ", tiny dummy Llama, "
             f"{results.tokenizer.vocab_size}-token BPE tokenizer; vLLM's serving benchmark, "
             f"random dataset {p.input_len_tokens} in / {p.output_len_tokens} out tokens, "
             f"{p.num_prompts} prompts a run, {len(results.pairs)} pairs (* a noisy pair)"
             + (f": {p.pairs} starts of both servers, {p.rounds} rounds each, the one not measured "
                f"paused" if p.rounds > 1 else "")]
    for rate in p.rates:
        rows = [[LABELS[s.metric], _fmt(s.stock_median), _fmt(s.plugin_median),
                 " ".join(_fmt(r) + ("*" if n else "") for r, n in zip(s.ratios, s.noisy)),
                 _fmt(s.ratio_median), f"{_fmt(s.ratio_min)}-{_fmt(s.ratio_max)}", s.verdict]
                for s in results.summary if s.rate == rate]
        lines += ["", f"rate {_rate_label(rate)} (stock, plug-in: median over pairs; ratios plug-in / stock)",
                  _text_table(["metric", "stock", "plug-in", "pair ratios", "median", "spread",
                               "verdict"], rows, "lrrlrrl")]
    lines += ["", f"targets (median ratio over quiet pairs, at least {MIN_QUIET_PAIRS}):"]
    lines += [f"  {LABELS[t.metric]} at rate {_rate_label(t.rate)}: {t.bound} 1.0, median "
              f"{_fmt(t.ratio_median_quiet)}: {t.verdict}" for t in results.targets]
    itl = [run.median_itl_ms for pair in results.pairs for by_rate in pair.runs.values()
           for run in by_rate.values()]
    if any(v is not None and v < 0.1 for v in itl):
        lines.append(f"note: {ITL_NOTE}")
    return "\n".join(lines + [f"note: {n}" for n in results.notes])
