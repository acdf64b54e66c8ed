"""One configuration's client for its model's phase: ``Session``, and its pooled figures.

A ``Session`` starts its client (and, for an async one, its loop thread), counts the
threads the client started as its own, and runs latency blocks and streaming runs,
keeping every sample; ``latency_result`` and ``streaming_result`` pool them into the
entries of results.json. Built on ``client_drivers`` and ``cpu_time``; it never judges
load nor decides the order of a run (``shmclient_bench.clients`` does).
"""

from __future__ import annotations

import gc
import time
from typing import Any

from shmclient import EngineCoreRequest, make_client

from .client_configs import ConfigSpec
from .client_drivers import (LoopThread, StreamRun, _latency_async, _latency_sync, _request, _stream_async,
                             _stream_sync)
from .cpu_time import thread_ids, torch_threads
from .stats import summarize


# -- a session: one client, created, measured, shut down -------------------------------


class Session:
    """One configuration's client for the duration of its model's phase."""

    def __init__(self, spec: ConfigSpec, base_config: Any = None) -> None:
        self.spec = spec
        self.name = spec.name
        self.loop: LoopThread | None = None
        self.client: Any = None
        self._ids = 0
        self.latency_ns: list[int] = []
        self.latency_rounds: list[dict[str, Any]] = []
        self.stream_runs: dict[int, list[StreamRun]] = {}
        self.error: str | None = None
        cfg = spec.engine_config(base_config)
        #: torch threads of the engine's compute: an engine process on cpu sets
        #: cfg.cpu_threads (shmclient.serve), so the in-process engine runs under the same.
        self.cpu_threads: int | None = None if cfg.is_cuda else cfg.cpu_threads
        #: What torch reported inside this client's blocks (inproc), else the setting.
        self.torch_threads: int | None = self.cpu_threads
        self._threads = self.cpu_threads if spec.is_inproc else None
        self.load_blocks: list[dict[str, Any]] = []
        if spec.is_async:
            self.loop = LoopThread(f"bench-loop-{spec.name}")
        before = thread_ids()
        t0 = time.perf_counter()
        try:
            with torch_threads(self._threads):
                if spec.is_inproc:
                    self.client = make_client(False, False, cfg)
                else:
                    self.client = make_client(True, spec.is_async, cfg)
                # First use (binds the async client's loop) inside the thread accounting.
                self.call_echo()
        except BaseException:
            self.close()
            raise
        self.start_s = time.perf_counter() - t0
        # Threads this client started (monitor, ZMQ I/O, ...): its share of this process.
        self.own_tids = thread_ids() - before
        self.engine_pid: int | None = getattr(self.client, "engine_pid", None)

    # -- helpers -----------------------------------------------------------------------
    def call_echo(self) -> Any:
        if self.loop is not None:
            return self.loop.call(self.client.echo_async("bench"), 60)
        return self.client.echo("bench")

    def _requests(self, n: int, max_tokens: int, tag: str) -> list[EngineCoreRequest]:
        start = self._ids
        self._ids += n
        return [_request(f"{tag}-{i}", max_tokens) for i in range(start, start + n)]

    def _latency(self, reqs: list[EngineCoreRequest]) -> list[int]:
        if self.loop is not None:
            return self.loop.call(_latency_async(self.client, reqs))
        return _latency_sync(self.client, reqs, self.spec.is_inproc)

    def _stream(self, reqs: list[EngineCoreRequest]) -> StreamRun:
        if self.loop is not None:
            return self.loop.call(_stream_async(self.client, reqs))
        return _stream_sync(self.client, reqs, self.spec.is_inproc)

    # -- sections ----------------------------------------------------------------------
    def latency_block(self, n: int, warmup: int, load: dict[str, Any] | None = None) -> list[int]:
        """``warmup`` round trips (discarded), then ``n`` measured ones. ``load``: a dict
        the caller fills in after the block (the load monitor's record), kept with the
        block's summary."""
        with torch_threads(self._threads) as seen:
            if seen is not None:
                self.torch_threads = seen
            if warmup:
                self._latency(self._requests(warmup, 1, "w"))
            reqs = self._requests(n, 1, "l")
            gc.collect()
            samples = self._latency(reqs)
        self.latency_ns.extend(samples)
        summary = summarize(samples)
        if load is not None:
            summary["load"] = load
        self.latency_rounds.append(summary)
        return samples

    def streaming_run(self, n: int, tokens: int) -> StreamRun:
        """One warm-up run (n requests x 2 tokens), then n concurrent requests x tokens."""
        with torch_threads(self._threads):
            self._stream(self._requests(n, 2, "sw"))
            reqs = self._requests(n, tokens, f"s{n}")
            gc.collect()
            run = self._stream(reqs)
        self.stream_runs.setdefault(n, []).append(run)
        return run

    def close(self) -> None:
        client, self.client = self.client, None
        try:
            if client is not None:
                if self.loop is not None and not self.loop.loop.is_closed():

                    async def _shutdown() -> None:
                        client.shutdown()

                    try:
                        self.loop.call(_shutdown(), 30)
                    except Exception:
                        client.shutdown()
                else:
                    client.shutdown()
        finally:
            if self.loop is not None:
                self.loop.close()


# -- pooled results --------------------------------------------------------------------


def _noisy_count(flags: list[bool | None]) -> dict[str, int]:
    """How many blocks were noisy, of how many, and of how many judged (None: the
    counters were unavailable or the block too short to judge alone)."""
    return {"noisy_blocks": sum(1 for f in flags if f), "blocks": len(flags),
            "judged": sum(1 for f in flags if f is not None)}


def latency_result(s: Session) -> dict[str, Any]:
    return {
        "config": s.name,
        "kind": s.spec.kind,
        "model": s.spec.model,
        "summary": summarize(s.latency_ns),
        "rounds": s.latency_rounds,
        "client_start_s": s.start_s,
        "torch_threads": s.torch_threads,
        **_noisy_count([r.get("load", {}).get("noisy") for r in s.latency_rounds]),
    }


def streaming_result(s: Session, tokens: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for n, runs in sorted(s.stream_runs.items()):
        wall = sum(r.wall_ns for r in runs)
        cpu = sum(r.cpu_ns for r in runs)
        batches = sum(r.batches for r in runs)
        rates = sorted(r.outputs / (r.wall_ns * 1e-9) for r in runs if r.wall_ns)
        gaps = [g for r in runs for g in r.gaps_ns]
        med = rates[len(rates) // 2] if len(rates) % 2 else sum(rates[len(rates) // 2 - 1 : len(rates) // 2 + 1]) / 2
        out[str(n)] = {
            "requests": n,
            "tokens_per_request": tokens,
            "runs": len(runs),
            "outputs_per_s": med,
            "outputs_per_s_runs": rates,
            "tokens_per_s": sum(r.tokens for r in runs) / (wall * 1e-9) if wall else None,
            "batches": batches // max(1, len(runs)),
            "outputs": sum(r.outputs for r in runs) // max(1, len(runs)),
            "wall_us_per_batch": wall * 1e-3 / batches if batches else None,
            "client_cpu_us_per_batch": cpu * 1e-3 / batches if batches else None,
            "client_cpu_includes_engine": s.spec.is_inproc,
            "gap_us": summarize(gaps),
            **_noisy_count([r.noisy for r in runs]),
        }
    return out
