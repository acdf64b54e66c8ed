"""The ``vllm serve`` parent's channels for several API servers (no vLLM needed): each
engine and each API server finds its own, both sides of every channel attach, and the
launcher releases every handle once all have attached."""

from __future__ import annotations

import json
import os
import threading

import pytest

from shmclient.channel import ShmChannel
from shmclient.shm import Segment, make_pipe, parse_handle
from shmclient.vllm import wire
from shmclient.vllm.engine_link import entry_dropping_inherited
from shmclient.vllm.launch import _Rings
from shmclient.vllm.link import VLLM_MONITOR, _start_with_links, new_monitors, notify_attached, own_monitor

from .forked import in_child


@pytest.fixture
def rings(monkeypatch):
    monkeypatch.setenv("SHMCLIENT_VLLM_RING_BYTES", str(1 << 16))
    made = _Rings(api_servers=2, engines=[0, 1])
    yield made
    made.release()


def test_every_engine_gets_one_channel_per_api_server_and_every_api_server_one_per_engine(rings):
    with rings.in_environment():
        engines = {e: wire.decode_specs(os.environ[wire.ENV_SPEC], e) for e in (0, 1)}
        servers = {c: wire.decode_frontend_specs(os.environ[wire.ENV_FRONTEND_SPEC], c) for c in (0, 1)}
    assert wire.ENV_SPEC not in os.environ and wire.ENV_FRONTEND_SPEC not in os.environ
    for e, specs in engines.items():
        assert [(s.engine_index, s.client_index) for s in specs] == [(e, 0), (e, 1)]
        assert all(s.launcher_pid == os.getpid() and s.frontend_pid == 0 for s in specs)
    for c, specs in servers.items():
        assert [(s.engine_index, s.client_index) for s in specs] == [(0, c), (1, c)]
        for s in specs:  # the same channel as the engine's, from the other side
            mine = engines[s.engine_index][c].channel
            assert (s.channel.rx, s.channel.tx) == (mine.tx, mine.rx)
    pairs = {(s.engine_index, s.client_index) for specs in engines.values() for s in specs}
    assert len(pairs) == 4 and len({s.channel.rx.segment for specs in engines.values() for s in specs}) == 4


def test_the_handles_are_released_once_both_sides_of_every_channel_attached(rings):
    engine_specs, frontend_specs = rings.engine_specs, rings.frontend_specs
    thread = rings.release_when_attached()
    attached = []
    try:
        for spec in engine_specs + frontend_specs[:-1]:
            attached.append(ShmChannel.attach(spec.channel))
            notify_attached(spec.attached_pipe)
        thread.join(0.3)
        assert thread.is_alive()  # one side of one channel has not attached yet
        last = frontend_specs[-1]
        attached.append(ShmChannel.attach(last.channel))
        notify_attached(last.attached_pipe)
        thread.join(30)
        assert not thread.is_alive()
        with pytest.raises(FileNotFoundError):
            ShmChannel.attach(engine_specs[0].channel)
        # The channels live on between the sides that attached.
        from shmclient.channel import REQ_ABORT

        frontend, engine = attached[len(engine_specs)], attached[0]
        assert frontend_specs[0].engine_index == engine_specs[0].engine_index == 0
        assert frontend_specs[0].client_index == engine_specs[0].client_index == 0
        frontend.send_nowait(REQ_ABORT, frontend.encode(["r1"]))
        assert engine.recv_nowait() == [(REQ_ABORT, ["r1"])]
    finally:
        for channel in attached:
            channel.close()


def test_release_stops_the_waiting_thread_and_is_idempotent(rings):
    thread = rings.release_when_attached()
    rings.release()
    rings.release()
    thread.join(5)
    assert not thread.is_alive()
    with pytest.raises(FileNotFoundError):
        ShmChannel.attach(rings.engine_specs[0].channel)


def test_notify_attached_writes_one_byte_and_never_raises_for_a_launcher_that_is_gone():
    r, w = os.pipe()
    handle = f"pipe:{os.getpid()}:{w}:{os.fstat(w).st_ino}"
    try:
        notify_attached(handle)
        assert os.read(r, 16) == b"\x01"
    finally:
        os.close(r)
        os.close(w)
    notify_attached(handle)  # gone: nothing to tell
    notify_attached("")


