"""The output hop of a served vLLM, stock against the plug-in, in one run:
``python -m shmclient_bench.vllm_served_hop [--api-servers 2] [--dp 1] [--pairs 2]
[--rounds 4] [--json FILE]``.

``vllm serve`` (``shmclient_bench.vllm_cli``'s command line, started through this module)
with the serving benchmark's tiny dummy Llama and tokenizer (``serving.build_model``) and
``--api-server-count`` API servers (``--dp`` engine cores), stock (``SHMCLIENT_VLLM``
unset) and with the plug-in, one server at a time, in pairs whose order alternates.
Against each: a warm-up, then ``rounds`` rounds of one streamed completion alone and of
``STREAMS`` at once (``TOKENS`` tokens each, temperature 0, no early end), over HTTP.

The hop is the ``vllm`` benchmark's: in each API server, ``time.monotonic()`` when
vLLM's output task has a batch back from ``get_output_async`` minus the batch's
``EngineCoreOutputs.timestamp`` (stamped in the engine core with ``time.monotonic()``,
a clock all processes of a host share), for batches with outputs. It covers encode,
transport, decode and vLLM's hand-offs on both sides, not the HTTP response. Printed per
transport and load (one stream, several): the p50, p90 and p99 over every batch of the
server's rounds, and per pair the ratio plug-in / stock of the p50s; their median is the
verdict's figure. Beside the hop, per batch, the run-queue wait: how long the API
server's event-loop thread was runnable but had no CPU while ``get_output_async`` waited
for that batch (the kernel's ``/proc/thread-self/schedstat``; none where the kernel does
not keep it). A hop made mostly of it is set by the host's CPUs, not by the transport.
It is taken over the whole call, so it can exceed the hop where the thread was runnable
before the stamp too (woken early, or busy).

The hook is installed in every API server when this module is imported with ``HOP_ENV``
naming a folder: vLLM spawns its API servers, which import the main module (this one)
again there. Each process appends its records (the hop in seconds, the batch's outputs,
the run-queue wait: ``RECORD``) to a file of its own in that folder; the run's private
temporary folder (vLLM's ipc sockets go there too), removed at the end.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import glob
import http.client
import json
import os
import statistics
import struct
import sys
import time
from typing import Any

from .cpu_time import run_queue_ns
from .stats import quantile

__all__ = ["HOP_ENV", "RECORD", "format_table", "main", "pair_ratios", "read_records", "summarise"]

#: The folder the API servers of a measured server write their records to.
HOP_ENV = "SHMCLIENT_BENCH_SERVED_HOP"
#: One record per batch: the hop (s), the batch's outputs, the run-queue wait (ns; -1 where
#: the kernel does not keep it).
RECORD = struct.Struct("<dIq")
#: Streams of the "several" load, tokens a stream, warm-up streams.
STREAMS, TOKENS, WARMUP = 8, 64, 8
TRANSPORTS = ("stock", "plugin")
#: The first argument of the server's command line (``serving_servers.LAUNCHERS``).
SERVE_ARG = "--serve"
CLIENT_TIMEOUT_S = 120.0


def _install_hooks(folder: str) -> None:
    """In an API server: wrap each ``AsyncLLM``'s engine-core client so that a batch
    returned by ``get_output_async`` with outputs appends its record."""
    from vllm.v1.engine.async_llm import AsyncLLM

    init = AsyncLLM.__init__

    def traced_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        fd = os.open(os.path.join(folder, f"hops-{os.getpid()}.bin"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        get = self.engine_core.get_output_async
        stats: dict[int, int] = {}  # thread id -> its schedstat file (-1: none)

        async def get_output_async():
            waited = run_queue_ns(stats)
            out = await get()
            now = time.monotonic()
            if out.outputs:
                if waited >= 0:
                    waited = max(-1, run_queue_ns(stats) - waited)
                os.write(fd, RECORD.pack(now - out.timestamp, len(out.outputs), waited))
            return out

        self.engine_core.get_output_async = get_output_async

    AsyncLLM.__init__ = traced_init


if os.environ.get(HOP_ENV):  # the server's processes (with one API server: the launcher)
    _install_hooks(os.environ[HOP_ENV])


def read_records(folder: str, offsets: dict[str, int] | None = None
                 ) -> tuple[list[tuple[float, float | None]], dict[str, int]]:
    """The (hop, run-queue wait) pairs (s; the wait None where unknown) recorded in
    ``folder`` after ``offsets`` (file -> bytes already read), and the files' sizes now. A
    partial record at a file's end (a write under way) is left for the next read."""
    offsets = offsets or {}
    hops: list[tuple[float, float | None]] = []
    sizes: dict[str, int] = {}
    for path in sorted(glob.glob(os.path.join(folder, "hops-*.bin"))):
        with open(path, "rb") as f:
            f.seek(offsets.get(path, 0))
            data = f.read()
        whole = len(data) - len(data) % RECORD.size
        hops += [(h, w / 1e9 if w >= 0 else None) for h, _, w in RECORD.iter_unpack(data[:whole])]
        sizes[path] = offsets.get(path, 0) + whole
    return hops, sizes


