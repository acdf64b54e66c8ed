"""A client leaves no file descriptor behind (the leak fixture checks processes, threads,
segments and files, not pipes, sockets, pidfds or eventfds): every client kind, started,
used and shut down a second time in one process, ends with the descriptors it began
with, without a garbage collection: shutdown() closes them. (The arenas' segments,
opened when a tensor crosses, are memfds: the fixture's.) The first round opens what the
process keeps for good (the spin gate's /proc/loadavg), so the picture is taken after
it."""

from __future__ import annotations

import gc
import os

import pytest

from shmclient.config import EngineConfig

from .drivers import KINDS, Driver, build, req

CONFIG = EngineConfig(model="mock", max_model_len=256, hidden_size=32)
#: The data-parallel clients too (two engines, the coordinator's state).
DP_KINDS = ("dp-sync-shm", "dp-async-shm", "dp-async-zmq")


def _descriptors() -> dict[int, str]:
    """This process's open descriptors: number -> what it is."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # (the listing's own descriptor, closed since)
            pass
    return out


def _build(kind: str):
    if kind.startswith("dp-"):
        kind = kind[3:]
        return kind, build(kind, CONFIG.replace(data_parallel_size=2))
    return kind, build(kind, CONFIG)


async def _round(kind: str, n: int) -> None:
    kind, client = _build(kind)
    d = Driver(kind, client)
    try:
        rid = f"fd-{n}"
        await d.add(req(rid, max_tokens=3))
        got = await d.collect([rid])
        assert len(got[rid]["tokens"]) == 3
        assert await d.call_utility("echo", n) == n
    finally:
        if d.is_async:
            await client.shutdown_async()
        else:
            client.shutdown()


@pytest.mark.parametrize("kind", (*KINDS, *DP_KINDS))
async def test_a_client_started_used_and_shut_down_leaves_no_descriptor(kind):
    await _round(kind, 0)  # what the process keeps for good
    gc.collect()  # (the first round's garbage: the picture holds still)
    before = _descriptors()
    await _round(kind, 1)
    after = _descriptors()
    left = {fd: what for fd, what in after.items() if before.get(fd) != what}
    assert not left, f"{kind}: descriptors a client left open: {sorted(left.items())}"
