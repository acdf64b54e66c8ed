"""The local engine process as an OS process: check that its module can run, spawn it
(``python -m <EngineConfig.engine_module>`` in a fresh interpreter, which is what CUDA
needs: no fork), describe how it ended, and stop it (wait, then SIGTERM, then SIGKILL).
Upper-middle layer, under ``launcher``: imports the standard library and ``errors``
only; never zmq, a channel, a client or an engine (the engine module is looked up,
never imported, before the launch; the engine process finds it on its own path: the
working directory, ``PYTHONPATH`` with this project's root first, the installed
packages).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from typing import NoReturn, Sequence

from .errors import ConfigError

__all__ = ["describe_exit", "find_engine_module", "spawn", "stop"]

logger = logging.getLogger("shmclient")


def find_engine_module(name: str) -> None:
    """Check that ``python -m <name>`` can run: ``name`` is found on this interpreter's
    path and, for a package, has a ``__main__``. Never imports ``name`` itself (its parent
    packages are imported, as any lookup of a dotted name does), never blocks. Raises
    ``ConfigError`` naming ``EngineConfig.engine_module`` otherwise."""
    import importlib.machinery
    import importlib.util

    def fail(why: str) -> NoReturn:
        raise ConfigError(f"EngineConfig.engine_module={name!r} is invalid: {why}")

    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError) as e:
        fail(f"cannot look it up: {type(e).__name__}: {e}")
    if spec is None:
        fail("no module of that name is importable here")
    if spec.submodule_search_locations is not None and importlib.machinery.PathFinder.find_spec(
            "__main__", list(spec.submodule_search_locations)) is None:
        fail("it is a package without a __main__ module, so 'python -m' cannot run it as "
             "the engine process")


def spawn(module: str, control_address: str, pass_fds: Sequence[int],
          start_timeout_s: float) -> subprocess.Popen:
    """Start ``python -m <module> <control address> <this pid> <start_timeout_s>``; it
    inherits ``pass_fds`` (the channel's segments and wake pipe, same numbers, so it
    attaches without going through /proc/<pid>/fd), and exits if no ``Start`` came within
    ``start_timeout_s`` (the ready timeout: a start-up interrupted before it kept the
    process, a Ctrl-C inside ``Popen``, leaves no engine waiting for good). Never blocks;
    raises what ``Popen`` raises."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return subprocess.Popen(
        [sys.executable, "-m", module, control_address, str(os.getpid()), repr(float(start_timeout_s))],
        env=env, stdin=subprocess.DEVNULL, pass_fds=tuple(pass_fds))


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


def stop(proc: subprocess.Popen, timeout: float) -> None:
    """Wait up to ``timeout`` for ``proc`` to exit by itself, then SIGTERM (2 s), then
    SIGKILL; returns once it is reaped."""
    try:
        proc.wait(timeout=timeout)
        return
    except subprocess.TimeoutExpired:
        if timeout > 0:  # at 0 the caller asked for the SIGTERM: nothing to warn of
            logger.warning("engine process %d did not exit in %.1f s: SIGTERM",
                           proc.pid, timeout)
    proc.terminate()
    try:
        proc.wait(timeout=2.0)
        return
    except subprocess.TimeoutExpired:
        logger.warning("engine process %d ignored SIGTERM: SIGKILL", proc.pid)
    proc.kill()
    proc.wait()
