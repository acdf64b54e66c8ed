"""Crash cycles (``slow``): a frontend streams requests and tensors through a shm client
while the test SIGKILLs either it or its engine at a random moment, 50 times. Afterwards
/dev/shm and the temporary folder (``tempfile.gettempdir()``: the session's private one under
pytest, where shmclient makes its ``shmc-ipc-*`` folders) hold exactly what they held before and
no process is left."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import psutil
import pytest

FRONTEND = textwrap.dedent(
    """
    import sys, torch
    from shmclient.config import EngineConfig
    from shmclient import EngineCoreRequest, SamplingParams, make_client
    c = make_client(True, False, EngineConfig(model="mock", tensor_arena_bytes=4 << 20))
    print(c.engine_pid, flush=True)
    i = 0
    while True:
        c.echo(torch.full((1 << 18,), float(i)))            # 1 MiB: a one-off past the arena
        c.add_request(EngineCoreRequest(request_id=f"r{i}", prompt_token_ids=[1, 2, 3],
                      sampling_params=SamplingParams(max_tokens=4, temperature=0.0)))
        c.get_output(timeout=10)
        i += 1
    """
)


def _ours(names: set[str]) -> set[str]:
    """The project's entries (named ``shmc…``, semaphores ``sem.shmc…``); not another
    test session's private folder (``pytest-shmclient-…``), which a run beside this one
    makes and removes."""
    return {n for n in names if n.startswith(("shmc", "sem.shmc"))}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fifty_crash_cycles_leave_dev_shm_and_tmp_as_they_were():
    rng = random.Random(50)
    tmp = tempfile.gettempdir()
    shm_before, tmp_before = set(os.listdir("/dev/shm")), set(os.listdir(tmp))
    for cycle in range(50):
        front = subprocess.Popen([sys.executable, "-c", FRONTEND], stdout=subprocess.PIPE, text=True)
        try:
            line = front.stdout.readline()
            assert line.strip().isdigit(), f"cycle {cycle}: the frontend did not start"
            engine = psutil.Process(int(line))
            deadline = time.monotonic() + rng.uniform(0.0, 0.3)  # let it stream a while
            while time.monotonic() < deadline:
                try:
                    front.wait(0.01)
                except subprocess.TimeoutExpired:
                    pass
            victim = engine.pid if rng.random() < 0.5 else front.pid
            os.kill(victim, signal.SIGKILL)
            try:
                front.wait(15)  # an engine's death surfaces in the frontend as an error
            except subprocess.TimeoutExpired:
                front.kill()
                front.wait(5)
            gone, alive = psutil.wait_procs([engine], timeout=15)
            assert not alive, f"cycle {cycle}: the engine outlived its frontend"
        finally:
            if front.poll() is None:
                front.kill()
                front.wait(5)
            front.stdout.close()
        assert _ours(set(os.listdir("/dev/shm")) - shm_before) == set(), f"cycle {cycle}"
        assert _ours(set(os.listdir(tmp)) - tmp_before) == set(), f"cycle {cycle}"
