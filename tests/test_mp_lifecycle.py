"""Multiprocess client lifecycle: start-up failures, engine death, shutdown, GC, orphans.

Each test builds its own client (these tests kill engines); the autouse ``no_leaks``
fixture checks that no process, thread or /dev/shm entry survives any of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest
import torch

from shmclient.config import EngineConfig
from shmclient import (AsyncMPClient, ClientClosedError, ConfigError, EngineDeadError,
                       InvalidRequestError, SyncMPClient, make_client, waiting)
from shmclient.launcher import READY_TIMEOUT_ENV

from . import fault_engine
from .conftest import sigstop
from .drivers import KINDS, Driver, add_until_one_parks, build, ctrl_c_when, req
from .test_waiting import Stopped

TRANSPORTS = ("shm", "zmq")


def cfg(transport: str = "shm", **kw) -> EngineConfig:
    return EngineConfig(model="mock", transport=transport, max_model_len=256, **kw)


def test_make_client_kinds():
    with pytest.raises(NotImplementedError):
        make_client(False, True, cfg())
    c = make_client(True, False, cfg())
    try:
        assert type(c).__name__ == "SyncMPClient"
        assert c.num_gpu_blocks > 0 and c.block_size == 16 and c.max_model_len == 256
        assert psutil.pid_exists(c.engine_pid)
    finally:
        c.shutdown()
        c.shutdown()  # twice is safe
    assert not psutil.pid_exists(c.engine_pid) or psutil.Process(c.engine_pid).status() == "zombie"


def test_ready_timeout_names_the_setting(monkeypatch):
    monkeypatch.setenv(READY_TIMEOUT_ENV, "1.5")
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as ei:
        SyncMPClient(cfg(**fault_engine.inject(monkeypatch, "hang_before_ready")))
    elapsed = time.monotonic() - t0
    assert 0.9 * 1.5 <= elapsed <= 1.5 + 2.0, elapsed  # (start-up and the engine's stop on top)
    msg = str(ei.value)
    assert "Timed out waiting for engine core processes to start" in msg
    assert READY_TIMEOUT_ENV in msg and "1.5" in msg


def test_ready_timeout_from_config(monkeypatch):
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        SyncMPClient(cfg(engine_ready_timeout_s=1.0,
                         **fault_engine.inject(monkeypatch, "hang_before_ready")))
    assert 0.9 <= time.monotonic() - t0 <= 1.0 + 2.0  # (the default is 600 s)


def test_the_private_socket_folder_goes_once_the_engine_connected_not_after_its_load(monkeypatch):
    """The folder of the control socket (in the temporary directory) lived through the
    whole model load: a SIGKILL of frontend and engine meanwhile (a process group's
    kill, the OOM killer) left it behind. With shared memory it holds only the control
    socket, which the engine's Hello says is connected: it goes then."""
    import tempfile

    base = tempfile.gettempdir()

    def folders() -> list[str]:
        return [n for n in os.listdir(base) if n.startswith(f"shmc-ipc-{os.getpid()}-")]

    errors: list = []
    kids_before = {p.pid for p in psutil.Process().children()}

    def start() -> None:
        try:
            SyncMPClient(cfg(engine_ready_timeout_s=15.0,
                             **fault_engine.inject(monkeypatch, "hang_before_ready")))
        except BaseException as e:  # noqa: BLE001 - the engine's end, checked below
            errors.append(e)

    t = threading.Thread(target=start)
    t.start()
    try:
        seen_at, deadline = None, time.monotonic() + 20
        while time.monotonic() < deadline:  # made, then gone while the engine "loads"
            now = bool(folders())
            if now and seen_at is None:
                seen_at = time.monotonic()
            if seen_at is not None and not now:
                break
            time.sleep(0.005)
        assert seen_at is not None and not folders()
        # Gone with the engine's Hello (its interpreter's start), far before the ready
        # timeout (15 s) that removed it before.
        assert time.monotonic() - seen_at < 8.0 and t.is_alive(), "the folder outlived the Hello"
    finally:
        # The engine "loads" until the ready timeout: end it (the start-up then fails at
        # once, naming its exit) rather than wait for that.
        for p in psutil.Process().children():
            if p.pid not in kids_before:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
        t.join(30)
    assert not t.is_alive()
    assert isinstance(errors[0], EngineDeadError) and "SIGKILL" in str(errors[0]), errors


