"""The vLLM engine's inline output path (no vLLM needed): small batches are written by the
thread that puts them, big ones by the output thread, and nothing overtakes what is
queued; in adaptive mode, while the host has no CPU free, a batch's wake-up waits until
the busy loop has handed the next step to vLLM's executor (or, without those hooks, the
batch goes to the output thread). Also: a failed attach to the engine's channels fails
every IO thread that asks for them."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from shmclient.vllm.engine_outputs import _InlineOutputs, _defer_wakes, _hook_adaptive
from shmclient.vllm.versions import Verdict
from shmclient.vllm import wire


class FakeLink:
    """Records what would be written to the ring, and by which thread."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, str]] = []
        self.held: list[bytes] = []  # sent with wake=False, wake-up not yet given
        self.woken: list[list[bytes]] = []  # what each owed wake-up covered
        self.framing = SimpleNamespace(encoder=SimpleNamespace(encode_into=self._encode), take_placed=list)
        self.drained = 0

    @staticmethod
    def _encode(outputs, buffer: bytearray) -> bytearray:
        buffer[:] = outputs.tag
        return buffer

    def send(self, rtype: int, payload, *, wake: bool = True, placed: list = ()) -> None:
        assert rtype == wire.OUTPUTS
        self.sent.append((bytes(payload), threading.current_thread().name))
        if wake:
            self.held.clear()  # a publish that wakes covers what was held
        else:
            self.held.append(bytes(payload))

    def wake_owed(self) -> None:
        if self.held:
            self.woken.append(self.held)
            self.held = []

    def drain(self, deadline: float) -> bool:  # nothing is ever kept back here
        self.drained += 1
        return True


class DeadSocket:
    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send(self, frame: bytes) -> None:
        self.sent.append(frame)


def batch(tag: bytes, n: int, client: int = 0) -> tuple[int, SimpleNamespace]:
    return client, SimpleNamespace(tag=tag, outputs=[None] * n, engine_index=None)


def test_small_batches_inline_big_ones_and_what_follows_through_the_output_thread():
    link = FakeLink()
    out = _InlineOutputs([link], engine_index=3, inline_max=4)
    me = threading.current_thread().name

    out.put_nowait(batch(b"a", 1))
    out.put_nowait(batch(b"b", 4))
    assert link.sent == [(b"a", me), (b"b", me)]  # written at once, by the putter

    out.put_nowait(batch(b"c", 5))   # big: queued for the output thread
    out.put_nowait(batch(b"d", 1))   # small, but c is not written yet: queued behind it
    out.put_nowait(b"DEAD")          # ENGINE_CORE_DEAD after both
    assert len(link.sent) == 2

    dead = DeadSocket()
    thread = threading.Thread(target=out.serve_queued, args=([dead],), name="output-thread")
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert link.sent[2:] == [(b"c", "output-thread"), (b"d", "output-thread")]
    assert dead.sent == [b"DEAD"]
    assert (out.inline, out.offloaded) == (2, 2)

    out.put_nowait(batch(b"e", 2))   # the queue is empty again: inline
    assert link.sent[-1] == (b"e", me)


def test_thread_mode_sends_engine_core_dead_after_what_full_rings_held_back():
    """Output mode "thread" (vLLM's own output queue): ENGINE_CORE_DEAD goes after the
    links are drained, as in the other modes. It went at once before, and a frontend
    that reads only what its ring holds once it sees DEAD lost what a full ring had kept
    back."""
    import queue

    link = FakeLink()
    out = _InlineOutputs([link], engine_index=2, inline_max=4)
    events: list = []
    link.drain = lambda deadline: events.append("drain") or True
    dead = DeadSocket()
    dead.send = events.append
    q: queue.Queue = queue.Queue()
    q.put(batch(b"a", 1))
    q.put(b"DEAD")
    out.serve_output_queue(q, b"DEAD", [dead])
    assert [tag for tag, _ in link.sent] == [b"a"]
    assert events == ["drain", b"DEAD"]


