"""What code written against vLLM's ``core_client.py`` relies on, pinned on every client
where it applies (InprocClient, SyncMPClient and AsyncMPClient, shm and zmq). Each test
is named after the vLLM behaviour it pins."""

from __future__ import annotations

import asyncio
import inspect
import math
import os
import signal
import threading
import time

import psutil
import pytest

from shmclient.config import EngineConfig
from shmclient import (
    AsyncMPClient,
    ConfigError,
    EngineDeadError,
    FinishReason,
    InprocClient,
    InvalidRequestError,
    SyncMPClient,
    UtilityCallError,
)
from shmclient import client as client_module

from . import fault_engine, user_utilities
from .conftest import sigstop
from .drivers import KINDS, Driver, build, req

MP_KINDS = tuple(k for k in KINDS if k != "inproc")

#: Steps of 10 ms (the mock's step_delay_s) stand in for a model's step time, so that a
#: request is still running when the next call arrives (InprocClient steps only inside
#: get_output, so there they only slow it down).
CFG = EngineConfig(
    model="mock", max_model_len=256, hidden_size=32, step_delay_s=0.01,
    utility_modules=(user_utilities.MODULE,),
)


@pytest.fixture(scope="module", params=KINDS)
def drv(request):
    client = build(request.param, CFG)
    yield Driver(request.param, client)
    client.shutdown()


async def _state(drv: Driver) -> dict:
    return await drv.call_utility("engine_state")


# ------------------------------------------------------------------ utilities


async def test_reset_prefix_cache_false_while_requests_run_true_when_they_are_reset(drv):
    # vLLM: reset_prefix_cache(reset_running_requests=False, reset_connector=False) fails
    # (False) while running requests hold KV blocks; reset_running_requests=True preempts
    # them (no token lost) and succeeds. Frozen with pause_scheduler("keep") so that the
    # request is surely running while the resets arrive.
    await drv.add(req("held", max_tokens=40, ignore_eos=True))
    first = await drv.get_output()
    assert [o.request_id for o in first.outputs] == ["held"]
    await drv.util("pause_scheduler", "keep", False)
    assert await drv.util("is_scheduler_paused") is True
    before = await _state(drv)
    assert before["paused"] == "PAUSED_ALL" and before["running"] == ["held"]
    assert await drv.util("reset_prefix_cache") is False
    assert await drv.util("reset_prefix_cache", False, True) is False
    after = await _state(drv)
    assert after["free_blocks"] == before["free_blocks"] and after["running"] == ["held"]
    assert await drv.util("reset_prefix_cache", True, True) is True
    reset = await _state(drv)
    assert reset["running"] == [] and reset["waiting"] == ["held"]
    assert reset["free_blocks"] == reset["num_gpu_blocks"]
    assert reset["preemptions"] == before["preemptions"] + 1
    await drv.util("resume_scheduler")
    assert await drv.util("is_scheduler_paused") is False
    res = await drv.collect(["held"])
    assert len(first.outputs[0].new_token_ids) + len(res["held"]["tokens"]) == 40
    assert res["held"]["reason"] == FinishReason.LENGTH
    with pytest.raises(UtilityCallError, match="Call to reset_prefix_cache method failed"):
        await drv.util("reset_prefix_cache", "yes")


async def test_pause_scheduler_queues_new_requests_until_resume_scheduler(drv):
    # vLLM's pause_scheduler_async / resume_scheduler_async / is_scheduler_paused_async:
    # a paused scheduler schedules nothing new; what was added meanwhile runs after resume.
    await drv.util("pause_scheduler")  # mode="abort", clear_cache=True
    assert await drv.util("is_scheduler_paused") is True
    await drv.add(req("queued", max_tokens=3))
    state = await _state(drv)
    assert state["paused"] == "PAUSED_NEW" and state["waiting"] == ["queued"]
    await drv.util("resume_scheduler")
    res = await drv.collect(["queued"])
    assert len(res["queued"]["tokens"]) == 3