def _pct(values: list[float], q: float) -> float:
    return quantile(values, q)


def summarise(records: list[tuple[float, float | None]]) -> dict[str, Any]:
    """Batches, p50 / p90 / p99 of the hop in µs, and p50 / p90 of the run-queue wait in
    µs (``wait_p50``, ``wait_p90``; None unless every batch has it)."""
    if not records:
        return {"batches": 0, "p50": None, "p90": None, "p99": None, "wait_p50": None, "wait_p90": None}
    us = [h * 1e6 for h, _ in records]
    waits = [w * 1e6 for _, w in records if w is not None]
    known = len(waits) == len(records)
    return {"batches": len(us), "p50": _pct(us, 0.5), "p90": _pct(us, 0.9), "p99": _pct(us, 0.99),
            "wait_p50": _pct(waits, 0.5) if known else None, "wait_p90": _pct(waits, 0.9) if known else None}


def pair_ratios(pairs: list[dict[str, dict[str, dict[str, Any]]]], load: str) -> list[float]:
    """Per pair (transport -> load -> summary): plug-in p50 / stock p50 for ``load``."""
    out = []
    for pair in pairs:
        stock, plugin = pair["stock"][load]["p50"], pair["plugin"][load]["p50"]
        if stock and plugin:
            out.append(plugin / stock)
    return out


def format_table(pairs: list[dict[str, dict[str, dict[str, Any]]]]) -> str:
    """One row per pair, transport and load: batches, the hop's p50 / p90 / p99 and the
    run-queue wait's p50 / p90 (µs); then the ratios plug-in / stock of the hop p50s and
    their median per load."""
    lines = ["| pair | transport | load | batches | hop p50 / p90 / p99 µs | run-queue wait p50 / p90 µs |",
             "|---|---|---|---|---|---|"]
    for i, pair in enumerate(pairs, 1):
        for transport in TRANSPORTS:
            for load, s in pair[transport].items():
                figures = "-" if s["p50"] is None else f"{s['p50']:.0f} / {s['p90']:.0f} / {s['p99']:.0f}"
                wait = "-" if s.get("wait_p50") is None else f"{s['wait_p50']:.0f} / {s['wait_p90']:.0f}"
                lines.append(f"| {i} | {transport} | {load} | {s['batches']} | {figures} | {wait} |")
    loads = list(pairs[0]["stock"]) if pairs else []
    ratios = [(load, sorted(pair_ratios(pairs, load))) for load in loads]
    lines += [""] if any(r for _, r in ratios) else []
    for load, r in ratios:
        if r:
            lines.append(f"plug-in / stock, hop p50, {load}: median {statistics.median(r):.2f}x over {len(r)} "
                         f"pair{'s' if len(r) > 1 else ''} ({', '.join(f'{x:.2f}' for x in r)})")
    return "\n".join(lines)


