"""Reporting for ``python -m shmclient_bench``: summaries, machine facts, tables, JSON and plots.

Nothing here measures anything. ``summarize`` turns raw samples into the figures every
section reports; ``machine_facts`` describes the machine and the package versions;
``format_report`` renders the readable tables; ``write_json`` and the ``plot_*``
functions write the results folder. Matplotlib is optional (the ``bench`` extra): without
it the plot functions return a note instead of a path.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import subprocess
import sys
from importlib import metadata
from typing import Any, Iterable, Sequence

import numpy as np

#: Percentiles reported for every sample set (linear interpolation between order
#: statistics, numpy's default method).
PERCENTILES = (50.0, 90.0, 99.0, 99.9)

#: Packages whose versions go into the JSON (distribution names).
PACKAGES = ("torch", "numpy", "msgspec", "pyzmq", "psutil", "matplotlib", "shmclient")

# -- statistics ----------------------------------------------------------------------


def pkey(p: float) -> str:
    """Key of a percentile in a summary: 50 -> 'p50', 99.9 -> 'p99.9'."""
    return "p" + (f"{p:g}")


def summarize(samples_ns: Sequence[int] | np.ndarray, unit: str = "us") -> dict[str, Any]:
    """Summary of durations given in nanoseconds, reported in ``unit`` ('us' or 'ns').

    Keys: n, unit, mean, std (population), min, p50, p90, p99, p99.9, max. An empty input
    gives n=0 and None for every figure.
    """
    scale = {"us": 1e-3, "ns": 1.0, "ms": 1e-6}[unit]
    a = np.asarray(samples_ns, dtype=np.float64)
    out: dict[str, Any] = {"n": int(a.size), "unit": unit}
    names = ["mean", "std", "min"] + [pkey(p) for p in PERCENTILES] + ["max"]
    if a.size == 0:
        out.update({k: None for k in names})
        return out
    a = a * scale
    out["mean"] = float(a.mean())
    out["std"] = float(a.std())
    out["min"] = float(a.min())
    for p, v in zip(PERCENTILES, np.percentile(a, PERCENTILES)):
        out[pkey(p)] = float(v)
    out["max"] = float(a.max())
    return out


def overhead_ratio(shm: float | None, zmq: float | None, inproc: float | None) -> float | None:
    """(shm - inproc) / (zmq - inproc): the share of zmq's added latency that shm adds.

    None when a figure is missing or zmq adds nothing over inproc (no meaningful ratio).
    """
    if shm is None or zmq is None or inproc is None:
        return None
    denom = zmq - inproc
    if denom <= 0:
        return None
    return (shm - inproc) / denom


# -- machine facts -------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(dist: str) -> str | None:
    for name in (dist, dist.replace("_", "-"), dist.replace("-", "_")):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    # Not installed as a distribution (e.g. run from a checkout): ask the module.
    module = {"pyzmq": "zmq"}.get(dist, dist)
    try:
        mod = __import__(module)
    except Exception:
        return None
    return str(getattr(mod, "__version__", getattr(mod, "VERSION", None)) or "") or None


def _git_commit() -> str | None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        out = subprocess.run(
            ["git", "-C", root, "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def machine_facts() -> dict[str, Any]:
    """CPU, memory, OS, Python, package versions, GPU (if torch sees one) and the date."""
    facts: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpu_model": _cpu_model(),
        "cpu_count_logical": os.cpu_count(),
        "machine": platform.machine(),
        "os": platform.platform(),
        "python": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
        "packages": {p: _version(p) for p in PACKAGES},
        "git_commit": _git_commit(),
    }
    try:
        import psutil

        facts["cpu_count_physical"] = psutil.cpu_count(logical=False)
        facts["memory_total_bytes"] = psutil.virtual_memory().total
        facts["load_average"] = list(os.getloadavg())
    except Exception:
        pass
    try:
        import zmq

        facts["libzmq"] = zmq.zmq_version()
    except Exception:
        pass
    gpu: dict[str, Any] | None = None
    try:
        import torch

        facts["torch_cuda_build"] = torch.version.cuda
        if torch.cuda.is_available():
            gpu = {
                "count": torch.cuda.device_count(),
                "name": torch.cuda.get_device_name(0),
                "capability": list(torch.cuda.get_device_capability(0)),
                "memory_total_bytes": torch.cuda.get_device_properties(0).total_memory,
            }
    except Exception as e:  # torch missing or broken: say so, do not fail the run
        facts["torch_error"] = f"{type(e).__name__}: {e}"
    facts["gpu"] = gpu
    return facts


# -- tables --------------------------------------------------------------------------


def _fmt(v: Any, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    if isinstance(v, float) and not math.isfinite(v):
        return "-"
    if isinstance(v, (int, float)):
        av = abs(v)
        if av >= 1e6:
            return f"{v:,.0f}"
        if av >= 100 or isinstance(v, int):
            return f"{v:,.0f}" if av >= 1000 else f"{v:.0f}"
        return f"{v:.{digits}f}"
    return str(v)


def _compare(v: float | None, base: float | None, lower_is_better: bool, words: tuple[str, str]) -> str:
    """``v`` against ``base`` in words that say which way is better: '4.95x faster',
    '1.20x slower' (words = ('faster', 'slower'), for a time), '1.49x more' (for a rate).
    The better word comes first in ``words``."""
    if v is None or base is None or v <= 0 or base <= 0:
        return "-"
    if v == base:
        return "same"
    better = v < base if lower_is_better else v > base
    factor = max(v, base) / min(v, base)
    return f"{factor:.2f}x {words[0] if better else words[1]}"


def faster(t: float | None, base: float | None) -> str:
    """A time against the baseline's: '4.95x faster' or '1.20x slower'."""
    return _compare(t, base, True, ("faster", "slower"))