def test_every_batch_is_stamped_with_the_engine_index():
    link = FakeLink()
    out = _InlineOutputs([link], engine_index=7, inline_max=0)
    small, big = batch(b"x", 0), batch(b"y", 1)
    out.put_nowait(small)
    out.put_nowait(big)
    out.put_nowait(b"DEAD")
    out.serve_queued([DeadSocket()])
    assert small[1].engine_index == 7 and big[1].engine_index == 7
    assert [tag for tag, _ in link.sent] == [b"x", b"y"]


def test_coordinator_messages_go_to_the_output_thread_and_hold_no_output_back():
    """With data parallelism the engine also puts messages for the DP coordinator
    (client index -1): they go to the output thread (which owns the coordinator's socket),
    stamped with the engine index, and the frontend's small batches stay inline."""
    link = FakeLink()
    out = _InlineOutputs([link], engine_index=1, inline_max=4)
    me = threading.current_thread().name
    stats = SimpleNamespace(tag=b"stats", outputs=[], engine_index=None)

    out.put_nowait((-1, stats))
    out.put_nowait(batch(b"a", 1))
    assert link.sent == [(b"a", me)]  # not held behind the coordinator's message
    out.put_nowait(b"DEAD")

    to_coordinator: list[tuple[object, str]] = []
    thread = threading.Thread(
        target=out.serve_queued,
        args=([DeadSocket()], lambda o: to_coordinator.append((o, threading.current_thread().name))),
        name="output-thread")
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert to_coordinator == [(stats, "output-thread")] and stats.engine_index == 1
    assert link.sent == [(b"a", me)]  # nothing of it reached the frontend's ring


def test_outputs_go_to_the_ring_of_the_frontend_they_belong_to(caplog):
    """Several API servers: vLLM's client index picks the ring, inline and queued alike;
    an index this engine has no frontend for is dropped with an error (the other
    frontends keep being served), and ENGINE_CORE_DEAD goes to every frontend."""
    links = [FakeLink(), FakeLink()]
    out = _InlineOutputs(links, engine_index=0, inline_max=1)
    out.put_nowait(batch(b"a0", 1, client=0))
    out.put_nowait(batch(b"a1", 1, client=1))
    out.put_nowait(batch(b"big1", 2, client=1))  # queued
    out.put_nowait(batch(b"b0", 1, client=0))  # behind it
    with caplog.at_level("ERROR", logger="vllm.shmclient"):
        out.put_nowait(batch(b"lost", 1, client=2))
        out.put_nowait(b"DEAD")
        dead = [DeadSocket(), DeadSocket()]
        out.serve_queued(dead)
    assert [tag for tag, _ in links[0].sent] == [b"a0", b"b0"]
    assert [tag for tag, _ in links[1].sent] == [b"a1", b"big1"]
    assert "outputs for frontend 2 dropped" in caplog.text
    assert [d.sent for d in dead] == [[b"DEAD"], [b"DEAD"]]


class FakeGate:
    """Answers free_cpu from a list, and records the times it was asked at."""

    def __init__(self, answers: list[bool]) -> None:
        self.answers = list(answers)
        self.asked: list[float] = []

    def free_cpu(self, now: float) -> bool:
        self.asked.append(now)
        return self.answers.pop(0)


