"""An engine that fails to start is reported once, typed, with the engine's own text: the
client raises one ConfigError carrying that text (not chained to the launcher's
RuntimeError saying it again), the engine prints no traceback of its own for it, and
nothing warns of a shutdown that did not happen ("did not exit in 0.0 s: SIGTERM") or
prints a traceback of the engine interrupted in its exit."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FRONTEND = textwrap.dedent(
    """
    import asyncio, logging, sys
    logging.basicConfig()
    from shmclient import make_client
    from shmclient.config import EngineConfig
    kw = {"device": "cuda"} if sys.argv[1] == "cuda" else {
        "utility_modules": ("tests.no_such_module",)}
    config = EngineConfig(transport=sys.argv[2], **kw)
    if sys.argv[3] == "async":
        async def main():
            make_client(True, True, config)
        asyncio.run(main())
    else:
        make_client(True, False, config)
    """
)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.parametrize("failure,transport,mode,text", [
    ("cuda", "shm", "sync", "EngineConfig.device='cuda' is invalid: torch.cuda.is_available() is False"),
    ("utility", "zmq", "async", "EngineConfig.utility_modules: cannot import 'tests.no_such_module': "
                                "ModuleNotFoundError: No module named 'tests.no_such_module'"),
])
def test_a_start_up_failure_is_reported_once_with_the_engines_text(failure, transport, mode, text):
    if failure == "cuda" and _cuda():
        pytest.skip("a GPU is here: device='cuda' starts")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    r = subprocess.run([sys.executable, "-c", FRONTEND, failure, transport, mode], cwd=ROOT,
                       env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                       timeout=120)
    err = r.stderr
    assert r.returncode == 1, err
    lines = err.splitlines()
    error_line = f"shmclient.errors.ConfigError: {text}"
    assert lines[-1] == error_line, err  # the client's error: typed, the engine's text
    # Once: the client's error; the engine does not print it again with its own stack.
    assert lines.count(error_line) == 1, err
    assert err.count("Traceback (most recent call last)") == 1, err
    assert "RuntimeError" not in err and "initialization failed" not in err, err
    assert "did not exit" not in err and "SIGTERM" not in err, err
    assert "Exception ignored" not in err and "SystemExit" not in err, err


def test_an_engine_whose_start_up_was_abandoned_exits_after_the_ready_timeout():
    """A Ctrl-C inside ``Popen`` (after the fork, before the launcher kept the process)
    left an engine nothing would stop: it waited for Start for as long as its frontend
    lived. It is told the ready timeout, and exits once that has passed without Start."""
    import tempfile

    from shmclient import engine_process

    nobody = f"ipc://{tempfile.gettempdir()}/no-frontend-here"
    proc = engine_process.spawn("shmclient_engine", nobody, (), 1.0)
    try:
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
