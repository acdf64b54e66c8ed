"""Where the plug-in's output hop goes, per output mode and client:
``python -m shmclient_bench.vllm_hop_trace [--modes inline,adaptive] [--clients sync,async]
[--rounds N]``.

``LLM`` (vLLM's sync client) and ``AsyncLLM`` are driven as in the ``vllm`` section's
quiet part (``vllm_engines._bench_sync`` / ``_bench_async``: 4 one-stream requests and
one batch of 16 a round, 64 tokens each), with timestamps on both sides of the rings,
matched by each output batch's ``EngineCoreOutputs.timestamp`` (``time.monotonic()``: one
clock for every process of the host). In the engine core: the start and end of the write
of a batch (encode, ring, and the wake-up unless output mode ``adaptive`` holds it back)
and the moment a held-back wake-up is given; in the frontend: when it woke for the batch
(see ``_trace_mode``), when it had read it off the ring (decoded) and when ``get_output``
/ ``get_output_async`` returned it. Printed per mode and client: the median and p90 of
each moment after the engine's stamp, for batches of one output and of several.

The engine core's hooks are installed when this module is imported with ``TRACE_ENV``
naming a folder: vLLM starts its engine core by spawning a process, which imports the
main module (this one) again there; every process appends its records to a file of its
own in that folder. The folder is the run's private temporary folder (vLLM's ipc sockets
go there too), removed at the end of the run.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time
from bisect import bisect_left
from typing import Any

__all__ = ["MODES", "TRACE_ENV", "format_table", "main", "summarise"]

#: The folder the processes of a traced run write their records to.
TRACE_ENV = "SHMCLIENT_BENCH_HOP_TRACE"
#: Output mode -> the vllm section's name of that configuration.
MODES = {"inline": "shm-inline", "adaptive": "shm-adaptive", "thread": "shm-thread"}
#: The moments reported, as offsets from the engine's stamp (µs).
MOMENTS = ("write start", "write end", "wake-up given", "frontend woke", "frontend read", "get_output returned")


def _install_engine_hooks(folder: str) -> None:
    """In the engine core: a record per batch written (stamp, start, end, whether its
    wake-up went with it) and per held-back wake-up given."""
    from shmclient.vllm import engine_outputs

    cls = engine_outputs._InlineOutputs
    send, wake_owed = cls.send, cls.wake_owed
    files: list[Any] = []

    def out():
        if not files:
            files.append(open(os.path.join(folder, f"engine-{os.getpid()}.txt"), "a", buffering=1))
        return files[0]

    def traced_send(self, client_index, outputs, *, queued=False, wake=True):
        t0 = time.monotonic()
        send(self, client_index, outputs, queued=queued, wake=wake)
        if outputs.outputs:
            out().write(f"S {outputs.timestamp!r} {t0!r} {time.monotonic()!r} {int(wake)}\n")

    def traced_wake_owed(self):
        if self.owing:
            t = time.monotonic()
            wake_owed(self)
            out().write(f"W {t!r}\n")

    cls.send = traced_send
    cls.wake_owed = traced_wake_owed


if os.environ.get(TRACE_ENV):
    _install_engine_hooks(os.environ[TRACE_ENV])


def _read_engine(folder: str) -> tuple[dict[float, tuple[float, float, bool]], list[float]]:
    writes: dict[float, tuple[float, float, bool]] = {}
    wakes: list[float] = []
    for name in glob.glob(os.path.join(folder, "engine-*.txt")):
        with open(name) as f:
            for line in f:
                p = line.split()
                if p[0] == "S" and len(p) == 5:
                    writes[float(p[1])] = (float(p[2]), float(p[3]), p[4] == "1")
                elif p[0] == "W" and len(p) == 2:
                    wakes.append(float(p[1]))
    return writes, sorted(wakes)


def summarise(writes: dict[float, tuple[float, float, bool]], wakes: list[float],
              front: list[tuple[float, float, float, int]]) -> dict[str, dict[str, Any]]:
    """Per kind of batch ("1 output", "several"): how many were matched, how many had
    their wake-up held back, and p50 / p90 (µs after the stamp) of each of ``MOMENTS``.
    ``writes``: stamp -> (write start, write end, woke with the write); ``wakes``: the
    held-back wake-ups given, sorted; ``front``: (stamp, when the frontend woke or 0,
    when it had read the batch off the ring or 0, get_output return, outputs in the
    batch). A held-back wake-up is the first given after the write; a batch get_output
    returned without a wait has no "frontend woke"."""
    kinds: dict[str, list[list[float | None]]] = {"1 output": [], "several": []}
    held = {"1 output": 0, "several": 0}
    for stamp, woke, read, got, n in front:
        w = writes.get(stamp)
        if w is None:
            continue
        start, end, with_write = w
        given: float | None = end
        kind = "1 output" if n == 1 else "several"
        if not with_write:
            held[kind] += 1
            i = bisect_left(wakes, end)
            given = wakes[i] if i < len(wakes) else None
        row = [start, end, given, woke or None, read or None, got]
        kinds[kind].append([None if t is None else (t - stamp) * 1e6 for t in row])
    result: dict[str, dict[str, Any]] = {}
    for kind, rows in kinds.items():
        if not rows:
            continue
        figures = {}
        for i, moment in enumerate(MOMENTS):
            v = sorted(r[i] for r in rows if r[i] is not None)
            figures[moment] = (v[len(v) // 2], v[min(len(v) - 1, len(v) * 9 // 10)]) if v else None
        result[kind] = {"batches": len(rows), "held back": held[kind], "us": figures}
    return result


def format_table(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    """One row per (mode, kind of batch): p50 / p90 of each moment, µs after the stamp."""
    lines = ["| mode | batches | wake-up held back | " + " | ".join(MOMENTS) + " |",
             "|---" * (3 + len(MOMENTS)) + "|"]
    for mode, kinds in results.items():
        for kind, r in kinds.items():
            cells = ["-" if r["us"][m] is None else f"{r['us'][m][0]:.0f} / {r['us'][m][1]:.0f}" for m in MOMENTS]
            lines.append(f"| {mode}, {kind} | {r['batches']} | {r['held back']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _trace_mode(model: str, client_kind: str, mode: str, rounds: int, folder: str) -> dict[str, dict[str, Any]]:
    """One engine start of ``client_kind`` ("sync": ``LLM``; "async": ``AsyncLLM``) in
    output mode ``mode``, traced. The frontend's "woke" is, for sync, the return of its
    last wait on the ring before ``get_output`` returned the batch; for async, the last
    run of the ring reader's callback (the wake pipe readable, or the task reading the
    ring itself) before ``get_output_async`` did."""
    from shmclient import channel, waiting

    from . import vllm_engines

    front: list[tuple[float, float, float, float, int]] = []
    woke = [0.0]
    read = [0.0]

    def record(outputs) -> None:
        if outputs.outputs:
            front.append((outputs.timestamp, woke[0], read[0], time.monotonic(), len(outputs.outputs)))
        woke[0] = read[0] = 0.0

    if client_kind == "sync":
        from vllm import LLM as cls

        owner, name = channel.ShmChannel, "wait_recv"
    else:
        from vllm.v1.engine.async_llm import AsyncLLM as cls

        owner, name = waiting.LoopReader, "read_now"
    waited = getattr(owner, name)
    init = cls.__init__
    on_readable = waiting.LoopReader.on_readable
    recv_nowait = channel.ShmChannel.recv_nowait

    def traced_recv_nowait(self, *args, **kwargs):
        got = recv_nowait(self, *args, **kwargs)  # raises WouldBlock when there is nothing
        read[0] = time.monotonic()
        return got

    def traced_wait(self, *args, **kwargs):  # sync
        try:
            return waited(self, *args, **kwargs)
        finally:
            woke[0] = time.monotonic()

    def traced_on_readable(self):  # async
        woke[0] = time.monotonic()
        return on_readable(self)

    def traced_read_now(self, *args, **kwargs):  # async
        if not woke[0]:
            woke[0] = time.monotonic()  # get_output_async read the ring itself
        return waited(self, *args, **kwargs)

    def traced_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        client = self.llm_engine.engine_core if client_kind == "sync" else self.engine_core
        if client_kind == "sync":
            get_output = client.get_output

            def traced_get_output():
                woke[0] = read[0] = 0.0
                outputs = get_output()
                record(outputs)
                return outputs

            client.get_output = traced_get_output
        else:
            get_output_async = client.get_output_async

            async def traced_get_output_async():
                outputs = await get_output_async()
                record(outputs)
                return outputs

            client.get_output_async = traced_get_output_async

    if client_kind == "sync":
        setattr(owner, name, traced_wait)
    else:
        setattr(owner, name, traced_read_now)
        waiting.LoopReader.on_readable = traced_on_readable
    cls.__init__ = traced_init
    channel.ShmChannel.recv_nowait = traced_recv_nowait
    try:
        if client_kind == "sync":
            vllm_engines._bench_sync(model, MODES[mode], rounds, 64)
        else:
            vllm_engines._bench_async(model, MODES[mode], rounds, 64)
    finally:
        setattr(owner, name, waited)
        waiting.LoopReader.on_readable = on_readable
        channel.ShmChannel.recv_nowait = recv_nowait
        cls.__init__ = init
    writes, wakes = _read_engine(folder)
    for path in glob.glob(os.path.join(folder, "engine-*.txt")):
        os.unlink(path)
    return summarise(writes, wakes, front)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shmclient_bench.vllm_hop_trace", description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="inline,adaptive", help=f"output modes, comma-separated ({', '.join(MODES)})")
    ap.add_argument("--clients", default="sync,async", help="sync (LLM), async (AsyncLLM), comma-separated")
    ap.add_argument("--rounds", type=int, default=3, help="rounds a mode (3)")
    ap.add_argument("--json", metavar="FILE", help="also write the figures to FILE")
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    clients = [c.strip() for c in args.clients.split(",") if c.strip()]
    if [m for m in modes if m not in MODES] or not modes or args.rounds < 1:
        ap.error(f"--modes takes {', '.join(MODES)} (got {args.modes!r}); --rounds at least 1")
    if [c for c in clients if c not in ("sync", "async")] or not clients:
        ap.error(f"--clients takes sync, async (got {args.clients!r})")
    from .sections import private_tmpdir
    from .vllm_engines import CONFIG

    results: dict[str, dict[str, dict[str, Any]]] = {}
    # One folder for the records, the model and vLLM's own files (its ipc sockets), removed
    # at the end whatever happens.
    with private_tmpdir(prefix="shmc-hop-trace-") as folder:
        from vllm.plugins import load_general_plugins

        os.environ["SHMCLIENT_VLLM"] = "1"  # plug-ins load once per process: load with it on
        load_general_plugins()
        os.environ[TRACE_ENV] = folder
        try:
            model = os.path.join(folder, "model")
            os.mkdir(model)
            with open(os.path.join(model, "config.json"), "w") as f:
                json.dump(CONFIG, f)
            for client_kind in clients:
                for mode in modes:
                    results[f"{mode}, {client_kind}"] = _trace_mode(model, client_kind, mode, args.rounds, folder)
                    print(f"vllm_hop_trace: {mode}, {client_kind} done", file=sys.stderr, flush=True)
        finally:
            os.environ.pop(TRACE_ENV, None)
    import vllm

    print(f"vLLM {vllm.__version__}, {args.rounds} rounds a mode and client (sync: LLM, async: AsyncLLM); "
          "µs after the engine's stamp, p50 / p90")
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