def _noisy_cell(e: dict[str, Any]) -> str:
    n, blocks = e.get("noisy_blocks"), e.get("blocks")
    if not blocks:
        return "-"
    return f"{n}/{blocks}" if n else "0"


#: A target's verdict on figures taken while other processes loaded the CPU: they say
#: nothing about shmclient, neither "met" nor "NOT met".
NOT_JUDGED = "not judged (noisy)"


def noisy_line(load: dict[str, Any]) -> str:
    """One line saying that (and how much) other processes loaded the machine."""
    whole = (load.get("whole_run") or {}).get("other_cores")
    peak = load.get("max_other_cores")
    detail = []
    if peak is not None:
        detail.append(f"up to {peak:.2f} cores")
    if whole is not None:
        detail.append(f"{whole:.2f} over the whole run")
    detail.append(f"threshold {load.get('threshold_cores', 0):g}")
    return (
        f"NOISY RUN: other processes used the CPU in {load.get('noisy_blocks', 0)} of "
        f"{load.get('blocks_judged', 0)} blocks ({', '.join(detail)}): shm's figures need a "
        "quiet CPU, rerun on a quiet host (noisy blocks are marked below)"
    )


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


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], align: str | None = None) -> str:
    """A plain-text table; ``align`` is one 'l' or 'r' per column (default: first left)."""
    rows = [[_fmt(c) for c in r] for r in rows]
    headers = list(headers)
    align = align or ("l" + "r" * (len(headers) - 1))
    widths = [len(h) for h in headers]
    for r in rows:
        for i, c in enumerate(r):
            widths[i] = max(widths[i], len(c))

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(cells, widths, align)
        ).rstrip()

    out = [line(headers), line(["-" * w for w in widths])]
    out += [line(r) for r in rows]
    return "\n".join(out)


