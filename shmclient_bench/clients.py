"""Client benchmarks: round-trip latency, streaming throughput and idle CPU, run in rounds.

Every configuration (``inproc``, ``sync-shm``, ``sync-zmq``, ``async-shm``, ``async-zmq``;
``@tiny`` appended for the tiny model) gets the same engine config (only ``transport``
differs) and the same requests. The clients of one model are started one after another
(``session.Session``), then measured in rounds: each round visits every configuration
once (the order rotated by one per round) and runs a warm-up followed by one block of
each section; blocks are pooled per configuration; then idle CPU is measured
(``idle_cpu``). Every client is shut down at the end of its model's phase (also on
errors). This module owns the order of a run and what goes into the results dict; the
configurations (``client_configs``), the client loops (``client_drivers``), the CPU
counters (``cpu_time``) are below it, and it never imports the run's command line or
the sections run in a child process.
"""

from __future__ import annotations

from typing import Any

from .client_configs import KINDS, MODELS, SECTIONS, ConfigSpec, Options, Progress, _quiet, parse_configs
from .client_drivers import PROMPT
from .idle_cpu import measure_idle
from .load import NullMonitor
from .session import Session, latency_result, streaming_result
from .stats import summarize

__all__ = ["KINDS", "MODELS", "SECTIONS", "ConfigSpec", "Options", "Progress", "Session", "parse_configs",
           "run"]


# -- the whole client section ----------------------------------------------------------


def _load_note(blk: Any) -> str:
    if blk.noisy:
        return f" [noisy: other processes used {blk.other_cores:.2f} cores]"
    return ""


