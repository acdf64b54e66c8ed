"""Round trip of the sync client on a busy host: shm against zmq, with one unrelated
busy-loop process running, in one run.

Run ``python -m shmclient_bench.contention [--quick]``; ``run(quick)`` returns a JSON-able dict.
Each configuration (shm, zmq) gets its own client and engine; the busy loop (a plain
``while True: pass`` process) runs for the whole measurement, and the two transports are
measured in alternating rounds so that they see the same load. Round trip =
``add_request`` of a 1-token request to its finished output, mock model. Not a test: it
asserts nothing, it reports.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

from shmclient.config import EngineConfig
from shmclient import EngineCoreRequest, SamplingParams, make_client

BUSY = "while True: pass"


def _round(client, n: int, tag: str, start: int) -> list[float]:
    lat = []
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    for i in range(n):
        req = EngineCoreRequest(request_id=f"{tag}-{start + i}", prompt_token_ids=[1, 2, 3], sampling_params=sp)
        t0 = time.perf_counter()
        client.add_request(req)
        done = False
        while not done:
            for out in client.get_output(timeout=30).outputs:
                done = done or out.finished
        lat.append((time.perf_counter() - t0) * 1e6)
    return lat


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run(quick: bool = False) -> dict:
    n, rounds, warm = (300, 3, 100) if quick else (1000, 5, 200)
    clients = {t: make_client(True, False, EngineConfig(model="mock", transport=t)) for t in ("shm", "zmq")}
    res: dict = {}
    try:
        for label, busy in (("quiet", False), ("one_busy_loop", True)):
            hog = subprocess.Popen([sys.executable, "-c", BUSY]) if busy else None
            try:
                lat = {t: [] for t in clients}
                for t, c in clients.items():
                    _round(c, warm, f"{label}-warm-{t}", 0)
                for r in range(rounds):
                    order = list(clients) if r % 2 == 0 else list(reversed(clients))
                    for t in order:
                        lat[t] += _round(clients[t], n, f"{label}-{t}", r * n)
            finally:
                if hog is not None:
                    hog.kill()
                    hog.wait()
            res[label] = {
                t: {"p50_us": statistics.median(v), "p99_us": _pct(v, 0.99), "n": len(v)} for t, v in lat.items()
            }
            res[label]["shm_faster_by_p50"] = res[label]["zmq"]["p50_us"] / res[label]["shm"]["p50_us"]
    finally:
        for c in clients.values():
            c.shutdown()
    res["machine"] = {"cpus": os.cpu_count(), "load_1m": os.getloadavg()[0]}
    return res


def report(res: dict) -> str:
    lines = ["sync client round trip, mock model, shm vs zmq (same run)", ""]
    lines.append(f"{'host':>14} | {'shm p50':>8} {'p99':>8} | {'zmq p50':>8} {'p99':>8} | shm faster by (p50)")
    for label in ("quiet", "one_busy_loop"):
        r = res[label]
        lines.append(
            f"{label:>14} | {r['shm']['p50_us']:8.1f} {r['shm']['p99_us']:8.1f} | "
            f"{r['zmq']['p50_us']:8.1f} {r['zmq']['p99_us']:8.1f} | {r['shm_faster_by_p50']:.2f}x"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from .report import section_main

    return section_main(argv, __doc__, run, report, "fewer round trips (~20 s)")

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