def baseline_of(config: str) -> str | None:
    """The zmq configuration a configuration is compared with, in the same run.

    'sync-shm' -> 'sync-zmq', 'async-shm@tiny' -> 'async-zmq@tiny', 'inproc' ->
    'sync-zmq'; a zmq configuration is its own baseline.
    """
    kind, _, model = config.partition("@")
    suffix = f"@{model}" if model else ""
    if kind == "inproc":
        return "sync-zmq" + suffix
    mode, _, transport = kind.partition("-")
    if transport in ("shm", "zmq"):
        return f"{mode}-zmq{suffix}"
    return None


def latency_ratios(latency: dict[str, Any]) -> dict[str, Any]:
    """The share of zmq's added latency that shm adds, per model and mode:
    (shm - inproc) / (zmq - inproc) on p50; the target is 0.10 for both modes."""
    out: dict[str, Any] = {}
    models = sorted({c.partition("@")[2] for c in latency})
    targets = {"sync": 0.10, "async": 0.10}
    for model in models:
        sfx = f"@{model}" if model else ""
        inproc = latency.get("inproc" + sfx, {}).get("summary", {}).get("p50")
        for mode, target in targets.items():
            shm = latency.get(f"{mode}-shm{sfx}", {}).get("summary", {}).get("p50")
            zmq = latency.get(f"{mode}-zmq{sfx}", {}).get("summary", {}).get("p50")
            if shm is None or zmq is None or inproc is None:
                continue
            r = overhead_ratio(shm, zmq, inproc)
            # The targets are set on the mock model; other models are a realism check.
            tgt = target if not model else None
            out[f"{mode}{sfx}"] = {
                "model": model or "mock",
                "mode": mode,
                "inproc_p50_us": inproc,
                "shm_p50_us": shm,
                "zmq_p50_us": zmq,
                "shm_added_us": shm - inproc,
                "zmq_added_us": zmq - inproc,
                "ratio": r,
                "target": tgt,
                "met": None if r is None or tgt is None else bool(r <= tgt),
            }
    return out


def _latency_section(res: dict[str, Any]) -> list[str]:
    lat = res.get("latency") or {}
    if not lat:
        return []
    meta = res.get("latency_meta", {})
    lines = [
        "",
        f"Round-trip latency: add_request -> finished output, max_tokens=1 (µs; "
        f"{meta.get('rounds', '?')} rounds in rotation, {meta.get('warmup', '?')} warm-up "
        "round trips per block excluded)",
        "'vs zmq': how much faster (or slower) than the zmq client of the same mode and "
        "model; 'noisy': blocks in which other processes loaded the CPU",
    ]
    rows = []
    for cfg, entry in lat.items():
        s = entry["summary"]
        base_cfg = baseline_of(cfg) or ""
        base = lat.get(base_cfg, {}).get("summary", {})
        own = base_cfg == cfg
        rows.append(
            [
                cfg,
                s["n"],
                s["p50"],
                s["p99"],
                s["p99.9"],
                s["mean"],
                "baseline" if own else faster(s["p50"], base.get("p50")),
                "baseline" if own else faster(s["p99"], base.get("p99")),
                "baseline" if own else faster(s["p99.9"], base.get("p99.9")),
                _noisy_cell(entry),
            ]
        )
    lines.append(
        table(
            ["config", "n", "p50", "p99", "p99.9", "mean", "p50 vs zmq", "p99 vs zmq",
             "p99.9 vs zmq", "noisy"],
            rows,
        )
    )
    ratios = res.get("latency_ratios") or {}
    run_noisy = bool((res.get("load") or {}).get("noisy"))
    if ratios:
        lines.append("")
        lines.append("Share of zmq's added latency that shm adds, (shm - inproc) / (zmq - inproc), p50:")
        for key, r in ratios.items():
            ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f} ({r['ratio'] * 100:.1f} %)"
            sfx = "" if r["model"] == "mock" else f"@{r['model']}"
            noisy = run_noisy or any(
                (lat.get(c) or {}).get("noisy_blocks")
                for c in (f"inproc{sfx}", f"{r['mode']}-shm{sfx}", f"{r['mode']}-zmq{sfx}"))
            if r["target"] is None:
                verdict = "no target (realism check)"
            elif noisy and r["met"] is not None:
                verdict = f"target <= {r['target']:.2f}: {NOT_JUDGED}"
            else:
                verdict = f"target <= {r['target']:.2f}: " + (
                    "-" if r["met"] is None else "met" if r["met"] else "NOT met"
                )
            lines.append(
                f"  {r['mode']:<5} {r['model']:<6} shm adds {r['shm_added_us']:.1f} µs, zmq adds "
                f"{r['zmq_added_us']:.1f} µs -> {ratio}; {verdict}"
            )
    return lines