async def test_profile_takes_is_start_and_profile_prefix(drv):
    # vLLM: profile(is_start=True, profile_prefix=None, delay_iterations, max_iterations).
    await drv.util("profile", True, "fidelity", None, 2)
    assert (await _state(drv))["profiling"] is True
    await drv.add(req("profiled", max_tokens=5))
    await drv.collect(["profiled"])
    state = await _state(drv)
    assert state["profiling"] is False  # stopped by itself after max_iterations
    assert state["last_profile"]["prefix"] == "fidelity"
    assert state["last_profile"]["steps"] == 2
    await drv.util("profile", True)
    await drv.util("profile", False)
    assert (await _state(drv))["last_profile"]["steps"] == 0
    with pytest.raises(UtilityCallError, match="profile_prefix must be a str"):
        await drv.util("profile", True, 7)


async def test_reset_mm_and_encoder_cache_and_weight_version(drv):
    # vLLM: reset_mm_cache() / reset_encoder_cache() return None; get_weight_version()
    # is "default" until set_weight_version(version).
    assert await drv.util("reset_mm_cache") is None
    assert await drv.util("reset_encoder_cache") is None
    assert await drv.util("get_weight_version") == "default"
    assert await drv.util("set_weight_version", "step-1200") is None
    assert await drv.util("get_weight_version") == "step-1200"
    with pytest.raises(UtilityCallError, match="weight_version must be a str"):
        await drv.util("set_weight_version", 3)


async def test_dp_engines_running_is_false_for_a_single_engine(drv):
    # vLLM's InprocClient and non-DP MP clients answer False, without an engine call.
    assert drv.client.dp_engines_running() is False


async def test_sleep_level_0_pauses_and_wake_up_scheduling_resumes(drv):
    # vLLM: level 0 pauses scheduling only; wake_up(["scheduling"]) resumes and returns
    # whether the engine is fully awake.
    await drv.util("sleep", 0)
    assert await drv.util("is_sleeping") is True
    assert await drv.util("wake_up", ["scheduling"]) is True
    assert await drv.util("is_sleeping") is False
    await drv.util("sleep", 1)
    assert await drv.util("wake_up", ["weights"]) is False
    assert await drv.util("wake_up") is True


async def test_release_kv_cache_memory_needs_a_completed_pause_and_wake_up_undoes_it(drv):
    # vLLM's: refused unless the scheduler is paused with no request left and nothing
    # asleep; then the engine sleeps on "kv_cache" until wake_up(["kv_cache"]), and a
    # request sent meanwhile runs after it.
    with pytest.raises(UtilityCallError, match="requires a completed pause"):
        await drv.util("release_kv_cache_memory")
    await drv.util("pause_scheduler", "abort")
    assert await drv.util("release_kv_cache_memory") is None
    assert await drv.util("is_sleeping") is True
    with pytest.raises(UtilityCallError, match="requires all executor memory to be resident"):
        await drv.util("release_kv_cache_memory")
    await drv.add(req("after-release", max_tokens=3))
    assert await drv.util("wake_up", ["kv_cache"]) is True
    assert await drv.util("is_sleeping") is False
    assert len((await drv.collect(["after-release"]))["after-release"]["tokens"]) == 3


async def test_sleep_wait_returns_after_in_flight_requests_finish(drv):
    # vLLM's mode="wait": the call returns once the running requests have finished;
    # in-process it raises ValueError (nothing steps the engine while the caller waits).
    if drv.is_inproc:
        for call in (lambda: drv.client.sleep(1, "wait"),
                     lambda: drv.client.pause_scheduler("wait"),
                     lambda: drv.client.call_utility("sleep", 1, "wait")):
            with pytest.raises(ValueError, match="in-process"):
                call()
        assert drv.client.is_sleeping() is False
        return
    await drv.add(req("in-flight", max_tokens=20))
    await drv.util("sleep", 1, "wait")
    assert await drv.util("is_sleeping") is True
    # Every token came before the reply: they are already here.
    got = []
    while len(got) < 20:
        out = await drv.get_output(timeout=1.0)
        got += [t for o in out.outputs for t in o.new_token_ids]
    assert len(got) == 20
    assert await drv.util("wake_up") is True
    await drv.add(req("after-wait", max_tokens=2))
    assert len((await drv.collect(["after-wait"]))["after-wait"]["tokens"]) == 2


