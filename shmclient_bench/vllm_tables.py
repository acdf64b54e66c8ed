"""The ``vllm`` section's table and hop plot, from its typed result.

``format_table`` renders a ``VllmComparison`` (or the ``Skipped`` in its place) as the
Markdown tables of the report, with each part's target verdicts; ``plot`` draws the
CDF of the output hop per configuration. Reads figures only: it imports the result
types and (for the plot) matplotlib and ``plots``, never vLLM or the measuring code.
"""

from __future__ import annotations

from typing import Any

from .section_results import Skipped, typed
from .vllm_results import BusyHost, ConfigFigures, DataParallel, Percentiles, VllmComparison, VllmResult

def format_table(results: VllmResult | dict[str, Any]) -> str:
    """The section's table; ``results`` a ``VllmComparison``, a ``Skipped`` or the JSON
    form of either."""
    results = typed(results, VllmResult)
    if isinstance(results, Skipped):
        return f"vllm: skipped: {results.reason}"
    lines = _config_table(results) if results.configs else [_title(results)]
    lines += _busy_table(results.busy) + _dp_table(results.dp)
    return "\n".join(lines)


def _title(results: VllmComparison) -> str:
    """What ran: rounds and passes of the quiet and DP parts, pairs of the busy part."""
    ran = []
    if results.configs or (results.dp and results.dp.configs):
        ran.append(f"{results.rounds} rounds x {results.passes} passes")
    if results.busy and results.busy.configs:
        pairs = len(results.busy.pairs)
        ran.append(f"busy part {results.rounds} rounds x " + (f"{pairs} pairs of passes" if pairs else
                                                               f"{results.passes} passes"))
    head = f"vLLM {results.vllm_version}, tiny dummy Llama, {results.tokens} tokens a request"
    return head + (", " + "; ".join(ran) if ran else "")


def _p50(p: Percentiles) -> float:
    """The median of ``p``, 0 where nothing was measured."""
    return p.p50 if p.p50 is not None else 0


def _row(name: str, r: ConfigFigures) -> str:
    h = r.hop_us
    t1, t16 = r.ttft_ms[1], r.ttft_ms[16]
    p1, p16 = r.tpot_ms[1], r.tpot_ms[16]
    return (
        f"| {name} | {_p50(h):.0f} | {h.p90 or 0:.0f} | {h.p99 or 0:.0f} | "
        f"{_p50(t1):.2f} / {_p50(t16):.2f} | {_p50(p1):.2f} / {_p50(p16):.2f} |"
    )


_HEAD = ["| config | hop p50 us | hop p90 us | hop p99 us | TTFT p50 ms (1 / 16) | TPOT p50 ms (1 / 16) |",
         "|---|---|---|---|---|---|"]


def _p50_ratios(shm: ConfigFigures, stock: ConfigFigures, metric: str) -> list[float]:
    """shm / stock p50 of a per-stream metric ("ttft_ms", "tpot_ms") at 1 and 16 streams."""
    a, b = getattr(shm, metric), getattr(stock, metric)
    return [_p50(a[k]) / max(_p50(b[k]), 1e-9) for k in (1, 16)]


def _part_head(title: str, configs: dict[str, ConfigFigures]) -> list[str]:
    """A part's table after the quiet one: a blank line, its title, the header, a row per
    configuration."""
    return ["", title, *_HEAD, *(_row(name, r) for name, r in configs.items())]


def _busy_ratios(shm: ConfigFigures, stock: ConfigFigures) -> list[float]:
    """shm / stock: hop p50, TPOT p50 at 1 stream, TPOT p50 at 16."""
    return [_p50(shm.hop_us) / max(_p50(stock.hop_us), 1e-9), *_p50_ratios(shm, stock, "tpot_ms")]


def _median(values: list[float]) -> float:
    v = sorted(values)
    mid = len(v) // 2
    return v[mid] if len(v) % 2 else (v[mid - 1] + v[mid]) / 2


def _busy_verdict(per_pair: list[list[float]]) -> tuple[list[float], str]:
    """Medians over the pairs of (hop, TPOT 1, TPOT 16) ratios, and the verdict on them:
    "met" when every median is at most 1; otherwise each figure above 1 is named, with
    "no difference shown" where its pairs lie on both sides of 1 (the spread covers 1)."""
    figures = ("hop", "TPOT (1 stream)", "TPOT (16)")
    columns = list(zip(*per_pair))
    medians = [_median(list(c)) for c in columns]
    above = [(name, c) for name, c, m in zip(figures, columns, medians) if m > 1.0]
    if not above:
        return medians, "target met"
    said = []
    for name, c in above:
        if min(c) <= 1.0:
            said.append(f"{name} no difference shown (pairs {min(c):.2f}-{max(c):.2f})")
        else:
            said.append(f"{name} above 1 in every pair ({min(c):.2f}-{max(c):.2f})")
    return medians, "target NOT met: " + "; ".join(said)