def _streaming_section(res: dict[str, Any]) -> list[str]:
    st = res.get("streaming") or {}
    if not st:
        return []
    meta = res.get("streaming_meta", {})
    lines = [
        "",
        f"Streaming: N concurrent requests x {meta.get('tokens', '?')} tokens "
        f"({meta.get('rounds', '?')} runs per cell; outputs/s is the median run; CPU is the "
        "whole frontend process per output batch, inproc includes the engine; 'vs zmq': "
        "against the zmq client of the same mode, more outputs/s and less CPU are better)",
    ]
    rows = []
    for cfg, by_n in st.items():
        for n, e in by_n.items():
            base_cfg = baseline_of(cfg)
            base = (st.get(base_cfg or "", {}) or {}).get(n, {})
            own = base_cfg == cfg
            rows.append(
                [
                    cfg,
                    int(n),
                    e["outputs_per_s"],
                    "baseline"
                    if own
                    else _compare(e["outputs_per_s"], base.get("outputs_per_s"), False, ("more", "fewer")),
                    e["batches"],
                    e["wall_us_per_batch"],
                    e["gap_us"]["p99"],
                    e["client_cpu_us_per_batch"],
                    "baseline"
                    if own
                    else _compare(
                        e["client_cpu_us_per_batch"],
                        base.get("client_cpu_us_per_batch"),
                        True,
                        ("less", "more"),
                    ),
                    _noisy_cell(e),
                ]
            )
    lines.append(
        table(
            [
                "config",
                "N",
                "outputs/s",
                "outputs/s vs zmq",
                "batches",
                "µs/batch",
                "gap p99 µs",
                "CPU µs/batch",
                "CPU vs zmq",
                "noisy",
            ],
            rows,
        )
    )
    return lines


def _idle_section(res: dict[str, Any]) -> list[str]:
    idle = res.get("idle_cpu") or {}
    if not idle:
        return []
    meta = res.get("idle_meta", {})
    lines = [
        "",
        f"Idle CPU, % of one core (idle {meta.get('settle_s', '?')} s first, then measured "
        f"over {meta.get('window_s', '?')} s with a caller parked in get_output; "
        "target < 2 % each)",
    ]
    run_noisy = bool((res.get("load") or {}).get("noisy"))
    rows = []
    for cfg, e in idle.items():
        if "error" in e:
            rows.append([cfg, "-", "-", "-", e["error"]])
            continue
        ok = e["client_pct"] < 2.0 and e["engine_pct"] < 2.0
        rows.append(
            [
                cfg,
                f"{e['client_pct']:.2f}",
                f"{e['engine_pct']:.2f}",
                NOT_JUDGED if run_noisy or e.get("noisy") else "met" if ok else "NOT met",
                e.get("source", ""),
                "yes" if e.get("noisy") else "-" if e.get("noisy") is None else "no",
            ]
        )
    lines.append(
        table(["config", "client %", "engine %", "< 2 %", "source", "noisy"], rows, "lrrlll")
    )
    return lines