def test_startup_crash_is_reported_with_exit_code_not_timeout(monkeypatch):
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="initialization failed.*exit code 7"):
        SyncMPClient(cfg(engine_ready_timeout_s=60,
                         **fault_engine.inject(monkeypatch, "exit_before_ready:7")))
    # Start-up of a fresh interpreter takes a few seconds; the failure must come from the
    # exit (detected within a poll slice), far before the 60 s timeout.
    assert time.monotonic() - t0 < 15


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_exception_in_engine_loop_reaches_client(transport, monkeypatch):
    c = SyncMPClient(cfg(transport, **fault_engine.inject(monkeypatch, "raise_in_step:3")))
    try:
        c.add_request(req("boom", max_tokens=50))
        with pytest.raises(EngineDeadError, match="injected fault in step 3"):
            for _ in range(10):
                c.get_output(timeout=30)
        with pytest.raises(EngineDeadError):
            c.add_request(req("after", max_tokens=1))
        c.abort_requests(["boom"])  # quiet no-op
    finally:
        c.shutdown()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_an_output_batch_that_does_not_decode_breaks_the_channel(transport, monkeypatch):
    """It was logged and dropped: the other requests of that step lost their tokens in
    it unseen, and one whose finish it carried never finished (its id live for good).
    As vLLM's output reader, the client takes the engine for dead, saying why."""
    c = SyncMPClient(cfg(transport, **fault_engine.inject(monkeypatch, "undecodable_output:2")))
    try:
        c.add_request(req("good", max_tokens=5))
        c.add_request(req("bad", max_tokens=5))
        with pytest.raises(EngineDeadError, match="output batch .* does not decode"):
            for _ in range(10):
                c.get_output(timeout=30)
        assert c.is_dead
        with pytest.raises(EngineDeadError):
            c.add_request(req("after", max_tokens=1))
    finally:
        c.shutdown()


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_request_ring_the_engine_broke_makes_the_client_dead_saying_why(kind):
    """The engine (stopped here) stores a request-ring tail past anything written: the
    ring's end raised RingCorruptError out of add_request, echo and add_request_async
    (not EngineDeadError, which vLLM's callers catch), the client did not count the
    engine dead, and once the engine exited its death read 'exit code 0'."""
    import struct

    off_tail = 256  # the tail's place in the ring header (tests/test_ring_hardening.py)
    c = (SyncMPClient if kind == "sync" else AsyncMPClient)(cfg(ring_capacity_bytes=4096))
    sigstop(c.engine_pid)
    try:
        struct.pack_into("<Q", c.channel.tx._res.seg.buf, off_tail, 3 * 4096)

        async def adds():
            for i in range(200):
                await c.add_request_async(req(f"r{i}", max_tokens=1), timeout=5)

        with pytest.raises(EngineDeadError, match="engine core is broken.*tail = 12288"):
            if kind == "sync":
                for i in range(200):
                    c.add_request(req(f"r{i}", max_tokens=1), timeout=5)
            else:
                asyncio.run(adds())
        assert c.is_dead
        if kind == "sync":
            with pytest.raises(EngineDeadError, match="engine core is broken"):
                c.echo("x")
    finally:
        os.kill(c.engine_pid, signal.SIGCONT)
        c.shutdown()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_sigkill_engine_sync(transport):
    c = SyncMPClient(cfg(transport, step_delay_s=0.01))
    try:
        c.add_request(req("long", max_tokens=200))
        c.get_output(timeout=30)
        # A utility call that the engine answers only when the running request ends.
        result: dict = {}

        def pending_call():
            try:
                c.call_utility("sleep", 1, "wait")
            except BaseException as e:  # noqa: BLE001
                result["util"] = e

        def blocked_get():
            try:
                while True:
                    c.get_output(timeout=30)
            except BaseException as e:  # noqa: BLE001
                result["get"] = e

        threads = [threading.Thread(target=pending_call), threading.Thread(target=blocked_get)]
        for t in threads:
            t.start()
        os.kill(c.engine_pid, signal.SIGKILL)
        t_kill = time.monotonic()
        for t in threads:
            t.join(timeout=5)
        assert time.monotonic() - t_kill < 2.5
        assert isinstance(result.get("util"), EngineDeadError), result
        assert isinstance(result.get("get"), EngineDeadError), result
        assert "SIGKILL" in str(result["get"])
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError):
            c.add_request(req("late", max_tokens=1))
        with pytest.raises(EngineDeadError):
            c.echo(1)
        assert time.monotonic() - t0 < 0.5  # at once: no timeout waited out
        c.abort_requests(["long"])
    finally:
        c.shutdown()


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_sigkill_engine_async(transport):
    c = make_client(True, True, cfg(transport, step_delay_s=0.01))
    try:
        await c.add_request_async(req("long", max_tokens=200))
        await asyncio.wait_for(c.get_output_async(), 30)
        util = asyncio.ensure_future(c.sleep_async(1, "wait"))

        async def drain():
            while True:
                await c.get_output_async()

        getter = asyncio.ensure_future(drain())
        await asyncio.sleep(0)  # let both start waiting
        os.kill(c.engine_pid, signal.SIGKILL)
        t0 = time.monotonic()
        for fut in (util, getter):
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(fut, 2.5)
        assert time.monotonic() - t0 < 2.5
        with pytest.raises(EngineDeadError):
            await c.add_request_async(req("late", max_tokens=1))
        await c.abort_requests_async(["long"])
    finally:
        c.shutdown()


def _until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def test_a_utility_reply_written_before_the_engine_died_is_returned_sync():
    """The engine answered, then died before anyone read the answer: the call returns
    it (vLLM reads its socket in order), as the outputs written before the death come
    first. The reading is held off (the lead taken) until the death was handled."""
    c = SyncMPClient(cfg())
    handled = threading.Event()
    c.on_dead(lambda e: handled.set())  # runs after the client's own death handling
    result: dict = {}

    def call():
        try:
            result["value"] = c.echo("the answer")
        except BaseException as e:  # noqa: BLE001
            result["error"] = e

    t = threading.Thread(target=call)
    try:
        with c._lead:
            t.start()
            _until(c.channel.readable)  # the reply is in the ring, unread
            os.kill(c.engine_pid, signal.SIGKILL)
            assert handled.wait(10)
        t.join(10)
        assert not t.is_alive()
        assert result == {"value": "the answer"}
        with pytest.raises(EngineDeadError):
            c.echo(1)
    finally:
        t.join(10)
        c.shutdown()


