"""The printed report of ``python -m shmclient_bench``: every section's table in one text.

Nothing here measures anything. ``format_report`` renders the latency, streaming and
idle tables from the figures ``shmclient_bench.clients`` measured, then each section run
in a child process of its own: its title and the table that section rendered of its
typed result (``shmclient_bench.sections``); ``noisy_line`` says how much other
processes loaded the machine.
"""

from __future__ import annotations

import re

from typing import Any

from .stats import baseline_of
from .tables import compare, faster, table


def _noisy_cell(e: dict[str, Any]) -> str:
    n, blocks = e.get("noisy_blocks"), e.get("blocks")
    judged = e.get("judged", blocks)
    if not blocks or not judged:
        return "-"  # (none judged alone: too short, or no counters; the run's line judges)
    return f"{n}/{judged}" if n else "0"


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
        "model; 'noisy': blocks in which other processes loaded the CPU ('-': none long "
        "enough to judge alone, the whole run's window judges them)",
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
                    else compare(e["outputs_per_s"], base.get("outputs_per_s"), False, ("more", "fewer")),
                    e["batches"],
                    e["wall_us_per_batch"],
                    e["gap_us"]["p99"],
                    e["client_cpu_us_per_batch"],
                    "baseline"
                    if own
                    else compare(
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


#: The sections run in a child process of their own, in the order reported, with their titles.
EXTERNAL_TITLES = {
    "tensors": "Tensor transfer sweep (shmclient_bench.tensors):",
    "ring": "Raw ring ping-pong vs pyzmq ipc (shmclient_bench.ring):",
    "contention": "Sync and async clients on a busy host, shm vs zmq (shmclient_bench.contention):",
    "fairness": "Event-loop fairness of the async client (shmclient_bench.fairness):",
    "dp": "Data parallelism, 1 and 2 engines (shmclient_bench.dp):",
    "vllm": "Stock vLLM vs vLLM over the rings (shmclient_bench.vllm):",
    "serving": "vLLM's OpenAI server under vLLM's serving benchmark, stock vs the plug-in "
               "(shmclient_bench.serving):",
}

#: In place of the table of a section whose own rendering failed.
NO_TABLE = "  no table: the section's rendering failed (see Notes); its figures are in results.json"


#: A target's verdict in a section's table ("met", "NOT met").
_VERDICT = re.compile(r"\b(?:NOT )?met\b")


def _external_sections(res: dict[str, Any]) -> list[str]:
    """Each section run in a child process that has a result: its title (marked when
    other processes loaded the CPU during it), then the table it rendered of its typed
    result (``res['tables']``)."""
    tables = res.get("tables") or {}
    sload = res.get("section_load") or {}
    lines: list[str] = []
    for name, title in EXTERNAL_TITLES.items():
        if res.get(name) is None:
            continue
        b = sload.get(name) or {}
        text = tables.get(name)
        if b.get("noisy"):
            title += f" [NOISY: other processes used {b.get('other_cores') or 0:.2f} cores]"
            if text is not None:
                # The child rendered its verdicts without knowing: none is judged.
                text = _VERDICT.sub(NOT_JUDGED, text)
        lines += ["", title, NO_TABLE if text is None else text.rstrip()]
    return lines


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
    lines += _external_sections(res)
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