def _flatten_numbers(obj: Any, prefix: str = "", limit: int = 40) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []

    def walk(o: Any, p: str) -> None:
        if len(out) >= limit:
            return
        if isinstance(o, dict):
            for k, v in o.items():
                walk(v, f"{p}.{k}" if p else str(k))
        elif isinstance(o, (list, tuple)) and len(o) <= 64:
            for i, v in enumerate(o):
                walk(v, f"{p}[{i}]")
        elif isinstance(o, (int, float, str, bool)) and not isinstance(o, bool) or o is None:
            out.append((p, o))

    walk(obj, prefix)
    return out


def _external_section(title: str, data: Any, text: str | None = None) -> list[str]:
    """Render what another benchmark module returned: the text its own report() made
    (``text``) or a 'table' string in it, else a table of its records, else its numeric
    leaves."""
    if data is None:
        return []
    lines = ["", title]
    if text is None and isinstance(data, dict) and isinstance(data.get("table"), str):
        text = data["table"]
    if text is not None:
        lines.append(text.rstrip())
        return lines
    records = find_records(data)
    if records:
        keys: list[str] = []
        for r in records:
            for k, v in r.items():
                if k not in keys and isinstance(v, (int, float, str)) and not isinstance(v, bool):
                    keys.append(k)
        keys = keys[:10]
        lines.append(table(keys, [[r.get(k) for k in keys] for r in records[:60]]))
        if len(records) > 60:
            lines.append(f"... {len(records) - 60} more rows in the JSON")
        return lines
    for k, v in _flatten_numbers(data):
        lines.append(f"  {k} = {_fmt(v, 3)}")
    return lines


def find_records(data: Any) -> list[dict[str, Any]]:
    """The first list of flat dict records found in ``data`` (depth-first), else [].

    Lists under a key get that key as a 'series' field when they do not carry one."""
    if isinstance(data, list) and data and all(isinstance(x, dict) for x in data):
        if any(isinstance(v, (int, float)) for x in data for v in x.values()):
            return data
    if isinstance(data, dict):
        found: list[dict[str, Any]] = []
        for k, v in data.items():
            sub = find_records(v)
            if sub:
                for r in sub:
                    found.append(r if "series" in r else {"series": k, **r})
        return found
    return []


def format_report(res: dict[str, Any]) -> str:
    """Every table of a results dict, as printed at the end of a run."""
    facts = res.get("machine", {})
    head = (
        f"shmclient benchmark ({'quick' if res.get('args', {}).get('quick') else 'full'} run, "
        f"{facts.get('date', '?')}): {facts.get('cpu_count_logical', '?')} CPUs "
        f"({facts.get('cpu_model', '?')}), Python {facts.get('python', '?')}"
    )
    gpu = facts.get("gpu")
    if gpu:
        head += f", GPU {gpu.get('name')}"
    load = res.get("load") or {}
    whole = (load.get("whole_run") or {}).get("other_cores")
    lines = []
    if load.get("noisy"):
        lines.append(noisy_line(load))
    elif whole is not None:
        head += f"; quiet (other processes {whole:.2f} cores)"
    if res.get("interrupted"):
        i = res["interrupted"]
        lines.append(f"INTERRUPTED ({i.get('signal')}) during {i.get('during')}: partial results")
    lines.append(head)
    lines += _latency_section(res)
    lines += _streaming_section(res)
    lines += _idle_section(res)
    tables = res.get("tables") or {}
    sload = res.get("section_load") or {}

    def noisy_tag(name: str) -> str:
        b = sload.get(name) or {}
        if b.get("noisy"):
            return f" [NOISY: other processes used {b.get('other_cores') or 0:.2f} cores]"
        return ""

    lines += _external_section(
        "Tensor transfer sweep (shmclient_bench.tensors):" + noisy_tag("tensors"),
        res.get("tensors"),
        tables.get("tensors"),
    )
    lines += _external_section(
        "Raw ring ping-pong vs pyzmq ipc (shmclient_bench.ring):" + noisy_tag("ring"),
        res.get("ring"),
        tables.get("ring"),
    )
    lines += _external_section(
        "Sync and async clients on a busy host, shm vs zmq (shmclient_bench.contention):" + noisy_tag("contention"),
        res.get("contention"),
        tables.get("contention"),
    )
    lines += _external_section(
        "Event-loop fairness of the async client (shmclient_bench.fairness):" + noisy_tag("fairness"),
        res.get("fairness"),
        tables.get("fairness"),
    )
    lines += _external_section(
        "Data parallelism, 1 and 2 engines (shmclient_bench.dp):" + noisy_tag("dp"),
        res.get("dp"),
        tables.get("dp"),
    )
    lines += _external_section(
        "Stock vLLM vs vLLM over the rings (shmclient_bench.vllm):" + noisy_tag("vllm"),
        res.get("vllm"),
        tables.get("vllm"),
    )
    lines += _external_section(
        "vLLM's OpenAI server under vLLM's serving benchmark, stock vs the plug-in "
        "(shmclient_bench.serving):" + noisy_tag("serving"),
        res.get("serving"),
        tables.get("serving"),
    )
    notes = res.get("notes") or []
    if notes:
        lines.append("")
        lines.append("Notes:")
        lines += [f"  {n}" for n in notes]
    skipped = res.get("skipped") or []
    if skipped:
        lines.append("")
        lines.append("Skipped:")
        lines += [f"  {s}" for s in skipped]
    return "\n".join(lines)