async def test_a_utility_reply_written_before_the_engine_died_is_returned_async():
    c = await AsyncMPClient.create(cfg())
    loop = asyncio.get_running_loop()
    handled = asyncio.Event()
    c.on_dead(lambda e: loop.call_soon_threadsafe(handled.set))  # queued after the client's own
    try:
        c._lead.acquire()  # the loop's reader cannot take the reply meanwhile
        try:
            call = asyncio.ensure_future(c.echo_async("the answer"))
            deadline = time.monotonic() + 10
            while not c.channel.readable():
                assert time.monotonic() < deadline
                await asyncio.sleep(0.001)
            os.kill(c.engine_pid, signal.SIGKILL)
            await asyncio.wait_for(handled.wait(), 10)
        finally:
            c._lead.release()
        assert await asyncio.wait_for(call, 10) == "the answer"
        with pytest.raises(EngineDeadError):
            await c.echo_async(1)
    finally:
        await c.shutdown_async()


@pytest.mark.parametrize("dp", [1, 2])
def test_a_cancelled_create_shuts_down_the_client_it_builds_after_all(dp):
    """``create`` runs the constructor in the loop's executor; cancelled (a wait_for
    that ran out), the client it built was dropped with its engines running until a
    garbage collection found its cycles. It is shut down now, in that executor, which
    asyncio.run waits for."""
    from shmclient import DPLBAsyncMPClient

    cls = AsyncMPClient if dp == 1 else DPLBAsyncMPClient

    async def main() -> None:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(cls.create(cfg(data_parallel_size=dp)), 0.01)

    before = set(psutil.Process().children())  # (another test's, module-scoped)
    gc.disable()  # (a collection would stop the engines whatever create did)
    try:
        asyncio.run(main())
        assert set(psutil.Process().children()) - before == set()
    finally:
        gc.enable()


@pytest.mark.parametrize("dp", [1, 2])
def test_a_cancelled_create_stops_the_engine_start_at_once(dp, monkeypatch):
    """An engine still loading when ``create`` is cancelled (a wait_for that ran out,
    Ctrl-C under asyncio.run): the start went on waiting for the engine up to
    engine_ready_timeout_s, and asyncio.run, which waits for the executor running it,
    with it. The start now gives up within a poll slice and stops the engine(s)."""
    from shmclient import DPLBAsyncMPClient

    cls = AsyncMPClient if dp == 1 else DPLBAsyncMPClient
    config = cfg(data_parallel_size=dp, engine_ready_timeout_s=30.0,
                 **fault_engine.inject(monkeypatch, "hang_before_ready"))

    async def main() -> None:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(cls.create(config), 0.5)

    before = set(psutil.Process().children())  # (another test's, module-scoped)
    t0 = time.monotonic()
    asyncio.run(main())  # (returns once the executor's start is over)
    assert time.monotonic() - t0 < 10.0, "the cancelled start waited for its engine"
    assert set(psutil.Process().children()) - before == set()


async def test_utility_calls_waiting_for_room_when_the_engine_dies_leave_no_error_unread():
    """Utility calls waiting for room in a full request ring (their futures registered)
    when the engine dies: the death failed each future, each call raised the death from
    its send and dropped the future unread, and asyncio logged "Future exception was
    never retrieved", with a traceback, at ERROR level, once per call."""
    loop = asyncio.get_running_loop()
    reported: list = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context["message"]))
    c = make_client(True, True, cfg(ring_capacity_bytes=1 << 14))
    try:
        sigstop(c.engine_pid)  # the request ring fills up
        add, _ = await add_until_one_parks(c.add_request_async, lambda i: req(f"fill-{i}"))
        calls = [asyncio.ensure_future(c.echo_async(k)) for k in range(3)]
        await asyncio.sleep(0)  # (each registers its future and parks behind the add)
        assert len(c._futures) == 3 and not any(f.done() for f in calls)
        os.kill(c.engine_pid, signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(add, *calls, return_exceptions=True), 10)
        assert [type(r) for r in results] == [EngineDeadError] * 4
        del add, calls, results
        gc.collect()  # (a future unread is reported as it is collected)
        assert reported == []
    finally:
        loop.set_exception_handler(None)
        await c.shutdown_async()


async def test_cancelled_async_utility_leaves_client_usable():
    c = make_client(True, True, cfg(step_delay_s=0.01))
    try:
        await c.add_request_async(req("hold", max_tokens=60))
        slow = asyncio.ensure_future(c.sleep_async(1, "wait"))
        await asyncio.sleep(0)
        slow.cancel()
        with pytest.raises(asyncio.CancelledError):
            await slow
        assert await asyncio.wait_for(c.echo_async("still here"), 10) == "still here"
        got = 0
        while got < 60:
            out = await asyncio.wait_for(c.get_output_async(), 10)
            got += sum(len(o.new_token_ids) for o in out.outputs)
        # The late reply to the cancelled call arrives and is dropped quietly.
        assert await asyncio.wait_for(c.is_sleeping_async(), 10) is True
        await c.wake_up_async()
    finally:
        c.shutdown()


def test_garbage_collection_stops_engine():
    c = SyncMPClient(cfg())
    pid = c.engine_pid
    proc = psutil.Process(pid)
    del c
    gc.collect()
    proc.wait(timeout=10)
    assert not psutil.pid_exists(pid) or proc.status() == psutil.STATUS_ZOMBIE