def run(
    specs: list[ConfigSpec],
    opts: Options,
    progress: Progress = _quiet,
    monitor: Any = None,
    res: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Measure every configuration in ``specs``; returns the results dict fragment:
    latency, latency_samples_ns, streaming, idle_cpu (+ their *_meta), skipped, errors.

    ``monitor`` (a ``shmclient_bench.load.LoadMonitor``) is sampled around every block. ``res``,
    when given, is filled in as each model's phase finishes and returned: a caller that
    is interrupted (KeyboardInterrupt) keeps what finished before.
    """
    monitor = monitor if monitor is not None else NullMonitor()
    if res is None:
        res = {}
    for key, empty in (
        ("latency", {}),
        ("latency_samples_ns", {}),
        ("streaming", {}),
        ("idle_cpu", {}),
        ("skipped", []),
        ("errors", []),
        ("notes", []),
    ):
        res.setdefault(key, empty)
    want = set(opts.sections)
    rounds = max(1, opts.rounds)

    def split(n: int) -> list[int]:
        return [n // rounds + (1 if i < n % rounds else 0) for i in range(rounds)]

    if "latency" in want:
        res["latency_meta"] = {
            "rounds": rounds,
            "warmup": opts.warmup,
            "samples_per_config": opts.samples,
            "samples_per_tiny_config": opts.tiny_samples or opts.samples,
            "max_tokens": 1,
            "prompt_tokens": len(PROMPT),
            "clock": "time.perf_counter_ns",
        }
    if "streaming" in want:
        res["streaming_meta"] = {
            "rounds": rounds,
            "requests": list(opts.streams),
            "tokens": opts.tokens,
            "models": list(opts.stream_models),
        }
    models = list(dict.fromkeys(s.model for s in specs))
    idle_done = False
    for model in models:
        group = [s for s in specs if s.model == model]
        sessions: list[Session] = []
        n_samples = opts.samples
        if model.startswith("tiny") and opts.tiny_samples is not None:
            n_samples = opts.tiny_samples
        per_round = split(n_samples)
        try:
            for spec in group:
                progress(f"starting {spec.name}")
                s = None
                for attempt in (1, 2):
                    try:
                        s = Session(spec, opts.base_config)
                        break
                    except Exception as e:
                        msg = f"{spec.name}: could not start the client: {type(e).__name__}: {e}"
                        progress(msg + ("; trying once more" if attempt == 1 else ""))
                        if attempt == 1:
                            res["notes"].append(f"{msg} (first attempt; retried)")
                        else:
                            # An error, not a skip: the run's targets lose their figures
                            # (and the run its exit status 1), not only a table row.
                            res["errors"].append(msg)
                if s is None:
                    continue
                sessions.append(s)
                progress(f"{spec.name} ready in {s.start_s:.1f} s (engine pid {s.engine_pid})")
            stream_here = "streaming" in want and model in opts.stream_models
            for r in range(rounds):
                live = [s for s in sessions if s.error is None]
                if not live:
                    break
                k = r % len(live)
                for s in live[k:] + live[:k]:
                    try:
                        if "latency" in want and per_round[r] > 0:
                            load: dict[str, Any] = {}
                            with monitor.block(f"latency {s.name} round {r + 1}") as blk:
                                samples = s.latency_block(per_round[r], opts.warmup, load)
                            load.update(noisy=blk.noisy, other_cores=blk.other_cores)
                            sm = summarize(samples)
                            progress(
                                f"round {r + 1}/{rounds} {s.name}: latency {len(samples)} samples, "
                                f"p50 {sm['p50']:.1f} µs, p99 {sm['p99']:.1f} µs" + _load_note(blk)
                            )
                        if stream_here:
                            for n in opts.streams:
                                with monitor.block(f"streaming {s.name} N={n} round {r + 1}") as blk:
                                    run_ = s.streaming_run(n, opts.tokens)
                                run_.noisy = blk.noisy
                                rate = run_.outputs / (run_.wall_ns * 1e-9) if run_.wall_ns else 0
                                progress(
                                    f"round {r + 1}/{rounds} {s.name}: streaming {n} x {opts.tokens}, "
                                    f"{rate:,.0f} outputs/s, {run_.batches} batches" + _load_note(blk)
                                )
                    except Exception as e:
                        s.error = f"{type(e).__name__}: {e}"
                        res["errors"].append(f"{s.name}: {s.error}")
                        progress(f"{s.name} failed: {s.error}")
            for s in sessions:
                if s.latency_ns:
                    res["latency"][s.name] = latency_result(s)
                    res["latency_samples_ns"][s.name] = s.latency_ns
                if s.stream_runs:
                    res["streaming"][s.name] = streaming_result(s, opts.tokens)
            if "idle" in want and not idle_done:
                live = [s for s in sessions if s.error is None and not s.spec.is_inproc]
                if live:
                    idle = measure_idle(
                        live, opts.idle_settle_s, opts.idle_window_s, progress, monitor
                    )
                    res["idle_cpu"].update(idle.get("configs", {}))
                    res["idle_meta"] = {
                        "settle_s": opts.idle_settle_s,
                        "window_s": opts.idle_window_s,
                        "model": model,
                        "measured_together": [s.name for s in live],
                        **idle.get("meta", {}),
                    }
                    idle_done = True
                    for name, e in res["idle_cpu"].items():
                        progress(
                            f"idle {name}: client {e['client_pct']:.2f} %, engine "
                            f"{e['engine_pct']:.2f} % of a core"
                            + (
                                f" [noisy: other processes used {e['other_cores']:.2f} cores]"
                                if e.get("noisy")
                                else ""
                            )
                        )
        finally:
            interrupted: BaseException | None = None
            for s in sessions:
                try:
                    s.close()
                except Exception as e:
                    res["errors"].append(f"{s.name}: shutdown failed: {type(e).__name__}: {e}")
                except BaseException as e:  # Ctrl-C inside one close: the others close too
                    interrupted = interrupted or e
            if sessions:
                progress(f"{model}: {len(sessions)} clients shut down")
            if interrupted is not None:
                raise interrupted
    if "streaming" in want:
        other = [m for m in models if m not in opts.stream_models]
        if other:
            res["skipped"].append(
                f"streaming not run for model(s) {', '.join(other)} (streaming models: "
                f"{', '.join(opts.stream_models)}; change with --stream-models)"
            )
    if "idle" in want and any(s.is_inproc for s in specs):
        res["skipped"].append(
            "idle CPU not measured for inproc: no engine process, and its get_output "
            "never blocks"
        )
    return res