# -- files ---------------------------------------------------------------------------


def _jsonable(o: Any) -> Any:
    if isinstance(o, dict):
        return {str(k): _jsonable(v) for k, v in o.items()}
    if isinstance(o, (list, tuple, set)):
        return [_jsonable(v) for v in o]
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, (str, int, float, bool)) or o is None:
        return o
    return repr(o)


#: What samples.json holds, written into it next to its unit.
SAMPLES_WHAT = ("round trip of each request, add_request -> its finished output "
                "(max_tokens=1), one list per configuration, in the order measured")


def samples_file(samples_ns: dict[str, Sequence[int]]) -> dict[str, Any]:
    """samples.json's content: ``unit`` ("ns") and ``what`` beside one list of round
    trips per configuration (the configurations stay top-level keys, as before)."""
    return {"unit": "ns", "what": SAMPLES_WHAT, **samples_ns}


def read_samples(path: str) -> dict[str, list[float]]:
    """The round trips of a samples.json, in ns, per configuration. Reads the files of
    older runs too (no ``unit``: they were ns already)."""
    with open(path) as f:
        data = json.load(f)
    scale = {"ns": 1.0, "us": 1e3, "ms": 1e6, "s": 1e9}[data.get("unit", "ns")]
    return {k: [x * scale for x in v] for k, v in data.items() if isinstance(v, list)}