def test_adaptive_writes_inline_only_while_the_gate_finds_a_cpu_free():
    link = FakeLink()
    gate = FakeGate([True, False, True, True])
    out = _InlineOutputs([link], engine_index=0, inline_max=4, adaptive=True, gate=gate)
    me = threading.current_thread().name

    out.put_nowait(batch(b"a", 1))   # a CPU free: written at once
    out.put_nowait(batch(b"b", 1))   # none: to the output thread
    out.put_nowait(batch(b"c", 1))   # free again, but b is not written yet: queued behind it
    assert link.sent == [(b"a", me)]
    out.put_nowait(b"DEAD")
    thread = threading.Thread(target=out.serve_queued, args=([DeadSocket()],), name="output-thread")
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert link.sent[1:] == [(b"b", "output-thread"), (b"c", "output-thread")]
    assert (out.inline, out.offloaded) == (1, 2)
    out.put_nowait(batch(b"d", 1))   # free, nothing queued: inline
    assert link.sent[-1] == (b"d", me) and out.inline == 2
    assert len(gate.asked) == 4 and gate.asked == sorted(gate.asked)


def test_adaptive_sends_a_big_batch_to_the_output_thread_even_with_a_cpu_free():
    link = FakeLink()
    out = _InlineOutputs([link], engine_index=0, inline_max=2, adaptive=True, gate=FakeGate([True]))
    out.put_nowait(batch(b"big", 3))
    assert link.sent == []
    out.put_nowait(b"DEAD")
    out.serve_queued([DeadSocket()])
    assert [tag for tag, _ in link.sent] == [b"big"] and out.offloaded == 1


def test_inline_mode_does_not_ask_the_gate():
    link = FakeLink()
    out = _InlineOutputs([link], engine_index=0, inline_max=4, gate=FakeGate([]))  # would raise if asked
    out.put_nowait(batch(b"a", 1))
    assert [tag for tag, _ in link.sent] == [b"a"] and out.inline == 1


def _deferring(gate_answers: list[bool], *, step_follows=lambda: True, links: int = 1):
    links_ = [FakeLink() for _ in range(links)]
    out = _InlineOutputs(links_, engine_index=0, inline_max=4, adaptive=True, gate=FakeGate(gate_answers))
    out.step_follows = step_follows
    out.loop_thread = threading.get_ident()  # this thread is the busy loop
    return out, links_


def test_adaptive_with_the_hooks_writes_inline_and_holds_the_wake_up_while_no_cpu_is_free():
    out, (link,) = _deferring([False, False, True])
    me = threading.current_thread().name
    out.put_nowait(batch(b"a", 1))   # no CPU free: written here, wake-up held
    out.put_nowait(batch(b"b", 1))
    assert link.sent == [(b"a", me), (b"b", me)] and link.held == [b"a", b"b"]
    assert out.owing and (out.inline, out.deferred, out.offloaded) == (2, 2, 0)
    out.wake_owed()                  # the busy loop handed the next step over
    assert link.woken == [[b"a", b"b"]] and not out.owing
    out.wake_owed()                  # nothing owed: no second wake-up
    assert link.woken == [[b"a", b"b"]]
    out.put_nowait(batch(b"c", 1))   # a CPU free: woken at once
    assert link.held == [] and out.deferred == 2 and not out.owing


def test_no_wake_up_is_held_when_no_step_follows_or_for_a_utility_reply():
    follows = [False]
    out, (link,) = _deferring([False, False], step_follows=lambda: follows[0])
    out.put_nowait(batch(b"last", 1))  # the scheduler has nothing left: the loop may block
    assert link.sent[-1][0] == b"last" and link.held == [] and not out.owing
    follows[0] = True
    reply = SimpleNamespace(tag=b"util", outputs=[], engine_index=None, utility_output=object())
    out.put_nowait((0, reply))         # a utility's reply comes from outside a step
    assert link.sent[-1][0] == b"util" and link.held == [] and out.deferred == 0


def test_owed_wake_ups_go_to_every_frontend_that_has_one():
    out, links = _deferring([False, False], links=3)
    out.put_nowait(batch(b"a0", 1, client=0))
    out.put_nowait(batch(b"a2", 1, client=2))
    out.wake_owed()
    assert [link.woken for link in links] == [[[b"a0"]], [], [[b"a2"]]]


