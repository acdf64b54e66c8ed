"""Messages much larger than the ring cross it in time proportional to their size, in
both directions, on the shared-memory transport (a send that times out half-way resumes
where it stopped instead of starting again from its first fragment)."""

from __future__ import annotations

import time

import pytest

from shmclient.config import EngineConfig
from shmclient import EngineCoreRequest, SamplingParams, make_client


@pytest.mark.parametrize(
    "asyncio_mode", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["sync", "async"]
)
def test_a_192_mib_utility_reply_arrives_and_the_engine_keeps_serving(asyncio_mode):
    import asyncio

    size = 192 << 20  # the old transport livelocked from ~128 MiB up
    payload = b"\x5a" * size

    async def run_async(c):
        t0 = time.monotonic()
        got = await c.echo_async(payload)
        took = time.monotonic() - t0
        await c.add_request_async(EngineCoreRequest(
            request_id="after", prompt_token_ids=[1, 2, 3],
            sampling_params=SamplingParams(max_tokens=2, temperature=0.0)))
        done = False
        while not done:
            for out in (await c.get_output_async()).outputs:
                done = out.finished
        return got, took

    c = make_client(True, asyncio_mode, EngineConfig(model="mock"))
    try:
        if asyncio_mode:
            got, took = asyncio.run(run_async(c))
        else:
            t0 = time.monotonic()
            got = c.echo(payload)
            took = time.monotonic() - t0
            c.add_request(EngineCoreRequest(
                request_id="after", prompt_token_ids=[1, 2, 3],
                sampling_params=SamplingParams(max_tokens=2, temperature=0.0)))
            done = False
            while not done:
                for out in c.get_output(timeout=30).outputs:
                    done = out.finished
        assert len(got) == size and got == payload
        assert took < 60, f"{size >> 20} MiB took {took:.1f} s"
    finally:
        c.shutdown()