def test_async_client_defines_every_utility_async_with_the_sync_signature():
    # vLLM's AsyncMPClient spells out pause_scheduler_async, reset_prefix_cache_async, ...;
    # type checkers and IDEs see them only if a class body writes them out (here the one
    # every async client shares), not if they are generated at run time.
    from shmclient.client import UTILITY_METHODS, SyncEngineCoreClient
    from shmclient.client_dp import DPAsyncMPClient
    from shmclient.client_utilities import AsyncUtilities

    assert issubclass(AsyncMPClient, AsyncUtilities) and issubclass(DPAsyncMPClient, AsyncUtilities)
    for name in UTILITY_METHODS:
        fn = AsyncUtilities.__dict__.get(f"{name}_async")
        assert fn is not None and inspect.iscoroutinefunction(fn), name
        want = inspect.signature(getattr(SyncEngineCoreClient, name)).parameters
        got = inspect.signature(fn).parameters
        assert [(p.name, p.default) for p in got.values()] == [
            (p.name, p.default) for p in want.values()], name


def test_async_client_has_no_blocking_method_that_raises():
    # vLLM's base class carries sync and async forms that raise NotImplementedError; here
    # the async client has the *_async forms only, so a blocking call is an AttributeError
    # a type checker sees, never a method that exists only to raise.
    from shmclient.client import UTILITY_METHODS

    for name in ("add_request", "get_output", "abort_requests", "call_utility", *UTILITY_METHODS):
        assert not hasattr(AsyncMPClient, name), name
    for name in ("shutdown", "shutdown_async", "__aenter__", "__aexit__", "create", "dp_engines_running"):
        assert hasattr(AsyncMPClient, name), name


def test_every_client_utility_is_one_the_engine_serves():
    from shmclient_engine.core import UTILITY_METHODS as ENGINE_UTILITIES
    from shmclient.client import UTILITY_METHODS

    assert set(UTILITY_METHODS) == set(ENGINE_UTILITIES)


# ------------------------------------------------------------------ user utilities


async def test_user_registered_utility_is_callable_through_call_utility(drv):
    # A method the user registered on the engine side (shmclient_engine.core.register_utility,
    # reaching the engine process through EngineConfig.utility_modules) is called like
    # vLLM's own utilities; failures read "Call to <method> method failed: <message>".
    assert await drv.call_utility("scale", [1.0, 2.5], 4.0) == [4.0, 10.0]
    state = await _state(drv)
    if not drv.is_inproc:
        assert state["pid"] == drv.client.engine_pid  # it ran in the engine process
    with pytest.raises(UtilityCallError) as ei:
        await drv.call_utility("fail_with", "not today")
    assert str(ei.value) == "Call to fail_with method failed: not today"
    with pytest.raises(UtilityCallError, match="Call to not_registered method failed"):
        await drv.call_utility("not_registered")
    assert await drv.util("echo", "still serving") == "still serving"
    await drv.add(req("after-user-utility", max_tokens=2))
    res = await drv.collect(["after-user-utility"])
    assert len(res["after-user-utility"]["tokens"]) == 2