def test_a_big_batch_still_goes_to_the_output_thread_and_holds_nothing():
    out, (link,) = _deferring([])
    out.put_nowait(batch(b"big", 5))
    assert link.sent == [] and not out.owing
    out.put_nowait(b"DEAD")
    out.serve_queued([DeadSocket()])
    assert link.sent == [(b"big", threading.current_thread().name)] and link.held == []


class FakeScheduler:
    def __init__(self) -> None:
        self.requests = True
        self.log: list[str] = []

    def has_requests(self) -> bool:
        return self.requests


class FakeEngine:
    """What _defer_wakes hooks: the executor's execute_model and the busy loop's
    _process_input_queue, with has_work and the scheduler's has_requests."""

    def __init__(self, executor, log: list[str]) -> None:
        self.model_executor = executor
        self.scheduler = FakeScheduler()
        self.batch_queue = None
        self.work = True
        self.log = log

    def has_work(self) -> bool:
        return self.work

    def _process_input_queue(self) -> None:
        self.log.append("input")


class FakeExecutor:
    def __init__(self, log: list[str], multiproc: bool) -> None:
        self.log = log
        if multiproc:
            self.rpc_broadcast_mq = object()

    def execute_model(self, scheduler_output, non_block: bool = False):
        self.log.append(f"execute {scheduler_output}")
        return "future"


class LoggingOutputs(_InlineOutputs):
    def __init__(self, log: list[str]) -> None:
        super().__init__([FakeLink()], engine_index=0, inline_max=4, adaptive=True, gate=FakeGate([False] * 10))
        self.log = log
        self.loop_thread = threading.get_ident()  # this thread is the busy loop

    def wake_owed(self) -> None:
        if self.owing:
            self.log.append("wake")
        super().wake_owed()


@pytest.mark.parametrize("multiproc", [True, False])
def test_defer_wakes_gives_the_owed_wake_up_as_the_step_is_handed_over(multiproc):
    """vLLM's multiprocess executor returns a future once the step is on its way to the
    worker: the wake-up follows that call. Another executor may run the step inside the
    call: the wake-up goes just before it."""
    log: list[str] = []
    engine = FakeEngine(FakeExecutor(log, multiproc), log)
    out = LoggingOutputs(log)
    assert _defer_wakes(engine, out) is True
    assert out.step_follows == engine.scheduler.has_requests
    out.put_nowait(batch(b"a", 1))
    engine._process_input_queue()     # work to do: the loop goes on to step, no wake yet
    assert engine.model_executor.execute_model("step1", non_block=True) == "future"
    want = ["execute step1", "wake"] if multiproc else ["wake", "execute step1"]
    assert log == ["input"] + want
    log.clear()
    engine.model_executor.execute_model("step2", non_block=True)
    assert log == ["execute step2"]  # nothing owed: nothing given


def test_defer_wakes_gives_the_owed_wake_up_before_the_loop_may_block_for_input():
    log: list[str] = []
    engine = FakeEngine(FakeExecutor(log, True), log)
    out = LoggingOutputs(log)
    _defer_wakes(engine, out)
    out.put_nowait(batch(b"a", 1))
    engine.work = False               # e.g. the last request was aborted meanwhile
    engine._process_input_queue()
    assert log == ["wake", "input"]


def test_only_the_busy_loop_holds_a_wake_up_back():
    """The input thread puts error outputs too (a request that failed its checks): the
    busy loop may be blocked for input then, with no owed wake-up to come, so such a
    batch wakes its frontend at once; the busy loop (the thread that runs the hooked
    _process_input_queue) still holds its batches' wake-ups."""
    log: list[str] = []
    engine = FakeEngine(FakeExecutor(log, True), log)
    out = LoggingOutputs(log)
    out.loop_thread = None
    _defer_wakes(engine, out)
    engine._process_input_queue()     # the busy loop (this thread), now blocked for input
    link = out._links[0]

    def input_thread() -> None:
        out.put_nowait(batch(b"error", 1))

    thread = threading.Thread(target=input_thread, name="input-thread")
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert link.sent == [(b"error", "input-thread")] and link.held == [] and not out.owing
    assert out.deferred == 0
    out.put_nowait(batch(b"step", 1))  # the busy loop's own: held until the next step
    assert link.held == [b"step"] and out.owing and out.deferred == 1


