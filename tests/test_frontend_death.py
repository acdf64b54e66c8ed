"""The engine process exits within 0.5 s of its frontend's SIGKILL and leaves nothing behind.

A frontend (a child process running a SyncMPClient) is SIGKILLed; the engine, its child,
notices the new parent pid within one wait slice (0.1 s), closes its channel and leaves
with ``os._exit`` (``shmclient.serve.exit_now``). The time is taken from the kill to
the engine's exit, seen on a pidfd (readable once the process has exited, whoever reaps
it).
"""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: The bound issue 13 sets. Measured on a 2-core host (load 1-3): 0.12-0.18 s, idle or
#: busy (at most one 0.1 s slice to notice, ~35 ms to close and exit); 0.40-0.65 s before
#: the engine skipped the interpreter's teardown (~0.35 s of CPU with torch loaded, so
#: the old code failed this test about half the time on a quiet host, always on a busy
#: one). The ~0.3 s left over are the margin for a loaded machine: what remains after
#: the kill is one wake-up and a few ms of work, not CPU-bound teardown.
EXIT_BOUND_S = 0.5

FRONTEND = textwrap.dedent(
    """
    import sys
    from shmclient import EngineConfig, EngineCoreRequest, SamplingParams, SyncMPClient
    transport, busy = sys.argv[1], sys.argv[2] == "busy"
    c = SyncMPClient(EngineConfig(model="mock", transport=transport, max_model_len=100000,
                                  step_delay_s=0.001 if busy else 0.0))
    if busy:
        # A request that runs for minutes, whose outputs nobody reads: the engine steps,
        # fills the output ring and keeps trying to send.
        c.add_request(EngineCoreRequest(
            request_id="long", prompt_token_ids=[1, 2, 3],
            sampling_params=SamplingParams(max_tokens=90000, ignore_eos=True)))
        c.get_output(timeout=30)
    print(c.engine_pid, flush=True)
    sys.stdin.read()  # until killed
    """
)


def _entries() -> set[str]:
    """/dev/shm's entries and the temporary folder's: shmclient makes its ``shmc-ipc-*``
    folders in ``tempfile.gettempdir()`` (the session's private folder under pytest, not /tmp)."""
    tmp = tempfile.gettempdir()
    return {f"/dev/shm/{n}" for n in os.listdir("/dev/shm")} | {
        os.path.join(tmp, n) for n in os.listdir(tmp)}


def _names_pid(name: str, pids) -> bool:
    """Whether ``name`` carries one of ``pids`` as a whole number."""
    return any(re.search(rf"(?<![0-9]){pid}(?![0-9])", name) for pid in pids)


def test_only_names_carrying_our_pids_count_as_left_behind():
    assert _names_pid("/dev/shm/shmc-4242-ab12-req", (4242, 7))
    assert _names_pid("/tmp/shmc-ipc-7-x1y2", (4242, 7))
    assert not _names_pid("/tmp/pytest-shmclient-omnizfaz", (4242, 7))  # another run's
    assert not _names_pid("/dev/shm/shmc-14242-ab12-req", (4242, 7))


@pytest.mark.parametrize("transport,state", [("shm", "idle"), ("zmq", "idle"), ("shm", "busy")])
def test_engine_exits_within_half_a_second_of_a_frontend_sigkill(transport, state):
    before = _entries()
    fe = subprocess.Popen([sys.executable, "-c", FRONTEND, transport, state], cwd=ROOT,
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    pidfd = engine_pid = None
    try:
        ready, _, _ = select.select([fe.stdout], [], [], 120)
        assert ready, "the frontend never reported its engine"
        engine_pid = int(fe.stdout.readline())
        pidfd = os.pidfd_open(engine_pid)
        t0 = time.monotonic()
        os.kill(fe.pid, signal.SIGKILL)
        gone, _, _ = select.select([pidfd], [], [], 10)
        elapsed = time.monotonic() - t0
        assert gone, f"engine {engine_pid} still running 10 s after its frontend's SIGKILL"
        assert elapsed < EXIT_BOUND_S, f"engine exit took {elapsed:.3f} s after the SIGKILL"
        fe.wait(10)
        # Nothing new: the channel's segments are unnamed (memfd) or unlinked once both
        # ends attached, the control socket is an abstract one. Other processes on the
        # host (other test runs too) may add entries of their own meanwhile: only names
        # carrying one of our two pids count (shmclient's names carry their creator's).
        left = {n for n in _entries() - before if _names_pid(n, (fe.pid, engine_pid))}
        assert left == set(), left
    finally:
        if pidfd is not None:
            if not select.select([pidfd], [], [], 0)[0]:
                os.kill(engine_pid, signal.SIGKILL)  # only after a failure above
            os.close(pidfd)
        if fe.poll() is None:
            fe.kill()
            fe.wait(10)
        fe.stdin.close()
        fe.stdout.close()


def test_exit_now_runs_atexit_handlers_flushes_and_keeps_the_status():
    # What the prompt exit must still do: the atexit handlers (a user's utility module
    # may register one) and buffered output, then the status.
    code = textwrap.dedent(
        """
        import atexit, sys
        from shmclient.serve import exit_now
        atexit.register(lambda: sys.stdout.write("handler ran\\n"))
        sys.stdout.write("buffered, no newline flush")
        sys.stderr.write("to stderr")
        exit_now(7)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 7, out.stderr
    assert out.stdout == "buffered, no newline flushhandler ran\n" and out.stderr == "to stderr"
