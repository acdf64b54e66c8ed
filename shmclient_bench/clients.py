"""Client benchmarks: round-trip latency, streaming throughput and idle CPU.

Every configuration (``inproc``, ``sync-shm``, ``sync-zmq``, ``async-shm``, ``async-zmq``;
``@tiny`` appended for the tiny model) gets the same engine config (only ``transport``
differs) and the same requests. The clients of one model are started one after another,
then measured in rounds: each round visits every configuration once (the order rotated
by one per round) and runs a warm-up followed by one block of each section; blocks are
pooled per configuration. Each async client runs in its own event loop thread, so its
loop is bound once and its thread is its own for the idle measurement. Every client is
shut down at the end of its model's phase (also on errors).

Durations come from ``time.perf_counter_ns``; CPU from ``psutil`` and, where the kernel
provides it, ``/proc/.../schedstat`` (nanosecond run time: psutil's per-thread times move
in 10 ms ticks, too coarse for a 2 % target over a few seconds).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import psutil

from shmclient import EngineCoreRequest, SamplingParams, make_client

from .load import NullMonitor
from .stats import summarize

#: Client kinds, in the order they are reported.
KINDS = ("inproc", "sync-shm", "sync-zmq", "async-shm", "async-zmq")
#: Models a configuration can use; 'tiny-cuda' is the tiny model on the GPU.
MODELS = ("mock", "tiny", "tiny-cuda")
#: Sections this module measures.
SECTIONS = ("latency", "streaming", "idle")

#: The prompt of every benchmark request (valid for the default vocabulary).
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
#: Longest wait for one output before a configuration is declared stuck.
GET_TIMEOUT_S = 30.0
#: Longest a whole block may take (guards the async loop thread).
BLOCK_TIMEOUT_S = 600.0

Progress = Callable[[str], None]


def _quiet(msg: str) -> None:
    pass


# -- configurations -------------------------------------------------------------------


@dataclass(frozen=True)
class ConfigSpec:
    kind: str
    model: str = "mock"

    @property
    def name(self) -> str:
        return self.kind if self.model == "mock" else f"{self.kind}@{self.model}"

    @property
    def is_async(self) -> bool:
        return self.kind.startswith("async")

    @property
    def is_inproc(self) -> bool:
        return self.kind == "inproc"

    def engine_config(self, base: Any = None) -> Any:
        """The engine config of this configuration: ``base`` (default EngineConfig())
        with the model, device and transport of this configuration."""
        from shmclient.config import EngineConfig

        base = base if base is not None else EngineConfig()
        changes: dict[str, Any] = {"model": "tiny" if self.model.startswith("tiny") else "mock"}
        changes["device"] = "cuda" if self.model.endswith("cuda") else base.device
        if not self.is_inproc:
            changes["transport"] = self.kind.split("-")[1]
        return base.replace(**changes)


def parse_configs(configs: str | Sequence[str] | None, models: str | Sequence[str]) -> list[ConfigSpec]:
    """Configurations from ``--configs`` and ``--models``.

    ``configs``: comma-separated kinds ('sync-shm'), each run for every model in
    ``models``, or explicit 'kind@model' entries (run for that model only). None or
    'all' means every kind. Raises ValueError naming an unknown entry.
    """
    if isinstance(models, str):
        models = [m.strip() for m in models.split(",") if m.strip()]
    for m in models:
        if m not in MODELS:
            raise ValueError(f"unknown model {m!r}; expected one of {', '.join(MODELS)}")
    if configs is None or configs == "all":
        entries = list(KINDS)
    elif isinstance(configs, str):
        entries = [c.strip() for c in configs.split(",") if c.strip()]
    else:
        entries = list(configs)
    specs: list[ConfigSpec] = []
    for e in entries:
        kind, _, model = e.partition("@")
        if kind not in KINDS:
            raise ValueError(f"unknown configuration {e!r}; expected one of {', '.join(KINDS)}")
        if model:
            if model not in MODELS:
                raise ValueError(f"unknown model in {e!r}; expected one of {', '.join(MODELS)}")
            targets = [model]
        else:
            targets = list(models)
        for m in targets:
            s = ConfigSpec(kind, m)
            if s not in specs:
                specs.append(s)
    # Report order: by model as given, then by kind order.
    model_order = {m: i for i, m in enumerate(dict.fromkeys([*models, *MODELS]))}
    specs.sort(key=lambda s: (model_order[s.model], KINDS.index(s.kind)))
    return specs


@dataclass
class Options:
    """What to measure and how much (see ``shmclient_bench.__main__`` for the defaults)."""

    sections: tuple[str, ...] = SECTIONS
    samples: int = 1000
    #: Latency samples for the tiny model's configurations (None: same as ``samples``);
    #: a tiny round trip costs ~1 ms, fifty times a mock one.
    tiny_samples: int | None = None
    rounds: int = 2
    warmup: int = 100
    streams: tuple[int, ...] = (1, 16)
    tokens: int = 64
    stream_models: tuple[str, ...] = ("mock",)
    idle_settle_s: float = 2.0
    idle_window_s: float = 2.0
    base_config: Any = None


# -- torch threads ---------------------------------------------------------------------


@contextlib.contextmanager
def torch_threads(n: int | None) -> Any:
    """Run the body with ``torch.set_num_threads(n)`` (None: leave torch alone), then put
    back the number there was; yields what torch reports inside."""
    if n is None:
        yield None
        return
    import torch

    old = torch.get_num_threads()
    if old != n:
        torch.set_num_threads(n)
    try:
        yield torch.get_num_threads()
    finally:
        if torch.get_num_threads() != old:
            torch.set_num_threads(old)


# -- CPU accounting -------------------------------------------------------------------


def _schedstat_ns(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def thread_ids() -> set[int]:
    """Native ids of this process's threads (Python and native, e.g. ZMQ I/O threads)."""
    return {t.id for t in psutil.Process().threads()}