def test_defer_wakes_hooks_nothing_where_a_step_need_not_follow_an_output():
    log: list[str] = []
    engine = FakeEngine(FakeExecutor(log, True), log)
    engine.batch_queue = object()     # several steps in flight (vLLM's async scheduling)
    out = LoggingOutputs(log)
    assert _defer_wakes(engine, out) is False
    assert out.step_follows is None and "execute_model" not in vars(engine.model_executor)
    bare = SimpleNamespace(model_executor=None, scheduler=None)  # a vLLM without them
    assert _defer_wakes(bare, LoggingOutputs(log)) is False
    out.put_nowait(batch(b"a", 1))    # no CPU free, no hooks: to the output thread
    assert out.offloaded == 0 and not out.empty()


def test_adaptive_hooks_only_a_busy_loop_it_knows(caplog):
    """A vLLM whose busy loop differs from every release the hooks were written against
    (``versions.check_adaptive``) is not hooked: one WARNING names what differs, and a
    batch that finds no CPU free goes to the output thread, its wake-up never held."""
    log: list[str] = []
    engine = FakeEngine(FakeExecutor(log, True), log)
    out = LoggingOutputs(log)
    differs = Verdict(False, "0.33", ["vllm.v1.engine.core.EngineCore.step"],
                      "vLLM 0.34.0's busy loop differs from vLLM 0.33's in vllm.v1.engine.core.EngineCore.step")
    with caplog.at_level("WARNING", logger="vllm.shmclient"):
        assert _hook_adaptive(engine, out, differs) is False
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "EngineCore.step" in warned[0] and "holds no wake-up back" in warned[0]
    assert out.step_follows is None and "execute_model" not in vars(engine.model_executor)
    assert "_process_input_queue" not in vars(engine)
    out.put_nowait(batch(b"a", 1))
    assert out.inline == 0 and not out.empty()  # queued for the output thread

    known = Verdict(True, "0.33", [], "vLLM 0.33.1's busy loop is as in vLLM 0.33")
    engine = FakeEngine(FakeExecutor(log, True), log)
    out = LoggingOutputs(log)
    caplog.clear()
    with caplog.at_level("INFO", logger="vllm.shmclient"):
        assert _hook_adaptive(engine, out, known) is True
    assert "wake-up waits for the next step (vLLM 0.33.1's busy loop is as in vLLM 0.33)" in caplog.text
    assert out.step_follows == engine.scheduler.has_requests
    out.put_nowait(batch(b"a", 1))
    assert out.deferred == 1 and out.empty()  # written here, its wake-up held


def test_adaptive_hooks_nothing_when_its_check_fails(caplog, monkeypatch):
    """The check of vLLM's busy loop failing (an unreadable source, anything) must not
    take the engine core down: no hooks, one WARNING saying why."""
    from shmclient.vllm import versions

    def broken(version):
        raise RuntimeError("source unreadable")

    monkeypatch.setattr(versions, "check_adaptive", broken)
    log: list[str] = []
    engine = FakeEngine(FakeExecutor(log, True), log)
    out = LoggingOutputs(log)
    with caplog.at_level("WARNING", logger="vllm.shmclient"):
        assert _hook_adaptive(engine, out) is False
    assert "could not be checked" in caplog.text and "holds no wake-up back" in caplog.text
    assert out.step_follows is None and "execute_model" not in vars(engine.model_executor)