async def test_utility_whose_result_cannot_be_sent_fails_that_call_alone(drv):
    # A result the wire cannot carry fails its call (UtilityCallError naming why), as a
    # utility that raises does; the engine goes on serving. (In-process nothing is
    # encoded: the object comes back as it is.)
    for later in (False, True):
        if drv.is_inproc:
            assert type(await drv.call_utility("unsendable", later)) is object
            continue
        with pytest.raises(UtilityCallError, match="Call to unsendable method failed: its result cannot be sent"):
            await drv.call_utility("unsendable", later)
    assert await drv.util("echo", "still serving") == "still serving"
    await drv.add(req("after-unsendable", max_tokens=2))
    res = await drv.collect(["after-unsendable"])
    assert len(res["after-unsendable"]["tokens"]) == 2


async def test_utility_failing_with_a_message_the_wire_cannot_carry_fails_that_call_alone(drv):
    # An exception's message with a lone surrogate (a file name as os.listdir gives it)
    # cannot be encoded as it is: the reply carries its backslash escape, and the engine
    # goes on serving (it died with a SerializationError).
    with pytest.raises(UtilityCallError) as ei:
        await drv.call_utility("fail_naming_a_file")
    name = "caf\udce9" if drv.is_inproc else "caf\\udce9"
    assert str(ei.value) == f"Call to fail_naming_a_file method failed: no model in {name}"
    assert await drv.util("echo", "still serving") == "still serving"
    await drv.add(req("after-surrogate", max_tokens=2))
    res = await drv.collect(["after-surrogate"])
    assert len(res["after-surrogate"]["tokens"]) == 2


async def test_utility_result_longer_than_a_message_fails_that_call_alone(drv):
    # Over what one message of the rings can carry (4 GiB; lowered here, in the engine
    # process, to 6 MiB: more than one record of the 4 MiB ring, so the message goes in
    # fragments): the call fails naming why, nothing of it was sent, the engine serves on.
    # ZMQ has no such limit, and in-process nothing is encoded.
    limit = 6 << 20
    try:
        if drv.kind.endswith("-shm"):
            with pytest.raises(UtilityCallError, match="Call to over_message_limit method failed: its result "
                                                       "cannot be sent to the client: payload of .* bytes is "
                                                       "larger than a message can carry"):
                await drv.call_utility("over_message_limit", limit)
        else:
            assert len(await drv.call_utility("over_message_limit", limit)) == 2 * limit
    finally:
        await drv.call_utility("restore_message_limit")
    assert await drv.util("echo", "still serving") == "still serving"
    await drv.add(req("after-too-long", max_tokens=2))
    res = await drv.collect(["after-too-long"])
    assert len(res["after-too-long"]["tokens"]) == 2


async def test_utility_returning_a_future_is_answered_when_it_completes(drv):
    # vLLM's engine answers a utility that returns a Future once the Future is done.
    assert await drv.call_utility("done_future", {"k": [1, 2]}) == {"k": [1, 2]}
    if drv.is_inproc:
        # Nothing would ever complete it in-process: a failed call, not a hang.
        with pytest.raises(UtilityCallError, match="Call to never_done_future method failed"):
            await drv.call_utility("never_done_future")
        assert await drv.util("echo", 2) == 2


def test_utility_registered_only_in_the_frontend_is_unknown_to_the_engine_process():
    # The engine runs in a fresh interpreter: registering in this process (this module
    # imported user_utilities) is not enough without EngineConfig.utility_modules.
    c = SyncMPClient(CFG.replace(transport="zmq", utility_modules=(), step_delay_s=0.0))
    try:
        with pytest.raises(UtilityCallError, match="unknown utility method 'scale'"):
            c.call_utility("scale", [1.0])
        assert c.echo(1) == 1
    finally:
        c.shutdown()


@pytest.mark.parametrize("kind", ["inproc", "sync-shm", "async-zmq"])
def test_utility_module_that_does_not_import_is_a_config_error(kind):
    with pytest.raises(ConfigError, match="utility_modules: cannot import 'tests.no_such_mod'"):
        build(kind, CFG.replace(utility_modules=("tests.no_such_mod",), step_delay_s=0.0))


