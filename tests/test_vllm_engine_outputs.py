"""The vLLM engine's inline output path (no vLLM needed): small batches are written by the
thread that puts them, big ones by the output thread, and nothing overtakes what is
queued; in adaptive mode, batches go to the output thread too while the host has no CPU
free."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from shmclient.vllm.engine_outputs import _InlineOutputs
from shmclient.vllm import wire


class FakeLink:
    """Records what would be written to the ring, and by which thread."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, str]] = []
        self.framing = SimpleNamespace(encoder=SimpleNamespace(encode_into=self._encode))

    @staticmethod
    def _encode(outputs, buffer: bytearray) -> bytearray:
        buffer[:] = outputs.tag
        return buffer

    def send(self, rtype: int, payload) -> None:
        assert rtype == wire.OUTPUTS
        self.sent.append((bytes(payload), threading.current_thread().name))


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