def test_adaptive_on_a_batch_queue_writes_and_wakes_at_once(caplog):
    """An engine core stepping through a batch queue (vLLM's async scheduling) puts a
    step's outputs after it has handed the worker the next step: nothing is hooked, and
    a small batch is written by the busy loop and wakes its frontend at once, whatever
    the host's load (as output mode inline), instead of waiting for the output thread."""
    log: list[str] = []
    engine = FakeEngine(FakeExecutor(log, True), log)
    engine.batch_queue = object()
    out = LoggingOutputs(log)  # its gate would say: no CPU free
    known = Verdict(True, "0.33", [], "vLLM 0.33.0's busy loop is as in vLLM 0.33")
    with caplog.at_level("INFO", logger="vllm.shmclient"):
        assert _hook_adaptive(engine, out, known) is False
    assert "steps through a batch queue" in caplog.text and "at once" in caplog.text
    assert "execute_model" not in vars(engine.model_executor) and "_process_input_queue" not in vars(engine)
    out.put_nowait(batch(b"a", 1))
    link = out._links[0]
    assert out.inline == 1 and out.deferred == 0 and out.empty()
    assert link.sent == [(b"a", threading.current_thread().name)] and link.held == [] and not out.owing


@pytest.mark.parametrize("links", [1, 2])
def test_no_early_wake_while_the_outputs_wake_up_waits_for_the_next_step(links):
    """The early wake-up of a parked frontend (as the scheduler starts building a step's
    outputs) is skipped while the gate finds no CPU free and the outputs' own wake-up is
    held; with a CPU free it comes as before."""
    from shmclient.vllm.engine_outputs import _prewake_before_outputs

    woken: list[int] = []
    fake_links = [SimpleNamespace(prewake=lambda i=i: woken.append(i), active=True) for i in range(links)]
    gate = FakeGate([False, True])
    inline = _InlineOutputs(fake_links, engine_index=0, inline_max=4, adaptive=True, gate=gate)
    inline.step_follows = lambda: True
    engine = SimpleNamespace(scheduler=SimpleNamespace(update_from_output=lambda *a: "outputs"),
                             _shmclient_inline=inline)
    _prewake_before_outputs(engine, fake_links)
    assert engine.scheduler.update_from_output("so", "mo") == "outputs"
    assert woken == []               # no CPU free
    assert engine.scheduler.update_from_output("so", "mo") == "outputs"
    assert woken == list(range(links))


def test_engine_core_dead_gives_the_owed_wake_up_first():
    out, (link,) = _deferring([False])
    out.put_nowait(batch(b"a", 1))
    assert link.held == [b"a"]
    out.put_nowait(b"DEAD")
    assert link.woken == [[b"a"]] and not out.owing
    dead = DeadSocket()
    out.serve_queued([dead])
    assert dead.sent == [b"DEAD"]


def test_a_failed_attach_fails_every_later_caller_too(monkeypatch):
    """Both IO threads ask for the engine's channels; the environment is read once. When
    that attach fails, the other thread must not get [] (vLLM's sockets, half the
    engine's IO off the rings: the frontend would hang) but an error from it."""
    from shmclient.vllm import engine_link

    attached: list[object] = []

    class FailingLink:
        def __init__(self, spec) -> None:
            attached.append(spec)
            raise OSError("no such segment")

    monkeypatch.setattr(engine_link, "_state", None)
    monkeypatch.setattr(engine_link, "_looked", False)
    monkeypatch.setattr(engine_link, "_failed", None, raising=False)
    monkeypatch.setattr(engine_link, "_EngineLink", FailingLink)
    monkeypatch.setattr(wire, "decode_specs", lambda text, engine_index: ["spec"])
    monkeypatch.setenv(wire.ENV_SPEC, "specs")
    with pytest.raises(OSError, match="no such segment"):
        engine_link._links(0)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="could not be attached") as info:
            engine_link._links(0)
        assert isinstance(info.value.__cause__, OSError)
    assert attached == ["spec"]  # attached once