# ------------------------------------------------------------------ engine death


@pytest.mark.parametrize("kind", MP_KINDS)
async def test_outputs_written_before_engine_death_are_delivered_before_engine_dead_error(
        kind, monkeypatch):
    # vLLM's death notice queues behind the outputs: whatever the engine wrote before it
    # died reaches get_output() first, then EngineDeadError.
    client = build(kind, EngineConfig(model="mock", max_model_len=256,
                                      **fault_engine.inject(monkeypatch, "raise_in_step:6")))
    d = Driver(kind, client)
    try:
        await d.add(req("doomed", max_tokens=50))
        # Steps 1-5 write one output each; step 6 raises. Wait for the death before
        # reading anything (blocking this loop too, so that nothing is read earlier).
        assert client.resources.dead.wait(30)
        tokens = []
        with pytest.raises(EngineDeadError, match="injected fault in step 6"):
            for _ in range(10):
                out = await d.get_output(timeout=10)
                tokens += [t for o in out.outputs for t in o.new_token_ids]
        assert len(tokens) == 5
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError):
            await d.get_output(timeout=10)
        assert time.monotonic() - t0 < 0.5
    finally:
        client.shutdown()


# ------------------------------------------------------------------ shutdown


def test_shutdown_timeout_defaults_to_a_finite_value_on_every_client():
    # vLLM: shutdown(timeout=None) means a default, never "wait forever".
    for cls in (InprocClient, SyncMPClient, AsyncMPClient):
        assert inspect.signature(cls.shutdown).parameters["timeout"].default is None
    assert math.isfinite(client_module.DEFAULT_SHUTDOWN_TIMEOUT_S)
    assert client_module.shutdown_timeout(None) == client_module.DEFAULT_SHUTDOWN_TIMEOUT_S
    for bad in (-1, float("inf"), float("nan"), "5", True):
        with pytest.raises(InvalidRequestError, match="timeout"):
            client_module.shutdown_timeout(bad)
    c = build("inproc", CFG)
    with pytest.raises(InvalidRequestError, match="timeout"):
        c.shutdown(timeout=-1)
    c.shutdown()


@pytest.mark.parametrize("timeout", [1e300, 10**400])
def test_shutdown_with_a_timeout_of_centuries_stops_the_engine(timeout):
    """A timeout past what a thread's wait takes raised OverflowError from the wait
    (the engine stopped all the same), or, for an int past any float, from the check."""
    c = build("sync-shm", CFG)
    pid = c.engine_pid
    c.shutdown(timeout=timeout)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


@pytest.mark.parametrize(
    "kind", [k if k == "sync-shm" else pytest.param(k, marks=pytest.mark.slow) for k in MP_KINDS])
def test_shutdown_with_default_timeout_never_waits_forever_on_a_hung_engine(kind, monkeypatch):
    # A SIGSTOPped engine answers nothing and ignores SIGTERM: shutdown() with the
    # default timeout (shortened here) must still return, after SIGKILL, in bounded time.
    monkeypatch.setattr(client_module, "DEFAULT_SHUTDOWN_TIMEOUT_S", 0.3)
    client = build(kind, EngineConfig(model="mock", max_model_len=256))
    pid = client.engine_pid
    sigstop(pid)
    args = {} if kind.startswith("sync") else {"timeout": None}
    t = threading.Thread(target=client.shutdown, kwargs=args)
    t0 = time.monotonic()
    t.start()
    t.join(0.3 + 2.0 + 3.0)
    elapsed = time.monotonic() - t0
    if t.is_alive():  # the bug: free it, then fail
        os.kill(pid, signal.SIGKILL)
        t.join(10)
        pytest.fail(f"shutdown() still waiting after {elapsed:.1f} s on a hung engine")
    assert elapsed < 0.3 + 2.0 + 3.0
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