def write_json(path: str, data: Any) -> str:
    """Write ``data`` as indented JSON (numpy scalars, sets, inf/nan made JSON-safe)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(_jsonable(data), f, indent=1, sort_keys=False)
        f.write("\n")
    return path


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
             platform.node() or "?", f"{os.cpu_count() or '?'} CPUs ({_cpu_model()})"]
    if load_average is None:
        try:
            load_average = os.getloadavg()
        except OSError:
            load_average = None
    if load_average:
        parts.append(f"load average {load_average[0]:.2f}")
    return " · ".join(parts)


def _label_figure(fig: Any, label: str | None, what: str = "") -> None:
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
        _label_figure(fig, label, CDF_POINTS)
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return path


SIZE_KEYS = ("size_bytes", "nbytes", "bytes", "size", "payload_bytes", "message_bytes")
TIME_KEYS = (
    "p50_us",
    "median_us",
    "time_us",
    "us",
    "mean_us",
    "p50_ns",
    "median_ns",
    "time_ns",
    "ns",
    "p50_s",
    "seconds",
)


def _time_us(r: dict[str, Any]) -> float | None:
    """A record's typical time in µs: the first of TIME_KEYS present, or the p50 of a
    nested 'summary' / 'stats' dict."""
    for k in TIME_KEYS:
        v = r.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            if k.endswith("ns"):
                return v * 1e-3
            if k.endswith("us"):
                return float(v)
            return v * 1e6  # seconds
    for k in ("summary", "stats"):
        v = r.get(k)
        if isinstance(v, dict) and isinstance(v.get("p50"), (int, float)):
            unit = v.get("unit", "us")
            return v["p50"] * {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}.get(unit, 1.0)
    return None


def _as_size(key: Any) -> int | None:
    if isinstance(key, int) and not isinstance(key, bool):
        return key if key > 0 else None
    if isinstance(key, str) and key.isdigit():
        return int(key) or None
    return None


def transfer_series(data: Any) -> dict[str, list[tuple[float, float]]]:
    """(size in bytes, time in µs) points per series, from a tensor-sweep result.

    Understands two layouts: nested dicts where one level of keys are sizes in bytes
    ({"shm_view": {"4096": {"median_us": ...}}, "memcpy": {"4096": {"np_copyto": {...}}}};
    the other keys name the series), and lists of records carrying one of SIZE_KEYS
    (the list's key and the records' string fields name the series). A time is the
    first of TIME_KEYS found, or the p50 of a nested 'summary' / 'stats' dict.
    """
    series: dict[str, list[tuple[float, float]]] = {}

    def add(name: str, size: float, t_us: float | None) -> None:
        if t_us is not None and size > 0 and t_us > 0:
            series.setdefault(name or "transfer", []).append((float(size), float(t_us)))

    def walk(o: Any, path: tuple[Any, ...]) -> None:
        if isinstance(o, dict):
            t_us = _time_us(o)
            sizes = [_as_size(p) for p in path]
            size = next((z for z in sizes if z is not None), None)
            if size is None:
                size = next(
                    (o[k] for k in SIZE_KEYS if isinstance(o.get(k), (int, float))), None
                )
            if t_us is not None and size is not None:
                name = " ".join(str(p) for p, z in zip(path, sizes) if z is None)
                extra = [str(v) for k, v in o.items() if isinstance(v, str) and k != "unit"]
                add(" ".join([name, *extra]).strip(), size, t_us)
                return
            for k, v in o.items():
                walk(v, (*path, k))
        elif isinstance(o, list):
            for v in o:
                if isinstance(v, dict):
                    walk(v, path)

    walk(data, ())
    for pts in series.values():
        pts.sort()
    return series


def plot_transfer(
    series: dict[str, list[tuple[float, float]]], path: str, label: str | None = None
) -> str:
    """Median transfer time against size, log-log, one line per series, sizes labelled
    in KiB / MiB; ``label`` (the run; the machine now when None) under the axes. Returns the path or a note starting
    with 'plots skipped'."""
    plt = _pyplot()
    if plt is None:
        return MATPLOTLIB_MISSING
    if not series:
        return "plots skipped: no (size, time) points to plot"
    fig, ax = plt.subplots(figsize=(8, 5))
    try:
        for name, pts in series.items():
            xs, ys = zip(*pts)
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
        _label_figure(fig, label, TRANSFER_POINTS)
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return path


def section_main(argv: Sequence[str] | None, doc: str, run: Any, render: Any, quick_help: str) -> int:
    """The command line of a section module run on its own (``python -m
    shmclient_bench.<section> [--quick] [--json PATH]``): runs ``run(quick)``, prints
    ``render(result)``, writes the result as JSON when asked. Returns the exit status."""
    import argparse

    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--json", metavar="PATH", help="write the figures as JSON here")
    args = ap.parse_args(argv)
    res = run(args.quick)
    print(render(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0