def _open_files() -> "dict[int, str]":
    """fd -> what it is (its /proc link) in this process."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass
    return out


def _launch_files(handles: "list[str]") -> "list[str]":
    """This process's fds of the project's memfds or of a pipe ``handles`` name."""
    pipes = {f"pipe:[{parse_handle(h)[3]}]" for h in handles if h.startswith("pipe:")}
    if handles and handles[-1].startswith("other:"):  # (another client's pipe, by inode)
        pipes.add(f"pipe:[{handles[-1].split(':', 1)[1]}]")
    return sorted(f"{fd} {link}" for fd, link in _open_files().items()
                  if link.startswith("/memfd:shmc") or link in pipes)


@pytest.mark.parametrize("keep_specs", [False, True], ids=["coordinator", "engine-core"])
def test_a_process_forked_during_the_launch_drops_what_it_inherited_at_its_entry(rings, keep_specs):
    """vLLM forks the DP coordinator and (by default) the engine cores inside the launch:
    at their entry they close every inherited fd of the project's memfds (the launch's
    rings, arenas and parked pages, and any other segment of the launcher's, e.g. a
    second client's) and of the launch's pipes, both ends (the launcher's read ends too),
    and nothing else; then vLLM's entry runs with its arguments. An engine core keeps the
    specs and still attaches, through the launcher's /proc/<pid>/fd; the coordinator
    drops them."""
    env = rings.environment
    handles = wire.inherited_handles(env[wire.ENV_SPEC], env[wire.ENV_FRONTEND_SPEC])
    other = Segment.create(4096, prefix="shmc-t")  # not the launch's: another client's arena
    other_r, other_w, _ = make_pipe()  # and another client's wake pipe
    other_ino = os.fstat(other_r).st_ino
    handles = handles + [f"other:{other_ino}"]
    own_r, own_w = os.pipe()  # the launcher's own fd: kept
    engine_spec = rings.engine_specs[0].channel

    def stock(*args, **kwargs):
        attached = None
        if keep_specs:
            spec = wire.decode_specs(os.environ[wire.ENV_SPEC], 0)[0].channel
            assert spec == engine_spec
            ShmChannel.attach(spec).close()
            attached = True
        return json.dumps({"args": args, "kwargs": kwargs, "left": _launch_files(handles),
                           "specs": [v for v in (wire.ENV_SPEC, wire.ENV_FRONTEND_SPEC) if v in os.environ],
                           "own": own_w in _open_files(), "attached": attached})

    entry = entry_dropping_inherited(stock, keep_specs=keep_specs)
    assert entry_dropping_inherited(entry, keep_specs) is entry and entry.__qualname__ == stock.__qualname__
    try:
        with rings.in_environment():
            inherited = in_child(lambda: json.dumps(_launch_files(handles)))
            report = json.loads(in_child(lambda: entry(2, "addr", zmq_addr_pipe=None)))
    finally:
        for fd in (own_r, own_w, other_r, other_w):
            os.close(fd)
        other.release_handle()
        other.close()
    # What a plain fork holds: 2 x 2 channels' rings, arenas and parked pages, the
    # other client's arena, each ring's pipes (both ends), the "attached" pipe and the
    # other client's pipe.
    inherited = json.loads(inherited)
    assert sum("/memfd:" in f for f in inherited) >= 4 * 4 + 1 and sum("pipe:" in f for f in inherited) >= 2 * 4 + 2
    assert sum(f.endswith(f" pipe:[{other_ino}]") for f in inherited) == 2  # both ends
    assert report == {"args": [2, "addr"], "kwargs": {"zmq_addr_pipe": None}, "left": [],
                      "specs": [wire.ENV_SPEC, wire.ENV_FRONTEND_SPEC] if keep_specs else [], "own": True,
                      "attached": True if keep_specs else None}


def test_inherited_handles_names_none_for_no_or_foreign_values():
    assert wire.inherited_handles(None, "") == []
    assert wire.inherited_handles("not hex", "00") == []


class _FakeLink:
    def __init__(self, name: str) -> None:
        self.name = name

    def engine_spec(self) -> dict:
        return {"link": self.name}


def test_a_second_client_makes_its_links_only_once_the_first_has_started_its_engines():
    """Two clients made at once in one process: the second makes its channels only
    after the first's engines have started (an engine forked meanwhile would inherit
    them), and each construction sees its own specs in the environment."""
    first_running, first_may_end, second_made = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, "str | None"] = {}
    errors: list[BaseException] = []

    def start(name: str, made: "threading.Event | None", wait: "threading.Event | None",
              running: "threading.Event | None") -> None:
        links: list[_FakeLink] = []

        def make() -> None:
            links.append(_FakeLink(name))
            if made is not None:
                made.set()

        def construct() -> None:
            seen[name] = os.environ.get(wire.ENV_SPEC)
            if running is not None:
                running.set()
            if wait is not None:
                assert wait.wait(30)

        try:
            _start_with_links(links, make, construct)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    first = threading.Thread(target=start, args=("first", None, first_may_end, first_running))
    second = threading.Thread(target=start, args=("second", second_made, None, None))
    first.start()
    try:
        assert first_running.wait(30)
        second.start()
        assert not second_made.wait(0.3)  # waits for the first's start to end
    finally:
        first_may_end.set()
        first.join(30)
        if second.is_alive() or second.ident is not None:
            second.join(30)
    assert second_made.is_set() and errors == []
    assert {k: wire._decode(v, dict, "") for k, v in seen.items()} == {
        "first": [{"link": "first"}], "second": [{"link": "second"}]}
    assert wire.ENV_SPEC not in os.environ


def test_each_client_takes_its_own_engine_monitor_when_two_are_made_at_once():
    """vLLM's engine monitor thread of a client is the one the plug-in waits on before it
    shuts the client down (its engine died). Two clients made at once in one process
    each see both monitors start during their construction: each takes the one that
    watches its own engine manager (the first by name was the other's, for one of them),
    and the only one where none can be told."""
    from types import SimpleNamespace

    stop = threading.Event()
    managers = {"a": SimpleNamespace(), "b": SimpleNamespace()}
    started: dict[str, threading.Thread] = {}
    b_constructing, a_started, b_started = threading.Event(), threading.Event(), threading.Event()

    def start_monitor(name: str) -> None:
        manager = managers[name]

        def monitor_engine_cores() -> None:  # (vLLM's holds its engine manager)
            assert manager is not None and stop.wait(30)

        started[name] = threading.Thread(target=monitor_engine_cores, name=VLLM_MONITOR, daemon=True)
        started[name].start()

    def construct_a() -> None:
        assert b_constructing.wait(30)
        start_monitor("a")
        a_started.set()
        assert b_started.wait(30)

    def construct_b() -> None:
        b_constructing.set()
        assert a_started.wait(30)
        start_monitor("b")
        b_started.set()

    seen_by_b: list = []
    b = threading.Thread(target=lambda: seen_by_b.extend(new_monitors(construct_b)))
    b.start()
    try:
        seen_by_a = new_monitors(construct_a)
        b.join(30)
        assert set(seen_by_a) == set(seen_by_b) == set(started.values())
        assert seen_by_b[0] is started["a"]  # (what the first by name gave b)
        assert own_monitor(seen_by_a, managers["a"]) is started["a"]
        assert own_monitor(seen_by_b, managers["b"]) is started["b"]
        assert own_monitor(seen_by_b, object()) is None  # two, neither this client's
        assert own_monitor([started["b"]], managers["a"]) is None  # the only one, another's
        assert own_monitor([started["b"]], None) is None  # vLLM starts none without a manager
        assert own_monitor([], managers["a"]) is None  # vLLM started none
        silent = threading.Thread(target=stop.wait, args=(30,), name=VLLM_MONITOR)
        silent.start()  # (what its function holds cannot be read)
        started["silent"] = silent
        assert own_monitor([silent], managers["a"]) is silent  # the only one
        assert own_monitor([silent, started["b"]], managers["a"]) is None
    finally:
        stop.set()
        for t in (b, *started.values()):
            t.join(30)


def test_the_noted_pipes_are_pruned_of_closed_ones_as_they_grow(monkeypatch):
    """make_pipe notes every pipe it makes for ``drop_inherited``; once the notes reach
    their bound, those no longer open here go (a long-lived process making and closing
    channels keeps a bounded set)."""
    import shmclient.shm as shm

    monkeypatch.setattr(shm, "_made_pipes", set())
    monkeypatch.setattr(shm, "_PRUNE_AT", 4)
    made = [shm.make_pipe() for _ in range(4)]
    for r, w, _ in made[:3]:
        os.close(r)
        os.close(w)
    r, w, _ = shm.make_pipe()  # at the bound: the three closed ones go
    try:
        kept = {f"pipe:[{os.fstat(fd).st_ino}]" for fd in (made[3][0], r)}
        assert shm._made_pipes == kept
    finally:
        for fd in (made[3][0], made[3][1], r, w):
            os.close(fd)
