"""``python -m shmclient_bench``: every benchmark of shmclient in one run.

Sections (``--only`` picks some): ``latency`` (round trip of one max_tokens=1 request),
``streaming`` (N concurrent requests x M tokens), ``idle`` (idle CPU of client and
engine), ``tensors`` (shmclient_bench.tensors' transfer sweep), ``ring`` (shmclient_bench.ring's raw ring
against pyzmq ipc) and ``contention`` (shmclient_bench.contention: sync and async clients over shm and
over zmq with 0 to 3 unrelated busy-loop processes, and under a 1-CPU quota), ``fairness`` (shmclient_bench.fairness:
how late a concurrent asyncio task's 1 ms sleep wakes while the async client waits, engine
idle and busy, shm and zmq), ``dp`` (shmclient_bench.dp: requests/s
with one and two data-parallel engines, and their balance under a skewed load), ``vllm`` (shmclient_bench.vllm: stock vLLM
against vLLM over the rings, tiny dummy model; skipped with a note without vLLM) and ``serving``
(shmclient_bench.serving: vLLM's OpenAI server, stock and with the plug-in, under vLLM's own
serving benchmark; skipped with a note without vLLM). Configurations (``--configs``): inproc, sync-shm, sync-zmq,
async-shm, async-zmq, each with the mock model and (latency only, by default) the tiny
model as a realism check. Progress goes to stderr; the tables to stdout; results.json,
samples.json and the PNG plots to a folder of the run's own (``--out``, which must not
exist yet, or ``results/<timestamp>-<random>/``).

Every block is judged for load from other processes (``shmclient_bench.load``): noisy blocks are
marked in the JSON and the tables, and a noisy run says so in the first line of its
report. SIGINT or SIGTERM at any point stops every engine and child process, removes
what they left in /dev/shm and the temporary folder, saves what finished and exits 130.

This module is the entry point only: it reads the arguments (``cli``) into the run's
options and hands them to ``bench_run``, or runs one section in the child
(``sections.run_child``); it measures nothing and never imports a section's module.
"""

from __future__ import annotations

import os
import sys
from typing import Sequence

from . import clients, sections, stopping
from .bench_run import _run, _write_files, new_results_dir
from .cli import (DEFAULTS, EXTERNAL, FULL_DURATION, QUICK_DURATION, SECTIONS, _base_config, _cuda, _ints,
                  _prog, build_parser)
from .progress import Progress

__all__ = ["DEFAULTS", "EXTERNAL", "FULL_DURATION", "QUICK_DURATION", "SECTIONS", "Progress", "build_parser",
           "main", "new_results_dir", "_base_config", "_write_files"]


def main(argv: Sequence[str] | None = None) -> int:
    """The benchmark's command line (``python -m shmclient_bench``, ``shmclient-bench``): returns
    the exit status (0 done, 1 a section failed, 2 bad arguments, 130 interrupted)."""
    signals = stopping.Signals()
    signals.install()
    try:
        return _main(argv, signals)
    except KeyboardInterrupt:
        # Before the run had a folder (parsing the arguments, importing).
        print(
            f"{_prog()}: interrupted ({signals.received or 'SIGINT'}) before the run began",
            file=sys.stderr,
        )
        return 130
    finally:
        signals.restore()


def _main(argv: Sequence[str] | None, signals: stopping.Signals) -> int:
    parser = build_parser()
    parser.prog = _prog()
    args = parser.parse_args(argv)
    args._argv = list(argv) if argv is not None else sys.argv[1:]
    if args.run_section:
        signals.restore()
        return sections.run_child(args.run_section, args.quick, args.section_json)
    prog = parser.prog
    d = DEFAULTS["quick" if args.quick else "full"]
    if not args.noisy_above > 0:
        print(f"{prog}: --noisy-above must be > 0, got {args.noisy_above}", file=sys.stderr)
        return 2
    models = args.models or ("mock,tiny,tiny-cuda" if _cuda() else "mock,tiny")
    try:
        if args.configs is not None:
            specs = clients.parse_configs(args.configs, models)
        else:
            names = [m.strip() for m in models.split(",") if m.strip()]
            specs = clients.parse_configs(d["configs"], [m for m in names if m == "mock"])
            tiny = [m for m in names if m != "mock"]
            if tiny:
                specs += clients.parse_configs(d["tiny_configs"], tiny)
    except ValueError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    try:
        base_config = _base_config(args.set)
    except (ValueError, Exception) as e:
        print(f"{prog}: --set: {e}", file=sys.stderr)
        return 2
    stream_models = tuple(m.strip() for m in args.stream_models.split(",") if m.strip())
    opts = clients.Options(
        sections=tuple(s for s in args.only if s in clients.SECTIONS),
        samples=args.samples if args.samples is not None else d["samples"],
        tiny_samples=(
            args.tiny_samples
            if args.tiny_samples is not None
            else args.samples if args.samples is not None else d["tiny_samples"]
        ),
        rounds=args.rounds if args.rounds is not None else d["rounds"],
        warmup=args.warmup if args.warmup is not None else d["warmup"],
        streams=args.streams or _ints(d["streams"]),
        tokens=args.tokens if args.tokens is not None else d["tokens"],
        stream_models=stream_models,
        idle_settle_s=args.idle_settle if args.idle_settle is not None else d["idle_settle"],
        idle_window_s=args.idle_window if args.idle_window is not None else d["idle_window"],
        base_config=base_config,
    )
    if opts.samples < 1 or (opts.tiny_samples or 1) < 1 or opts.rounds < 1 or opts.warmup < 0 or opts.tokens < 1:
        print(f"{prog}: --samples, --rounds, --tokens must be >= 1, --warmup >= 0", file=sys.stderr)
        return 2
    try:
        if args.out:
            out = args.out
            os.makedirs(out, exist_ok=False)
        else:
            out = new_results_dir()
    except FileExistsError:
        print(
            f"{prog}: results folder {args.out!r} already exists: every run writes a "
            "folder of its own (name another --out, or leave it out)",
            file=sys.stderr,
        )
        return 2
    except OSError as e:
        print(f"{prog}: cannot create the results folder: {e}", file=sys.stderr)
        return 2
    return _run(args, d, specs, opts, out, signals)


if __name__ == "__main__":
    sys.exit(main())
