"""The PNG plots of a run: the latency CDF and the tensor transfer times, with footers.

Every plot carries a footer: what a point is, then the run's date, machine and load
(``run_label``; ``footer_label`` for a plot drawn outside a run). Matplotlib is optional
(the ``bench`` extra): without it the plot functions return a note instead of a path.
"""

from __future__ import annotations

import datetime
import os
import platform
from typing import Any, Sequence

import numpy as np

from .machine import cpu_model
from .tensor_results import TransferPoint


def run_label(res: dict[str, Any]) -> str:
    """A short label of the run for plots: date, host, CPUs and their model, load average
    and the other processes' load."""
    facts = res.get("machine") or {}
    parts = [str(facts.get("date", "?")).replace("T", " ")]
    if facts.get("host"):
        parts.append(str(facts["host"]))
    cpus = f"{facts.get('cpu_count_logical', '?')} CPUs"
    parts.append(f"{cpus} ({facts['cpu_model']})" if facts.get("cpu_model") else cpus)
    la0 = (facts.get("load_average") or [None])[0]
    la1 = (facts.get("load_average_end") or [None])[0]
    if la0 is not None and la1 is not None:
        parts.append(f"load average {la0:.2f} -> {la1:.2f}")
    load = res.get("load") or {}
    whole = (load.get("whole_run") or {}).get("other_cores")
    if load.get("noisy"):
        parts.append(f"NOISY: other processes up to {load.get('max_other_cores') or 0:.2f} cores")
    elif whole is not None:
        parts.append(f"quiet: other processes {whole:.2f} cores")
    if res.get("interrupted"):
        parts.append("interrupted")
    return " · ".join(parts)


def _pyplot() -> Any:
    """matplotlib.pyplot with the Agg backend, or None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


MATPLOTLIB_MISSING = "plots skipped: matplotlib is not installed (pip install 'shmclient[bench]')"


def footer_label(load_average: Sequence[float] | None = None) -> str:
    """The footer of a plot drawn without a run's label (``run_label``): the date now,
    the machine (host, CPUs, CPU model) and the load average (``load_average``, e.g. the
    one taken before the measurement, else now)."""
    parts = [datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M:%S %z"),
             platform.node() or "?", f"{os.cpu_count() or '?'} CPUs ({cpu_model()})"]
    if load_average is None:
        try:
            load_average = os.getloadavg()
        except OSError:
            load_average = None
    if load_average:
        parts.append(f"load average {load_average[0]:.2f}")
    return " · ".join(parts)


def label_figure(fig: Any, label: str | None, what: str = "") -> None:
    """The footer under the axes: what each point is, then the run's date, machine and
    load (``label``; ``footer_label()`` when None)."""
    import textwrap

    width = int(fig.get_figwidth() * 17)  # characters of 7 pt text across the figure
    lines = textwrap.wrap(what, width) + textwrap.wrap(label or footer_label(), width)
    fig.text(0.01, 0.01, "\n".join(lines), fontsize=7, color="0.35", ha="left", va="bottom")
    line_h = 7 * 1.3 / 72 / fig.get_figheight()  # one line of 7 pt text, as a figure fraction
    fig.tight_layout(rect=(0, line_h * len(lines) + 0.015, 1, 1))


def fmt_bytes(n: float) -> str:
    """A size in bytes as people write it: '512 B', '4 KiB', '1.5 MiB', '2 GiB'."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            v = n / scale
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{n:.0f} B"


#: What a point of each plot is (printed in its footer).
CDF_POINTS = ("each point: one request's round trip, add_request -> its finished output; "
              "y: the share of requests at most that long")
TRANSFER_POINTS = "each point: the median transfer time of the repeats at that size"


def plot_latency_cdf(
    samples_ns: dict[str, Sequence[int]],
    path: str,
    title: str = "Round-trip latency",
    label: str | None = None,
) -> str:
    """One CDF line per configuration (x: µs, log scale), each point one request;
    ``label`` (the run: date, host, load; the machine now when None) under the axes. Returns the path, or a note starting with 'plots
    skipped' when matplotlib is missing."""
    plt = _pyplot()
    if plt is None:
        return MATPLOTLIB_MISSING
    fig, ax = plt.subplots(figsize=(8, 5))
    try:
        for cfg, s in samples_ns.items():
            a = np.sort(np.asarray(s, dtype=np.float64)) * 1e-3
            if a.size == 0:
                continue
            y = np.arange(1, a.size + 1) / a.size
            ax.plot(a, y, label=f"{cfg} (p50 {np.percentile(a, 50):.1f} µs)", lw=1.4)
        ax.set_xscale("log")
        ax.set_xlabel("round trip, µs (log)")
        ax.set_ylabel("fraction of requests ≤ x")
        ax.set_ylim(0, 1.0)
        ax.grid(True, which="both", alpha=0.3)
        ax.set_title(title)
        ax.legend(fontsize=8, loc="lower right")
        label_figure(fig, label, CDF_POINTS)
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return path


def plot_transfer(points: Sequence[TransferPoint], path: str, label: str | None = None) -> str:
    """Median transfer time against size, log-log, one line per series of the typed
    ``points`` (``TensorSweep.points()``), sizes labelled in KiB / MiB; ``label`` (the
    run; the machine now when None) under the axes. Returns the path or a note starting
    with 'plots skipped'."""
    plt = _pyplot()
    if plt is None:
        return MATPLOTLIB_MISSING
    series: dict[str, list[tuple[int, float]]] = {}
    for p in points:
        if p.size_bytes > 0 and p.median_us > 0:  # a log scale shows no zero
            series.setdefault(p.series, []).append((p.size_bytes, p.median_us))
    if not series:
        return "plots skipped: no (size, time) points to plot"
    fig, ax = plt.subplots(figsize=(8, 5))
    try:
        for name, pts in series.items():
            xs, ys = zip(*sorted(pts))
            ax.plot(xs, ys, marker="o", ms=3, lw=1.2, label=name)
        from matplotlib.ticker import FixedLocator, NullLocator

        ax.set_xscale("log")
        ax.set_yscale("log")
        sizes = sorted({x for pts in series.values() for x, _ in pts})
        ax.xaxis.set_major_locator(FixedLocator(sizes))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticklabels([fmt_bytes(x) for x in sizes])
        ax.set_xlabel("tensor size (log)")
        ax.set_ylabel("median transfer time, µs (log)")
        ax.grid(True, which="both", alpha=0.3)
        ax.set_title("Tensor transfer time against size")
        ax.legend(fontsize=7)
        label_figure(fig, label, TRANSFER_POINTS)
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return path