def test_shutdown_escalates_when_engine_ignores_it():
    c = SyncMPClient(cfg())
    try:
        sigstop(c.engine_pid)  # a hung engine: answers nothing
        t0 = time.monotonic()
        c.shutdown(timeout=0.5)
        assert time.monotonic() - t0 < 5
        assert psutil.Process(c.engine_pid).status() == psutil.STATUS_ZOMBIE if psutil.pid_exists(c.engine_pid) else True
    finally:
        c.shutdown()


def _exited(pidfd: int) -> bool:
    """Has the process behind ``pidfd`` exited (now, without waiting)?"""
    return bool(select.select([pidfd], [], [], 0)[0])


def test_a_retry_after_ctrl_c_in_shutdown_waits_for_the_engines_stop(monkeypatch):
    """A hung engine (SIGSTOP); Ctrl-C lands while shutdown(timeout=1) stops it. The
    engine's stop used to end there (a retry returned at once, the engine left running
    and its channel open); now it goes on, and the retry waits for it (1 s, SIGTERM,
    SIGKILL 2 s later)."""
    from shmclient import launcher

    c = SyncMPClient(cfg())
    fd = os.pidfd_open(c.engine_pid)
    stopping = threading.Event()
    real_stop = launcher.engine_process.stop

    def stop(proc, timeout):  # (the shutdown's thread, stopping the engine)
        stopping.set()
        return real_stop(proc, timeout)

    monkeypatch.setattr(launcher.engine_process, "stop", stop)
    try:
        sigstop(c.engine_pid)
        with ctrl_c_when(stopping), pytest.raises(KeyboardInterrupt):
            c.shutdown(timeout=1)  # (the engine's stop takes 1 s at least: it lands)
        assert not _exited(fd), "the interrupt landed after the engine had exited"
        c.shutdown()
        assert _exited(fd), "the retry returned with the engine still running"
        assert c.resources.shut_down
    finally:
        try:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        except ProcessLookupError:
            pass
        c.shutdown(timeout=0)
        os.close(fd)


async def test_a_cancelled_shutdown_async_goes_on_and_a_retry_waits_for_it():
    c = await AsyncMPClient.create(cfg())
    fd = os.pidfd_open(c.engine_pid)
    try:
        sigstop(c.engine_pid)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(c.shutdown_async(timeout=1), 0.2)
        assert not _exited(fd)
        await c.shutdown_async()
        assert _exited(fd), "the retry returned with the engine still running"
    finally:
        try:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        except ProcessLookupError:
            pass
        await c.shutdown_async(timeout=0)
        os.close(fd)


def test_a_channel_that_fails_to_close_does_not_keep_the_engine_running(monkeypatch, caplog):
    """One failing step of shutdown() (here the channel's close) skipped the rest: the
    engine process was never stopped. It is logged and the shutdown goes on."""
    c = SyncMPClient(cfg())
    pid = c.engine_pid
    real_close = c.channel.close

    def broken() -> None:
        real_close()
        raise RuntimeError("close failed")

    monkeypatch.setattr(c.channel, "close", broken)
    with caplog.at_level(logging.ERROR, logger="shmclient"):
        c.shutdown(timeout=5)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert any("closing the channel to the engine failed" in r.getMessage() for r in caplog.records)