def thread_cpu(tids: set[int]) -> dict[int, dict[str, int | None]]:
    """CPU used so far by each of this process's threads in ``tids``:
    {tid: {'psutil_ns', 'sched_ns'}} (sched_ns None where schedstat is unavailable)."""
    out: dict[int, dict[str, int | None]] = {}
    for t in psutil.Process().threads():
        if t.id in tids:
            out[t.id] = {
                "psutil_ns": int(round((t.user_time + t.system_time) * 1e9)),
                "sched_ns": _schedstat_ns(f"/proc/self/task/{t.id}/schedstat"),
            }
    return out


def process_cpu(pid: int) -> dict[str, int | None]:
    """CPU used so far by process ``pid`` (all its threads)."""
    p = psutil.Process(pid)
    ct = p.cpu_times()
    sched: int | None = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        tasks = []
    for tid in tasks:
        v = _schedstat_ns(f"/proc/{pid}/task/{tid}/schedstat")
        if v is None:
            sched = None
            break
        sched += v  # type: ignore[operator]
    if not tasks:
        sched = None
    return {"psutil_ns": int(round((ct.user + ct.system) * 1e9)), "sched_ns": sched}


def _thread_name(tid: int) -> str:
    for t in threading.enumerate():
        if t.native_id == tid:
            return t.name
    try:
        with open(f"/proc/self/task/{tid}/comm", encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return f"tid {tid}"


# -- the async side: one loop thread per async client --------------------------------


class LoopThread:
    """An event loop running in its own thread; ``call`` runs a coroutine there."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.thread.start()
        self._ready.wait()
        self.native_id = self.thread.native_id

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._ready.set)
        self.loop.run_forever()

    def submit(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Any, timeout: float = BLOCK_TIMEOUT_S) -> Any:
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except BaseException:
            fut.cancel()
            raise

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        if not self.thread.is_alive():
            self.loop.close()


# -- one request / one run -------------------------------------------------------------


def _request(rid: str, max_tokens: int) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=rid,
        prompt_token_ids=list(PROMPT),
        sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0),
    )


def _finished(outs: Any, rid: str) -> bool:
    for o in outs.outputs:
        if o.request_id == rid and o.finish_reason is not None:
            return True
    return False


class StuckError(RuntimeError):
    pass


def _latency_sync(client: Any, reqs: list[EngineCoreRequest], inproc: bool) -> list[int]:
    add = client.add_request
    get = client.get_output
    pc = time.perf_counter_ns
    out: list[int] = []
    append = out.append
    for r in reqs:
        rid = r.request_id
        steps = 0
        t0 = pc()
        add(r)
        while True:
            outs = get(GET_TIMEOUT_S)
            if _finished(outs, rid):
                break
            steps += 1
            if inproc and steps > 100_000:
                raise StuckError(f"request {rid} never finished")
        append(pc() - t0)
    return out


async def _latency_async(client: Any, reqs: list[EngineCoreRequest]) -> list[int]:
    add = client.add_request_async
    get = client.get_output_async
    pc = time.perf_counter_ns
    out: list[int] = []
    append = out.append
    for r in reqs:
        rid = r.request_id
        t0 = pc()
        await add(r)
        while True:
            outs = await get()
            if _finished(outs, rid):
                break
        append(pc() - t0)
    return out


@dataclass
class StreamRun:
    wall_ns: int = 0
    noisy: bool | None = None
    cpu_ns: int = 0
    batches: int = 0
    outputs: int = 0
    tokens: int = 0
    gaps_ns: list[int] = field(default_factory=list)


def _count(outs: Any, run: StreamRun) -> int:
    finished = 0
    tokens = 0
    for o in outs.outputs:
        tokens += len(o.new_token_ids)
        if o.finish_reason is not None:
            finished += 1
    run.batches += 1
    run.outputs += len(outs.outputs)
    run.tokens += tokens
    return finished


def _stream_sync(client: Any, reqs: list[EngineCoreRequest], inproc: bool) -> StreamRun:
    run = StreamRun()
    add = client.add_request
    get = client.get_output
    pc = time.perf_counter_ns
    cpu = time.process_time_ns
    remaining = len(reqs)
    empty = 0
    c0 = cpu()
    t0 = last = pc()
    for r in reqs:
        add(r)
    while remaining:
        outs = get(GET_TIMEOUT_S)
        if not outs.outputs:
            empty += 1
            if inproc and empty > 100_000:
                raise StuckError("streaming requests never finished")
            continue
        now = pc()
        run.gaps_ns.append(now - last)
        last = now
        remaining -= _count(outs, run)
    run.wall_ns = pc() - t0
    run.cpu_ns = cpu() - c0
    return run


async def _stream_async(client: Any, reqs: list[EngineCoreRequest]) -> StreamRun:
    run = StreamRun()
    add = client.add_request_async
    get = client.get_output_async
    pc = time.perf_counter_ns
    cpu = time.process_time_ns
    remaining = len(reqs)
    c0 = cpu()
    t0 = last = pc()
    for r in reqs:
        await add(r)
    while remaining:
        outs = await get()
        if not outs.outputs:
            continue
        now = pc()
        run.gaps_ns.append(now - last)
        last = now
        remaining -= _count(outs, run)
    run.wall_ns = pc() - t0
    run.cpu_ns = cpu() - c0
    return run


async def _park_async(client: Any, timeout: float) -> str | None:
    """Wait in get_output_async for ``timeout``; returns a note if anything arrived."""
    try:
        outs = await asyncio.wait_for(client.get_output_async(), timeout)
    except asyncio.TimeoutError:
        return None
    return f"unexpected output while idle: {outs!r:.200}"


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
    return {"noisy_blocks": sum(1 for f in flags if f), "blocks": len(flags)}


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


# -- idle CPU --------------------------------------------------------------------------


def _delta(a: dict[str, int | None], b: dict[str, int | None], key: str) -> int | None:
    if a.get(key) is None or b.get(key) is None:
        return None
    return int(b[key]) - int(a[key])  # type: ignore[arg-type]


def measure_idle(
    sessions: list[Session],
    settle_s: float,
    window_s: float,
    progress: Progress = _quiet,
    monitor: Any = None,
) -> dict[str, Any]:
    """Idle CPU of every MP client and its engine, measured together.

    All clients first stay idle ``settle_s``; then each gets a caller parked in its
    get_output (a thread per sync client, a task in its own loop per async client), and
    CPU is read over ``window_s``. A client's CPU is that of the threads it started plus
    its waiting thread; the engine's is its whole process. ``monitor`` (a
    ``shmclient_bench.load.LoadMonitor``) judges the measured window.
    """
    monitor = monitor if monitor is not None else NullMonitor()
    mp = [s for s in sessions if not s.spec.is_inproc and s.engine_pid is not None]
    if not mp:
        return {}
    progress(f"idle CPU: all clients idle {settle_s:g} s, then {window_s:g} s measured")
    time.sleep(settle_s)
    park_s = 0.2 + window_s + 0.2  # parked through the whole window, back soon after
    waiters: list[tuple[Session, Any, int]] = []
    notes: dict[str, str] = {}

    def park_sync(s: Session) -> None:
        try:
            outs = s.client.get_output(park_s)
            notes[s.name] = f"unexpected output while idle: {outs!r:.200}"
        except TimeoutError:
            pass
        except Exception as e:  # engine died, ...
            notes[s.name] = f"{type(e).__name__}: {e}"

    for s in mp:
        if s.loop is not None:
            waiters.append((s, s.loop.submit(_park_async(s.client, park_s)), s.loop.native_id))
        else:
            t = threading.Thread(target=park_sync, args=(s,), name=f"bench-idle-{s.name}")
            t.start()
            waiters.append((s, t, t.native_id))  # type: ignore[arg-type]
    time.sleep(0.2)  # past every spin budget: the waiters are parked
    me = os.getpid()
    all_tids = set().union(*(s.own_tids | {tid} for s, _, tid in waiters))
    with monitor.block("idle") as blk:
        t_a = time.perf_counter_ns()
        th_a = thread_cpu(all_tids)
        eng_a = {s.name: process_cpu(s.engine_pid) for s in mp}  # type: ignore[arg-type]
        proc_a = process_cpu(me)
        time.sleep(window_s)
        th_b = thread_cpu(all_tids)
        eng_b = {s.name: process_cpu(s.engine_pid) for s in mp}  # type: ignore[arg-type]
        proc_b = process_cpu(me)
        elapsed_ns = time.perf_counter_ns() - t_a
    names = {t: _thread_name(t) for t in all_tids}  # while the waiters still exist
    for s, w, _ in waiters:
        if isinstance(w, threading.Thread):
            w.join(park_s + 30)
        else:
            note = w.result(park_s + 30)
            if note:
                notes[s.name] = note

    out: dict[str, Any] = {}
    for s, _, wtid in waiters:
        tids = s.own_tids | {wtid}
        use_sched = all(
            th_a.get(t, {}).get("sched_ns") is not None and th_b.get(t, {}).get("sched_ns") is not None
            for t in tids
            if t in th_a and t in th_b
        ) and eng_a[s.name]["sched_ns"] is not None and eng_b[s.name]["sched_ns"] is not None
        key = "sched_ns" if use_sched else "psutil_ns"
        threads = {}
        client_ns = 0
        client_psutil_ns = 0
        for t in sorted(tids):
            if t not in th_a or t not in th_b:
                continue  # exited
            d = _delta(th_a[t], th_b[t], key) or 0
            dp = _delta(th_a[t], th_b[t], "psutil_ns") or 0
            client_ns += d
            client_psutil_ns += dp
            threads[names[t] + ("" if t != wtid else " (waiting caller)")] = d / elapsed_ns * 100
        eng_ns = _delta(eng_a[s.name], eng_b[s.name], key) or 0
        eng_psutil_ns = _delta(eng_a[s.name], eng_b[s.name], "psutil_ns") or 0
        entry: dict[str, Any] = {
            "client_pct": client_ns / elapsed_ns * 100,
            "engine_pct": eng_ns / elapsed_ns * 100,
            "client_pct_psutil": client_psutil_ns / elapsed_ns * 100,
            "engine_pct_psutil": eng_psutil_ns / elapsed_ns * 100,
            "source": "schedstat" if use_sched else "psutil",
            "window_s": elapsed_ns * 1e-9,
            "client_threads_pct": threads,
            "engine_pid": s.engine_pid,
            "noisy": blk.noisy,
            "other_cores": blk.other_cores,
        }
        if s.name in notes:
            entry["note"] = notes[s.name]
        out[s.name] = entry
    total = _delta(proc_a, proc_b, "sched_ns")
    if total is None:
        total = _delta(proc_a, proc_b, "psutil_ns")
    out_meta = {"frontend_process_pct_all_clients": (total or 0) / elapsed_ns * 100}
    return {"configs": out, "meta": out_meta}


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
                            res["skipped"].append(msg)
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
            for s in sessions:
                try:
                    s.close()
                except Exception as e:
                    res["errors"].append(f"{s.name}: shutdown failed: {type(e).__name__}: {e}")
            if sessions:
                progress(f"{model}: {len(sessions)} clients shut down")
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
