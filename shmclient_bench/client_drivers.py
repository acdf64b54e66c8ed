"""What drives one client through one block: its requests, the round-trip and streaming
loops, sync and async, and the event loop thread an async client lives in.

``_latency_sync`` / ``_latency_async`` time each request's round trip (add_request to its
finished output, ``time.perf_counter_ns``); ``_stream_sync`` / ``_stream_async`` run N
concurrent requests and count batches, outputs, tokens and the gaps between batches
(``StreamRun``); ``LoopThread`` runs an event loop in a thread of its own, so an async
client's loop is bound once and its thread is its own. Imports shmclient's request
types only: never a client constructor, the engine or the load monitor.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from shmclient import EngineCoreRequest, SamplingParams

#: The prompt of every benchmark request (valid for the default vocabulary).
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
#: Longest wait for one output before a configuration is declared stuck.
GET_TIMEOUT_S = 30.0
#: Longest a whole block may take (guards the async loop thread).
BLOCK_TIMEOUT_S = 600.0


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