EXIT_WITHOUT_SHUTDOWN = textwrap.dedent(
    """
    import sys
    from shmclient.config import EngineConfig
    from shmclient import make_client
    c = make_client(True, sys.argv[1] == "async", EngineConfig(model="mock"))
    print(c.engine_pid, flush=True)
    if sys.argv[1] == "sync":
        c.echo(1)
    """
)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_interpreter_exit_without_shutdown_stops_the_engine_without_a_traceback(kind):
    """A script that ends (or dies of an uncaught exception) without ``shutdown()``: at
    the interpreter's exit the finalizers run newest first, the rings' before the
    client's, whose shutdown then read a released segment, printed a traceback and
    skipped the rest of its work. Now it runs to its end: the engine is stopped."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", EXIT_WITHOUT_SHUTDOWN, kind], capture_output=True, text=True,
                         cwd=root, timeout=60)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    try:
        psutil.Process(int(out.stdout.split()[0])).wait(timeout=10)  # (TimeoutExpired: it outlived its frontend)
    except psutil.NoSuchProcess:
        pass


FRONTEND = textwrap.dedent(
    """
    import sys, threading
    from shmclient.config import EngineConfig
    from shmclient import make_client
    c = make_client(True, False, EngineConfig(model="mock", transport=sys.argv[1]))
    print(c.engine_pid, flush=True)
    threading.Event().wait()
    """
)


@pytest.mark.slow  # tests/test_frontend_death.py checks the same, with the 0.5 s bound
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_frontend_sigkill_engine_exits(transport):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    fe = subprocess.Popen(
        [sys.executable, "-c", FRONTEND, transport], stdout=subprocess.PIPE, cwd=root, text=True
    )
    try:
        engine_pid = int(fe.stdout.readline())
        engine = psutil.Process(engine_pid)
        fe.kill()
        fe.wait(timeout=10)
        t0 = time.monotonic()
        engine.wait(timeout=10)
        assert time.monotonic() - t0 < 10
    finally:
        if fe.poll() is None:
            fe.kill()
            fe.wait()
        fe.stdout.close()
    # Names carry the creator's pid: nothing of the killed frontend may remain.
    assert [n for n in os.listdir("/dev/shm") if f"-{fe.pid}-" in n] == []


@pytest.mark.parametrize("kind", KINDS)
async def test_calls_after_shutdown_raise_engine_dead_error(kind):
    # vLLM raises EngineDeadError for calls on a client after shutdown(); our
    # ClientClosedError is one, so both spellings catch it.
    client = build(kind, cfg())
    drv = Driver(kind, client)
    client.shutdown()
    for call in (
        lambda: drv.add(req("late", max_tokens=1)),
        lambda: drv.get_output(timeout=1.0),
        lambda: drv.util("echo", 1),
        lambda: drv.call_utility("is_sleeping"),
    ):
        with pytest.raises(EngineDeadError) as ei:
            await call()
        assert isinstance(ei.value, ClientClosedError)
    await drv.abort(["late"])  # aborts stay a quiet no-op, as after engine death
    client.shutdown()  # still idempotent


@pytest.mark.parametrize("kind", ["sync-shm", "async-shm"])
async def test_outputs_queued_at_shutdown_are_not_handed_out_after_it(kind):
    """Every call after shutdown() raises (the clients' docstrings): get_output handed
    out a batch read before it first."""
    client = build(kind, cfg())
    drv = Driver(kind, client)
    try:
        await drv.add(req("a", max_tokens=3))
        deadline = time.monotonic() + 10
        while not client._outputs:  # a batch read, not taken
            assert time.monotonic() < deadline
            if drv.is_async:
                await asyncio.sleep(0.001)
            else:
                try:
                    client._reader.wait(lambda: bool(client._outputs), time.monotonic() + 0.1)
                except waiting.PeerNotProducingError:
                    pass
    finally:
        client.shutdown()
    with pytest.raises(ClientClosedError):
        await drv.get_output(timeout=1.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without a GPU")
@pytest.mark.parametrize("kind", ["inproc", "sync-shm", "async-zmq"])
def test_cuda_device_without_gpu_is_the_documented_config_error_on_every_client(kind):
    # The in-process client raised ConfigError, the multiprocess ones RuntimeError.
    with pytest.raises(ConfigError, match=r"device='cuda' is invalid.*is_available\(\) is False"):
        build(kind, cfg(device="cuda"))


def test_add_blocked_on_a_full_ring_at_shutdown_gets_engine_dead_error():
    # The ring's own "this producer end of the ring was closed" must not reach the caller.
    c = SyncMPClient(EngineConfig(model="mock", ring_capacity_bytes=4096, max_model_len=4096))
    sigstop(c.engine_pid)  # the engine stops reading requests
    res: dict[str, BaseException] = {}
    big = req("big", prompt=[1000 + i % 20 for i in range(3000)], max_tokens=1)

    def adder() -> None:
        try:
            c.add_request(big)  # larger than the ring: waits for room mid-message
        except BaseException as e:  # noqa: BLE001
            res["e"] = e

    t = threading.Thread(target=adder)
    t.start()
    try:
        # Wait (on state) until the message filled the ring and the adder waits for room.
        deadline = time.monotonic() + 10
        while c.channel.tx.statistics().waits_on_full == 0 and time.monotonic() < deadline:
            t.join(0.01)
    finally:
        c.shutdown(timeout=0.2)
        t.join(10)
    assert not t.is_alive()
    e = res.get("e")
    assert isinstance(e, EngineDeadError), repr(e)
    assert "shut down" in str(e), str(e)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_send_on_a_channel_closed_under_the_call_is_engine_dead_error(transport):
    # What a call racing shutdown() sees once the channel is closed under it: the
    # transport's own error (the ring's ClientClosedError, zmq's ENOTSOCK) must come out
    # as EngineDeadError.
    c = SyncMPClient(cfg(transport))
    try:
        c.channel.close()
        with pytest.raises(EngineDeadError):
            c.add_request(req("racing", max_tokens=1))
        with pytest.raises(EngineDeadError):
            c.echo(1)
    finally:
        c.shutdown()


def test_broken_request_ring_is_fatal_and_the_engine_says_why():
    # Only a broken channel kills the engine, and its death report names the cause.
    c = SyncMPClient(cfg())
    try:
        c.add_request(req("first", max_tokens=1))
        waiting.send(c.channel.tx, 0x7E, b"junk", timeout=5.0)  # a record type nobody speaks
        with pytest.raises(EngineDeadError, match="ProtocolError: unknown record type 0x7e"):
            for _ in range(10):
                c.get_output(timeout=30)
    finally:
        c.shutdown()


@pytest.mark.parametrize("kind", ["sync-shm", "async-zmq"])
async def test_broken_output_channel_is_engine_dead_error_saying_so(kind, monkeypatch):
    # A channel that raises ProtocolError (corrupt framing, a record type nobody speaks)
    # cannot be trusted again: the client treats the engine as dead, and says why.
    from shmclient import ProtocolError

    client = build(kind, cfg())
    drv = Driver(kind, client)
    try:
        def broken(*args, **kwargs):
            raise ProtocolError("unknown record type 0x7e on the ring")

        monkeypatch.setattr(client.channel, "recv_nowait", broken)
        monkeypatch.setattr(client.channel, "try_recv", broken)
        await drv.add(req("r", max_tokens=2))
        with pytest.raises(EngineDeadError, match="channel with the engine core is broken"):
            await drv.get_output(timeout=10)
        with pytest.raises(EngineDeadError, match="broken"):
            await drv.add(req("later", max_tokens=2))
    finally:
        monkeypatch.undo()
        client.shutdown()


@pytest.mark.parametrize("how", ["shutdown", "finalizer"])
def test_on_dead_is_not_called_for_the_clients_own_shutdown(how):
    """``on_dead`` reports an engine's death, never the client's own shutdown: neither
    ``shutdown()`` nor the finalizer (a client dropped, or left to the interpreter's
    exit) calls it; an engine killed afterwards is not reported either."""
    c = make_client(True, True, cfg())
    called: list[BaseException] = []
    c.on_dead(called.append)
    pid = c.engine_pid
    if how == "shutdown":
        c.shutdown(timeout=1.0)
    else:
        c._finalizer()  # what garbage collection or the interpreter's exit runs
    assert c.is_dead and not called
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    c.on_dead(called.append)  # registered after: not called either
    assert not called


class _GatedDead(threading.Event):
    """An ``EngineResources.dead`` whose first ``is_set()`` after ``arm()`` waits until
    the engine is marked dead (0.5 s at most), then looks: ``on_dead`` registered, then
    finding it dead after ``mark_dead`` called every callback."""

    def __init__(self) -> None:
        super().__init__()
        self._armed = False
        self._gate = threading.Lock()
        self.first_in = threading.Event()

    def arm(self) -> None:
        self._armed = True

    def is_set(self) -> bool:
        if not self._armed:
            return super().is_set()
        with self._gate:
            first = not self.first_in.is_set()
            self.first_in.set()
        if first:
            self.wait(0.5)
        return super().is_set()


class _SlowSet(threading.Event):
    """``dead`` whose ``set`` holds its caller (5 s at most) until ``go``: a second
    ``mark_dead`` comes while the first is half-way."""

    def __init__(self) -> None:
        super().__init__()
        self.setting = threading.Event()
        self.go = threading.Event()

    def set(self) -> None:
        self.setting.set()
        self.go.wait(5)
        super().set()


def test_a_second_mark_dead_while_the_first_is_half_way_calls_nothing():
    """The monitor and a reader that found the channel broken mark the engine dead at
    once: the second, coming while the first is half-way, calls no callback (a
    check of ``dead`` before setting it let both through)."""
    from shmclient.launcher import EngineResources

    res = EngineResources()
    res.dead = dead = _SlowSet()
    calls: list[int] = []
    res.on_dead(lambda: calls.append(1))
    first = threading.Thread(target=res.mark_dead, args=("the monitor saw it",))
    try:
        first.start()
        assert dead.setting.wait(5)
        res.mark_dead("the channel is broken")
        assert calls == []
    finally:
        dead.go.set()
        first.join(5)
        res.shutdown(timeout=0.0)  # (nothing was started: closes its wake pipe)
    assert calls == [1] and res.dead_reason == "the monitor saw it"


def test_a_finalizer_run_inside_mark_dead_does_not_deadlock():
    """A client dropped without shutdown() is freed by the garbage collector, which may
    run its finalizer (the resources' shutdown) in any thread at any allocation: here
    inside ``mark_dead`` as the monitor marks the engine dead. A ``mark_dead`` that held
    the lock shutdown() takes hung there for good (the death never reported)."""
    from shmclient.launcher import EngineResources

    res = EngineResources()

    class FinalizerRunsHere(list):  # the callbacks' list, whose copy runs the finalizer
        def __iter__(self):
            res.shutdown(timeout=0.0)
            return super().__iter__()

    res._callbacks = FinalizerRunsHere()
    marking = threading.Thread(target=res.mark_dead, args=("the monitor saw it",), daemon=True)
    marking.start()
    marking.join(5)
    assert not marking.is_alive(), "mark_dead hung"
    assert res.dead.is_set() and res.dead_reason == "the monitor saw it"


class _LauncherThreading:
    """``launcher``'s view of ``threading``, with ``Thread.start`` replaced."""

    def __init__(self, start) -> None:
        self.Thread = type("Thread", (threading.Thread,), {"start": start})
        self.current_thread, self.get_ident = threading.current_thread, threading.get_ident


@pytest.mark.parametrize("thread_started", [True, False], ids=["after", "before"])
def test_a_shutdown_interrupted_while_its_thread_starts_is_done_once_by_the_next_call(
        monkeypatch, thread_started):
    """Ctrl-C inside ``Thread.start`` (after or before the thread began): the next
    ``shutdown`` does the work (or waits for the thread doing it), and only once."""
    from shmclient import launcher

    res = launcher.EngineResources()
    runs: list[float] = []
    real = res._shutdown
    monkeypatch.setattr(res, "_shutdown", lambda t: (runs.append(t), real(t)))
    interrupted: list[int] = []

    def start(self):
        if not interrupted:
            interrupted.append(1)
            if thread_started:
                threading.Thread.start(self)
            raise KeyboardInterrupt
        threading.Thread.start(self)

    monkeypatch.setattr(launcher, "threading", _LauncherThreading(start))
    with pytest.raises(KeyboardInterrupt):
        res.shutdown(timeout=0.0)
    res.shutdown(timeout=0.0)
    assert res.shut_down and runs == [0.0]
    res.shutdown(timeout=0.0)
    assert runs == [0.0]


def test_a_shutdown_called_from_inside_the_shutdown_returns_at_once():
    """A finalizer the garbage collector runs inside the shutdown's own work (a client
    freed by a step of it) calls shutdown again: it used to wait for the work it was
    part of (timeout + 10 s)."""
    from shmclient import launcher

    res = launcher.EngineResources()
    inner: list[float] = []

    def hook() -> None:
        t0 = time.monotonic()
        res.shutdown(timeout=0.0)
        inner.append(time.monotonic() - t0)

    res.before_close(hook)
    res.shutdown(timeout=0.0)
    assert res.shut_down and len(inner) == 1 and inner[0] < 2.0


async def test_a_shutdown_blocking_the_loop_stops_its_watch_before_returning():
    """A client freed by the garbage collector on an event loop's thread shuts down
    there, blocking the loop. Its hook that stops the loop watching the channel ran in
    the shutdown's own thread, which could only queue that to the blocked loop: the
    descriptor was closed and its number reused by a reader registered next, which the
    queued removal then unregistered (a lost wake-up). The hooks run in the caller's
    thread: the watch is gone when shutdown returns."""
    from shmclient import launcher

    loop = asyncio.get_running_loop()
    r, w = os.pipe()
    loop.add_reader(r, lambda: None)

    def unwatch() -> None:  # as the async client's reader does (waiting.loop_reader)
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            loop.remove_reader(r)
        else:
            loop.call_soon_threadsafe(loop.remove_reader, r)

    res = launcher.EngineResources()
    res.before_close(unwatch)
    try:
        res.shutdown(timeout=0.0)  # (blocking, on the loop's thread)
        assert not loop.remove_reader(r), "the loop still watched the descriptor"
    finally:
        loop.remove_reader(r)
        os.close(r)
        os.close(w)


def test_a_retry_with_a_shorter_timeout_waits_for_the_stop_under_way(monkeypatch):
    """Ctrl-C in shutdown(timeout=30), then shutdown(timeout=0): the retry waited only
    its own timeout plus the grace, and returned while the stop (with its 30 s) was
    still under way. It waits for the stop as the first call would have."""
    from shmclient import launcher

    monkeypatch.setattr(launcher, "_STOP_GRACE_S", 0.1)
    res = launcher.EngineResources()
    release, running = threading.Event(), threading.Event()
    real = res._shutdown

    def slow(timeout):  # a stop that takes longer than 0 + the grace
        running.set()
        release.wait(10)
        real(timeout)

    monkeypatch.setattr(res, "_shutdown", slow)
    first = threading.Thread(target=res.shutdown, args=(30.0,))
    retry = threading.Thread(target=res.shutdown, args=(0.0,))
    first.start()
    try:
        assert running.wait(10)  # the first call's stop is under way
        retry.start()
        retry.join(1.0)
        assert retry.is_alive(), "the retry returned before the stop was over"
    finally:
        release.set()
        first.join(10)
        retry.join(10)
    assert res.shut_down and not retry.is_alive()


def test_ctrl_c_before_the_stop_started_leaves_the_finalizer_to_stop_the_engine(monkeypatch):
    """Ctrl-C as shutdown() began (before its thread started the stop): the finalizer was
    already detached, so nothing stopped the engine when the client went."""
    c = SyncMPClient(cfg())
    fd = os.pidfd_open(c.engine_pid)
    try:
        real = c.resources.begin_shutdown

        def interrupted():
            real()
            raise KeyboardInterrupt

        monkeypatch.setattr(c.resources, "begin_shutdown", interrupted)
        with pytest.raises(KeyboardInterrupt):
            c.shutdown()
        monkeypatch.undo()
        del c
        gc.collect()  # the finalizer: the resources' shutdown
        assert select.select([fd], [], [], 10)[0], "the engine was left running"
    finally:
        try:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.close(fd)


def test_a_shutdown_where_no_thread_can_start_runs_inline(monkeypatch):
    """Python 3.12.0/3.12.1 refuse a new thread at interpreter shutdown (RuntimeError):
    the shutdown of an atexit handler or finalizer then runs in the calling thread."""
    from shmclient import launcher

    res = launcher.EngineResources()

    def start(self):
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(launcher, "threading", _LauncherThreading(start))
    res.shutdown(timeout=0.0)
    assert res.shut_down and res.dead.is_set()


def test_a_death_callback_registered_as_the_engine_dies_runs_once():
    """A callback is registered just as the engine dies: ``mark_dead`` calls it, and
    ``on_dead`` finds the engine dead: it runs once."""
    from shmclient.launcher import EngineResources

    res = EngineResources()
    res.dead = gated = _GatedDead()
    calls: list[int] = []
    cb = lambda: calls.append(1)  # noqa: E731
    first = threading.Thread(target=res.on_dead, args=(cb,))
    second = threading.Thread(target=res.mark_dead, args=("the channel is broken",))
    try:
        gated.arm()
        first.start()
        assert gated.first_in.wait(5)
        second.start()
    finally:
        first.join(5)
        if second.ident is not None:
            second.join(5)
        res.shutdown(timeout=0.0)  # (nothing was started: closes its wake pipe)
    assert calls == [1]


def test_a_fork_while_a_lock_of_the_engines_resources_is_held_does_not_hang_the_child():
    """The child's fork hook set the resources' shutdown Event, whose lock another thread
    of the parent may hold at the fork (inside its own set() or wait()): held for good in
    the child, which hung in the hook before running a line of its own. Here the parent
    holds it across the fork."""
    from shmclient.launcher import EngineResources

    res = EngineResources()
    r, w = os.pipe()
    try:
        with res._shutdown_finished._cond:
            pid = os.fork()
            if pid == 0:
                os.write(w, b"ran")
                os._exit(0)
        os.close(w)
        w = -1
        try:
            ready = select.select([r], [], [], 10)[0]
            if not ready:
                os.kill(pid, signal.SIGKILL)
            assert ready and os.read(r, 16) == b"ran", "the child hung in the fork hook"
        finally:
            os.waitpid(pid, 0)
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
        res.shutdown(timeout=0.0)  # (nothing was started: closes its wake pipe)


@pytest.mark.parametrize("dp", [1, 2])
async def test_create_builds_a_subclass_whose_constructor_takes_the_config_only(dp):
    """A subclass with an ``__init__(self, config)`` of its own: ``create`` builds it
    as before (it failed with TypeError once ``create`` passed its cancellation event
    to every constructor)."""
    from shmclient import DPLBAsyncMPClient

    base = AsyncMPClient if dp == 1 else DPLBAsyncMPClient

    class Mine(base):  # type: ignore[misc, valid-type]
        def __init__(self, config):
            super().__init__(config)
            self.mine = True

    c = await asyncio.wait_for(Mine.create(cfg(data_parallel_size=dp)), 60)
    try:
        assert type(c) is Mine and c.mine
        assert await c.echo_async("here") == "here"
    finally:
        await c.shutdown_async()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_utility_call_to_a_stalled_engine_gives_up_at_its_timeout(transport):
    """A stopped engine answers nothing: ``call_utility`` waited for the reply without
    bound (it took no timeout). Now it raises PeerNotProducingError naming the call at
    its timeout; once the engine goes on, its late reply is dropped and the next call
    gets its own."""
    c = SyncMPClient(cfg(transport))
    try:
        assert c.echo("bound") == "bound"
        with Stopped(c.engine_pid):
            t0 = time.monotonic()
            with pytest.raises(waiting.PeerNotProducingError, match="call to echo within 0.3 s"):
                c.call_utility("echo", "late", timeout=0.3)
            assert 0.3 <= time.monotonic() - t0 < 5
        assert c._futures == {}
        assert c.call_utility("echo", "next", timeout=30) == "next"
        assert c.echo("after") == "after"
        assert c._futures == {}
    finally:
        c.shutdown()


def test_a_utility_call_behind_a_full_request_ring_gives_up_unsent():
    """A stopped engine's request ring is full: the call's send waits for room, then
    raises PeerNotConsumingError within its timeout (the call was not sent)."""
    c = SyncMPClient(cfg(ring_capacity_bytes=1 << 14))
    try:
        with Stopped(c.engine_pid):
            with pytest.raises(waiting.PeerNotConsumingError):
                for i in range(10_000):  # the ring fills up
                    c.add_request(req(f"fill-{i}", max_tokens=1), timeout=0.05)
            t0 = time.monotonic()
            with pytest.raises(waiting.PeerNotConsumingError, match="was not sent"):
                c.call_utility("echo", "x", timeout=0.2)
            assert 0.2 <= time.monotonic() - t0 < 5
        assert c._futures == {}
        assert c.echo("after") == "after"
    finally:
        c.shutdown()


async def test_an_async_utility_call_to_a_stalled_engine_gives_up_at_its_timeout():
    """``call_utility_async(..., timeout=)``: PeerNotProducingError at the timeout, the
    loop free meanwhile, nothing left registered; a call cancelled while it waits, with a
    timeout or without, leaves nothing registered either (without, its entry stayed
    until a reply that a hung engine never sends); the late replies are dropped."""
    c = await AsyncMPClient.create(cfg())
    try:
        assert await c.echo_async("bound") == "bound"
        with Stopped(c.engine_pid):
            ticks = 0

            async def tick():
                nonlocal ticks
                while True:
                    await asyncio.sleep(0.01)
                    ticks += 1

            ticker = asyncio.ensure_future(tick())
            t0 = time.monotonic()
            with pytest.raises(waiting.PeerNotProducingError, match="call to echo within 0.3 s"):
                await c.call_utility_async("echo", "late", timeout=0.3)
            assert 0.3 <= time.monotonic() - t0 < 5
            ticker.cancel()
            assert ticks >= 3  # (the loop ran meanwhile)
            for timeout in (30, None):  # (None: as long as the engine lives)
                call = asyncio.ensure_future(c.call_utility_async("echo", "cancelled", timeout=timeout))
                await asyncio.sleep(0.05)
                call.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await call
                assert c._futures == {}, f"timeout={timeout}: the cancelled call stays registered"
        assert await c.call_utility_async("echo", "next", timeout=30) == "next"
        assert c._futures == {}
    finally:
        await c.shutdown_async()


@pytest.mark.parametrize("kind", ["inproc", "sync", "async"])
def test_a_utility_timeout_that_is_not_a_number_of_seconds_is_refused(kind):
    c = make_client(kind != "inproc", kind == "async", cfg())
    try:
        for bad in (-1, float("nan"), "1", True):
            with pytest.raises(InvalidRequestError, match=r"call_utility(_async)?\(\): timeout="):
                if kind == "async":
                    asyncio.run(c.call_utility_async("echo", 1, timeout=bad))
                else:
                    c.call_utility("echo", 1, timeout=bad)
        if kind == "inproc":
            assert c.call_utility("echo", 1, timeout=0) == 1
        else:
            assert c._futures == {}
    finally:
        c.shutdown()