def _busy_table(busy: BusyHost | None) -> list[str]:
    """The busy-host cell: target shm hop p50 <= stock's, TPOT p50 no worse than stock's,
    judged on the median over the pairs of each pair's ratio (over the merged passes
    where the pairs were not kept)."""
    if not busy or not busy.configs:
        return []
    cfg = busy.configs
    lines = _part_head(f"with {busy.processes} busy processes, one pinned to each CPU (target: shm hop p50 "
                       "<= stock's, TPOT p50 <= stock's)", cfg)
    for kind in ("sync", "async"):
        st, sh = f"{kind}-stock", f"{kind}-shm"
        pairs = [p for p in busy.pairs if st in p and sh in p]
        if pairs:
            per_pair = [_busy_ratios(p[sh], p[st]) for p in pairs]
        elif st in cfg and sh in cfg:
            per_pair = [_busy_ratios(cfg[sh], cfg[st])]
        else:
            continue
        (hop, t1, t16), verdict = _busy_verdict(per_pair)
        over = f", median over {len(per_pair)} pairs" if pairs else ""
        spread = ""
        if len(per_pair) > 1:
            cols = list(zip(*per_pair))
            spread = " (pairs: " + ", ".join(
                f"{name} {min(c):.2f}-{max(c):.2f}" for name, c in zip(("hop", "TPOT 1", "TPOT 16"), cols)) + ")"
        lines.append(f"{kind}: shm / stock{over}: hop p50 {hop:.2f}x, TPOT p50 {t1:.2f}x (1 stream) / "
                     f"{t16:.2f}x (16){spread}: {verdict}")
    return lines


def _dp_table(dp: DataParallel | None) -> list[str]:
    """Data parallelism: target shm hop p50 <= 0.3x stock's, TTFT and TPOT p50 no worse."""
    if not dp or not dp.configs:
        return []
    cfg = dp.configs
    lines = _part_head(f"AsyncLLM with {dp.engines} engine cores (data parallelism; target: shm hop p50 "
                       "<= 0.3x stock's, TTFT and TPOT p50 <= stock's)", cfg)
    st = cfg.get("async-stock")
    for name in ("shm", "shm-inline"):  # the default output mode, then inline
        sh = cfg.get(f"async-{name}")
        if not (st and sh):
            continue
        hop = _p50(sh.hop_us) / max(_p50(st.hop_us), 1e-9)
        ttft, tpot = _p50_ratios(sh, st, "ttft_ms"), _p50_ratios(sh, st, "tpot_ms")
        ok = hop <= 0.3 and all(t <= 1.0 for t in ttft + tpot)
        lines.append(
            f"async: {name} / stock: hop p50 {hop:.2f}x, TTFT p50 {ttft[0]:.2f}x / {ttft[1]:.2f}x, TPOT p50 "
            f"{tpot[0]:.2f}x (1 stream) / {tpot[1]:.2f}x (16): target {'met' if ok else 'NOT met'}"
        )
    return lines


#: The plug-in's output hop targets, shm p50 / stock p50 in the same run, per client.
HOP_TARGETS = {"sync": 0.25, "async": 0.3}


def _config_table(results: VllmComparison) -> list[str]:
    lines = [
        f"{_title(results)}; load average {results.load_before[0]:.2f} before, {results.load_after[0]:.2f} after",
        *_HEAD,
    ]
    lines += [_row(name, r) for name, r in results.configs.items()]
    for kind, target in HOP_TARGETS.items():
        stock_cfg, shm_cfg = results.configs.get(f"{kind}-stock"), results.configs.get(f"{kind}-shm")
        stock = stock_cfg.hop_us.p50 if stock_cfg else None
        shm = shm_cfg.hop_us.p50 if shm_cfg else None
        if stock and shm:
            lines.append(f"{kind}: shm output hop p50 = {shm / stock:.2f} x stock (target <= {target})")
    return lines


#: What a point of the hop plot is (printed in its footer).
HOP_POINTS = ("each point: one output batch (every k-th, up to about 2000 per configuration), "
              "its engine timestamp -> get_output returning it in the frontend; y: the share "
              "of batches at most that long")


def plot(results: VllmComparison, path: str) -> str | None:
    """CDF of the output hop per configuration, with a footer saying what a point is and
    the date, machine and load; None without matplotlib or without hops."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    figures = dict(results.configs)
    if results.dp is not None:
        figures.update({f"{name}, {results.dp.engines} engine cores": r for name, r in results.dp.configs.items()})
    curves = {name: sorted(r.hops_sample_us) for name, r in figures.items()}
    curves = {name: v for name, v in curves.items() if v}
    if not curves:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, v in curves.items():
        ax.plot(v, [(i + 1) / len(v) for i in range(len(v))], label=name)
    ax.set_xscale("log")
    ax.set_xlabel("engine → frontend output hop (µs)")
    ax.set_ylabel("fraction of batches")
    ax.set_title("vLLM output hop: stock ZMQ vs shmclient rings")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    from . import plots

    # Footer: what a point is, the date, the machine and the load before the run.
    plots.label_figure(fig, plots.footer_label(results.load_before), HOP_POINTS)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