def _stream(port: int, model: str, prompt: str) -> str | None:
    """One streamed completion; its last finish reason ("length" once all ``TOKENS``
    came; vLLM merges tokens into one chunk when its API server falls behind, so the
    chunks are not counted). Raises on an HTTP error or an error event."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=CLIENT_TIMEOUT_S)
    finish = None
    try:
        conn.request("POST", "/v1/completions", json.dumps(
            {"model": model, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True,
             "stream": True}), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
        for line in resp:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            msg = json.loads(line[6:])
            if "error" in msg:
                raise RuntimeError(f"error event: {msg['error']}")
            finish = msg["choices"][0].get("finish_reason") or finish
        return finish
    finally:
        conn.close()


def _measure(port: int, model: str, folder: str, rounds: int) -> dict[str, dict[str, Any]]:
    """Warm-up, then ``rounds`` rounds of one stream and of ``STREAMS`` at once: the
    hop's summary per load, over the batches recorded during that load's streams."""
    hops: dict[str, list[tuple[float, float | None]]] = {"1 stream": [], f"{STREAMS} streams": []}
    with concurrent.futures.ThreadPoolExecutor(STREAMS) as ex:
        list(ex.map(lambda i: _stream(port, model, f"def warm{i}(x):"), range(WARMUP)))
        _, sizes = read_records(folder)
        for r in range(rounds):
            for load, n in (("1 stream", 1), (f"{STREAMS} streams", STREAMS)):
                got = list(ex.map(lambda i: _stream(port, model, f"def f{r}_{i}(x):"), range(n)))
                if [f for f in got if f != "length"]:
                    raise RuntimeError(f"streams ended with finish reasons {got}, not all 'length'")
                new, sizes = read_records(folder, sizes)
                hops[load] += new
    return {load: summarise(h) for load, h in hops.items()}


def _server(model: str, transport: str, tmp: str, flags: list[str], lines: list[str], rounds: int,
            name: str) -> dict[str, dict[str, Any]]:
    """Start a server, measure it (``_measure``), stop it; its records in the folder
    ``name`` and its log in ``name``.log under ``tmp``."""
    from . import serving

    folder = os.path.join(tmp, name)
    log = folder + ".log"
    os.mkdir(folder)
    os.environ[HOP_ENV] = folder
    try:
        proc, port = serving.start_server(model, transport, tmp, log, flags, lines, launcher="serve_hop")
    finally:
        os.environ.pop(HOP_ENV, None)
    try:
        return _measure(port, model, folder, rounds)
    finally:
        serving._stop(proc)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shmclient_bench.vllm_served_hop",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--api-servers", type=int, default=2, help="API servers (2)")
    ap.add_argument("--dp", type=int, default=1, help="engine cores, data parallel (1)")
    ap.add_argument("--pairs", type=int, default=2, help="pairs of servers, stock and plug-in (2)")
    ap.add_argument("--rounds", type=int, default=4, help="rounds against each server (4)")
    ap.add_argument("--json", metavar="FILE", help="also write the figures to FILE")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [SERVE_ARG]:  # the server itself: vLLM's command line after the flag
        from .vllm_cli import main as cli_main

        sys.argv = [sys.argv[0], *argv[1:]]
        cli_main()
        return 0
    args = ap.parse_args(argv)
    if min(args.api_servers, args.dp, args.pairs, args.rounds) < 1:
        ap.error("--api-servers, --dp, --pairs and --rounds take 1 or more")
    from . import serving
    from .sections import private_tmpdir

    flags, lines = serving.api_server_flags(args.dp, args.api_servers)
    if "--api-server-count" not in flags:  # one API server, run by vllm serve all the same
        flags = ["--api-server-count", "1", *flags]
    pairs: list[dict[str, dict[str, dict[str, Any]]]] = []
    with private_tmpdir(prefix="shmc-served-hop-") as tmp:
        model = os.path.join(tmp, "model")
        os.mkdir(model)
        serving.build_model(model)
        for i in range(args.pairs):
            order = TRANSPORTS if i % 2 == 0 else TRANSPORTS[::-1]
            pair = {}
            for transport in order:
                pair[transport] = _server(model, transport, tmp, flags, lines, args.rounds, f"{transport}-{i + 1}")
                print(f"vllm_served_hop: pair {i + 1}, {transport} done", file=sys.stderr, flush=True)
            pairs.append(pair)
        import vllm  # here: its import may leave files in the temporary folder

    print(f"vLLM {vllm.__version__}, vllm serve with {args.api_servers} API server(s) and {args.dp} engine "
          f"core(s); {args.rounds} rounds of 1 and {STREAMS} streams of {TOKENS} tokens a server; "
          "hop: get_output_async's return in the API server after the engine's stamp; run-queue wait: "
          "the API server's loop thread runnable without a CPU meanwhile")
    print(format_table(pairs))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"api_servers": args.api_servers, "dp": args.dp, "pairs": pairs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
