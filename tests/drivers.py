"""One awaitable face over every client, so a behaviour test is written once.

``Driver`` wraps InprocClient, SyncMPClient or AsyncMPClient; tests ``await`` its methods.
For the sync clients the calls are made directly (a blocking get_output in the test's
event loop is fine: nothing else runs there).
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from typing import Any, Iterator

from shmclient import EngineCoreOutputs, EngineCoreRequest, SamplingParams, make_client

KINDS = ("inproc", "sync-shm", "async-shm", "sync-zmq", "async-zmq")


def build(kind: str, config: Any) -> Any:
    if kind == "inproc":
        return make_client(False, False, config)
    mode, transport = kind.split("-")
    return make_client(True, mode == "async", config.replace(transport=transport))


class Driver:
    def __init__(self, kind: str, client: Any) -> None:
        self.kind = kind
        self.client = client
        self.is_async = kind.startswith("async")
        self.is_inproc = kind == "inproc"

    async def add(self, request: EngineCoreRequest) -> None:
        if self.is_async:
            await self.client.add_request_async(request)
        else:
            self.client.add_request(request)

    async def abort(self, ids: list[str]) -> None:
        if self.is_async:
            await self.client.abort_requests_async(ids)
        else:
            self.client.abort_requests(ids)

    async def get_output(self, timeout: float = 30.0) -> EngineCoreOutputs:
        if self.is_async:
            import asyncio

            return await asyncio.wait_for(self.client.get_output_async(), timeout)
        return self.client.get_output(timeout=timeout)

    async def util(self, method: str, *args: Any) -> Any:
        if self.is_async:
            return await getattr(self.client, f"{method}_async")(*args)
        return getattr(self.client, method)(*args)

    async def call_utility(self, method: str, *args: Any) -> Any:
        if self.is_async:
            return await self.client.call_utility_async(method, *args)
        return self.client.call_utility(method, *args)

    async def collect(self, ids: list[str], timeout: float = 60.0) -> dict[str, dict]:
        """Outputs until every id finished: {id: {tokens, reason, stop_reason, outputs}}."""
        want = set(ids)
        res: dict[str, dict] = {
            i: {"tokens": [], "reason": None, "stop_reason": None, "outputs": [], "n_finished": 0}
            for i in ids
        }
        deadline = time.monotonic() + timeout
        while want:
            if time.monotonic() > deadline:
                raise TimeoutError(f"requests never finished: {sorted(want)}")
            outs = await self.get_output()
            for o in outs.outputs:
                r = res.setdefault(
                    o.request_id,
                    {"tokens": [], "reason": None, "stop_reason": None, "outputs": [], "n_finished": 0},
                )
                r["tokens"].extend(o.new_token_ids)
                r["outputs"].append(o)
                if o.finished:
                    r["reason"] = o.finish_reason
                    r["stop_reason"] = o.stop_reason
                    r["n_finished"] += 1
                    want.discard(o.request_id)
        return res


def req(rid: str, prompt: list[int] | None = None, max_tokens: int = 20, **sp: Any) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=rid,
        prompt_token_ids=prompt if prompt is not None else [5, 6, 7, 8],
        sampling_params=SamplingParams(max_tokens=max_tokens, **sp),
    )


async def add_until_one_parks(add_async: Any, make: Any) -> "tuple[Any, int]":
    """Add ``make(0)``, ``make(1)``, ... with ``add_async`` until one does not go at once
    (a stopped engine's request ring is full): that add's task, parked, and how many went
    before it."""
    import asyncio

    n = 0
    while True:
        task = asyncio.ensure_future(add_async(make(n)))
        await asyncio.sleep(0)  # one turn: the add either went or is parked
        if not task.done():
            return task, n
        task.result()
        n += 1


@contextlib.contextmanager
def ctrl_c_when(event: threading.Event, timeout: float = 10.0) -> Iterator[None]:
    """Within the block, Ctrl-C lands in the main thread (a KeyboardInterrupt from the
    SIGINT handler) once ``event`` is set, at most ``timeout`` seconds from the start;
    a SIGINT after the block raises nothing. Sets ``event`` on the way out (to end the
    watcher). Main thread only."""
    armed, main = [True], threading.main_thread().ident

    def on_sigint(*_):
        if armed[0]:
            raise KeyboardInterrupt

    def watch() -> None:
        if event.wait(timeout) and armed[0]:
            signal.pthread_kill(main, signal.SIGINT)

    old = signal.signal(signal.SIGINT, on_sigint)
    watcher = threading.Thread(target=watch, name="ctrl-c-when")
    watcher.start()
    try:
        yield
    finally:
        armed[0] = False
        event.set()
        watcher.join(timeout)
        signal.signal(signal.SIGINT, old)


class LoopTurns:
    """Counts the running event loop's turns from ``start()`` to ``stop()`` (a task that
    yields at every turn): whether a call let the loop run its other tasks."""

    def __init__(self) -> None:
        self.turns = 0
        self._task: Any = None

    def start(self) -> "LoopTurns":
        import asyncio

        self._task = asyncio.ensure_future(self._count())
        return self

    async def _count(self) -> None:
        import asyncio

        while True:
            self.turns += 1
            await asyncio.sleep(0)

    def stop(self) -> int:
        self._task.cancel()
        return self.turns
