"""Hardening against a hostile or broken peer: tensor handles and dtype names from the wire
are validated (one bad message fails alone), shared memory is sealed and checked, and
every reservation is checked against the memory the process may still use."""

from __future__ import annotations

import re
import struct
import subprocess
import time
import sys

import msgspec
import pytest
import torch

from shmclient import EngineCoreRequest, FinishReason, SerializationError, client_mp, waiting
from shmclient.channel import REQ_ADD, BadMessage, ShmChannel
from shmclient.codec import EXT_NUMPY, EXT_TORCH, Decoder
from shmclient.config import EngineConfig
from shmclient.tensors import ARENA, ONE_OFF

from .drivers import Driver, build, req
from .forked import in_child

CFG = EngineConfig(model="mock", max_model_len=256, hidden_size=32, vocab_size=1024)


def ext(code: int, header: list, raw: bytes = b"") -> msgspec.msgpack.Ext:
    hdr = msgspec.msgpack.encode(header)
    return msgspec.msgpack.Ext(code, struct.pack("<H", len(hdr)) + hdr + raw)


BAD_HANDLES = [
    ("bid-str", [ARENA, "x", 0]),
    ("bid-neg", [ARENA, -1, 0]),
    ("bid-zero", [ARENA, 0, 0]),
    ("bid-float", [ARENA, 1.5, 0]),
    ("bid-none", [ARENA, None, 0]),
    ("offset-outside", [ARENA, 7, 1 << 40]),
    ("offset-negative", [ARENA, 7, -256]),
    ("offset-unaligned", [ARENA, 7, 3]),
    ("offset-str", [ARENA, 7, "0"]),
    ("short", [ARENA, 7]),
    ("long", [ARENA, 7, 0, 0]),
    ("kind-unknown", [9, 7, 0]),
    ("oneoff-not-str", [ONE_OFF, 7, 12]),
    ("oneoff-bad-name", [ONE_OFF, 7, "memfd:x:y:z"]),
]

BAD_HEADERS = [
    ("dtype-inductor", EXT_TORCH, ["_inductor", [4], None, None]),
    ("dtype-module", EXT_TORCH, ["nn", [4], None, None]),
    ("dtype-quantized", EXT_TORCH, ["qint8", [4], None, None]),
    ("dtype-int", EXT_TORCH, [5, [4], None, None]),
    ("np-object", EXT_NUMPY, ["|O", [4], None, None]),
    ("np-structured", EXT_NUMPY, ["i4,i4", [4], None, None]),
    ("np-subarray", EXT_NUMPY, ["(2,)<i4", [4], None, None]),
    ("np-void", EXT_NUMPY, ["|V8", [4], None, None]),
    ("np-zero-width", EXT_NUMPY, ["|S0", [1 << 40], None, None]),  # (a ValueError before)
    ("shape-negative", EXT_TORCH, ["float32", [-1], None, None]),
    ("shape-float", EXT_TORCH, ["float32", [1.5], None, None]),
    ("shape-huge", EXT_TORCH, ["float32", [1 << 40, 1 << 40], [ARENA, 7, 0], None]),
    ("shape-not-list", EXT_TORCH, ["float32", 4, None, None]),
    ("shape-empty-huge", EXT_TORCH, ["float32", [0, 1 << 40, 1 << 40], None, None]),
    ("np-shape-empty-huge", EXT_NUMPY, ["<f4", [0, 1 << 40, 1 << 40], None, None]),
    ("header-short", EXT_TORCH, ["float32", [4]]),
    ("header-not-list", EXT_TORCH, {"a": 1}),
]


@pytest.fixture
def shm_pair():
    front, spec = ShmChannel.create(
        ring_capacity=1 << 16, arena_bytes=1 << 20, spin_us=0.0, wake_fd=False
    )
    engine = ShmChannel.attach(spec)
    front.peer_attached()
    yield front, engine
    engine.close()
    front.close()


def test_bad_tensor_handles_and_headers_fail_alone_and_releases_still_go(shm_pair):
    """S7/S8: each bad handle or header is a BadMessage for that message alone; nothing
    bad is queued for release, so the next send (which carries releases) still works."""
    front, engine = shm_pair
    cases = [(n, ext(EXT_TORCH, ["float32", [64], h, None])) for n, h in BAD_HANDLES]
    cases += [(n, ext(c, h)) for n, c, h in BAD_HEADERS]
    for name, value in cases:
        payload = msgspec.msgpack.encode(EngineCoreRequest(request_id=name, prompt_embeds=value))
        waiting.send(front, REQ_ADD, payload, timeout=5.0)
        (rtype, bad), = waiting.recv(engine, timeout=5.0)
        assert type(bad) is BadMessage, name
        assert bad.field("request_id") == name
        # releases (if any were queued) ride ahead of the next message: must not raise
        engine.flush_releases()
    good = torch.randn(64, 32)
    waiting.send(front, REQ_ADD, front.encode(EngineCoreRequest(request_id="ok", prompt_embeds=good)),
                 timeout=5.0)
    (_, obj), = waiting.recv(engine, timeout=5.0)
    assert torch.equal(obj.prompt_embeds, good)


def test_dtype_name_from_the_wire_never_imports_a_torch_submodule():
    """S8: naming a lazily imported torch submodule as a dtype must not import it."""
    code = (
        "import sys, struct, msgspec, torch\n"
        "from shmclient.codec import Decoder, EXT_TORCH\n"
        "from shmclient.errors import SerializationError\n"
        "assert 'torch._inductor' not in sys.modules\n"
        "hdr = msgspec.msgpack.encode(['_inductor', [1], None, None])\n"
        "buf = msgspec.msgpack.encode(msgspec.msgpack.Ext(EXT_TORCH, struct.pack('<H', len(hdr)) + hdr + b'x'))\n"
        "try:\n"
        "    Decoder().decode(buf)\n"
        "except SerializationError:\n"
        "    pass\n"
        "print('torch._inductor' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("code, dtype", [(EXT_TORCH, "float32"), (EXT_NUMPY, "<f4")])
def test_decoder_refuses_an_empty_tensor_whose_strides_overflow_with_a_typed_error(code, dtype):
    """A shape with a 0 has no bytes, but its other dimensions still give the strides:
    over the size bound they are refused by name, not left to torch's or numpy's
    overflow errors."""
    hdr = msgspec.msgpack.encode([dtype, [0, 1 << 40, 1 << 40], None, None])
    buf = msgspec.msgpack.encode(msgspec.msgpack.Ext(code, struct.pack("<H", len(hdr)) + hdr))
    with pytest.raises(SerializationError, match=re.escape("[0, 1099511627776, 1099511627776] is over 2**48 bytes")):
        Decoder().decode(buf)


@pytest.mark.parametrize("code, dtype", [(EXT_TORCH, "_inductor"), (EXT_NUMPY, "|S0"), (EXT_NUMPY, "<U0")])
def test_decoder_refuses_bad_dtype_with_a_typed_error(code, dtype):
    # (a zero-width numpy dtype, which the encoder never sends, escaped as a ValueError)
    hdr = msgspec.msgpack.encode([dtype, [1 << 40], None, None])
    buf = msgspec.msgpack.encode(msgspec.msgpack.Ext(code, struct.pack("<H", len(hdr)) + hdr))
    with pytest.raises(SerializationError, match="dtype"):
        Decoder().decode(buf)


@pytest.fixture
def no_door(monkeypatch):
    monkeypatch.setattr(client_mp, "check_request", lambda *a, **k: None)


@pytest.mark.parametrize("kind", ["sync-shm"])
async def test_engine_keeps_serving_after_requests_with_bad_tensor_handles(kind, no_door):
    """S7 end to end: requests whose tensor handles are malformed finish with ERROR; the
    engine does not die (it used to stop with ENGINE_CORE_DEAD on the next send)."""
    client = build(kind, CFG)
    try:
        drv = Driver(kind, client)
        ids = []
        for name, h in BAD_HANDLES[:6]:
            await drv.add(EngineCoreRequest(request_id=name, prompt_embeds=ext(
                EXT_TORCH, ["float32", [4, 32], h, None])))
            ids.append(name)
        await drv.add(req("good-after-bad", max_tokens=4))
        res = await drv.collect([*ids, "good-after-bad"], timeout=60.0)
        for name in ids:
            assert res[name]["reason"] is FinishReason.ERROR, name
        assert res["good-after-bad"]["reason"] is FinishReason.LENGTH
        assert await drv.util("echo", "still serving") == "still serving"
        assert not client.is_dead
    finally:
        client.shutdown()


# ----------------------------------------------------------------- memory limits

MiB = 1 << 20
GiB = 1 << 30
MEMCG_ROOT = "/sys/fs/cgroup/memory"


def memfd_bytes(prefix: str = "/memfd:shmc") -> dict[str, int]:
    """Shared memory this process's memfd mappings hold (allocated, whether or not
    mapped in yet), per mapped range: the memfd's blocks, read through
    /proc/self/map_files (the fds themselves may be closed)."""
    import os

    out: dict[str, int] = {}
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) > 5 and parts[5].startswith(prefix):
                try:
                    st = os.stat(f"/proc/self/map_files/{parts[0]}")
                except OSError:
                    continue
                out[f"{parts[5]}@{parts[0]}"] = st.st_blocks * 512
    return out


def _served(client, rid: str) -> None:
    while not any(o.request_id == rid and o.finished for o in client.get_output(timeout=30).outputs):
        pass


def test_a_forked_child_holds_none_of_its_parents_shared_memory():
    """A worker forked while a client lives (multiprocessing's default start on Linux)
    kept the client's rings and tensor arenas mapped for its whole life (136 MiB with
    the defaults), also after the parent's shutdown. It maps none of them now, and the
    parent's client goes on being served."""
    client = build("sync-shm", CFG)
    try:
        embeds = torch.randn(200, CFG.hidden_size)  # 25 KiB: reserves the request arena
        client.add_request(EngineCoreRequest(request_id="e", prompt_embeds=embeds,
                                             sampling_params=req("e", max_tokens=2).sampling_params))
        _served(client, "e")
        assert any(k.startswith("/memfd:shmc-t") for k in memfd_bytes())
        assert any(not k.startswith("/memfd:shmc-t") for k in memfd_bytes())
        report = in_child(lambda: repr(sorted(memfd_bytes())))
        assert report == "[]", f"the child still maps {report}"
        client.add_request(req("after", max_tokens=2))
        _served(client, "after")
    finally:
        client.shutdown()


def test_fresh_client_holds_only_its_rings_and_an_arena_is_reserved_on_first_use():
    """A client that never sends a tensor never holds its tensor arenas' memory: they
    are reserved by their sender on the first tensor that goes through one."""
    config = CFG.replace(ring_capacity_bytes=4 * MiB, tensor_arena_bytes=64 * MiB)
    client = build("sync-shm", config)
    try:
        rss = memfd_bytes()
        arenas = sum(v for k, v in rss.items() if k.startswith("/memfd:shmc-t"))
        rings = sum(v for k, v in rss.items() if not k.startswith("/memfd:shmc-t"))
        assert arenas == 0, rss
        assert 0 < rings <= 2 * (4 * MiB + 64 * 1024), rss
        embeds = torch.randn(200, CFG.hidden_size)  # 25 KiB: through the request arena
        client.add_request(EngineCoreRequest(request_id="e", prompt_embeds=embeds,
                                             sampling_params=req("x").sampling_params))
        arenas = sum(v for k, v in memfd_bytes().items() if k.startswith("/memfd:shmc-t"))
        assert arenas >= 64 * MiB
    finally:
        client.shutdown()


def test_memory_limits_read_cgroup_v1_v2_and_meminfo(tmp_path):
    from shmclient.shm import memory_limits

    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text("MemTotal: 100 kB\nMemAvailable:   1000 kB\n")
    (proc / "self" / "cgroup").write_text("4:memory:/a/b\n0::/x/y\n")
    root = tmp_path / "cg"
    v1 = root / "memory" / "a" / "b"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text("5000\n")
    (v1 / "memory.usage_in_bytes").write_text("3000\n")
    (v1 / "memory.stat").write_text("cache 10\nhierarchical_memory_limit 4000\ntotal_inactive_file 500\n")
    v2 = root / "x" / "y"
    v2.mkdir(parents=True)
    (v2 / "memory.max").write_text("max\n")
    (root / "x" / "memory.max").write_text("9000\n")
    (root / "x" / "memory.current").write_text("2000\n")
    (root / "x" / "memory.stat").write_text("anon 1\ninactive_file 1000\n")
    limits = memory_limits(str(proc), str(root))
    free = sorted(b for b, _ in limits)
    assert free == [1500, 8000, 1024000], limits
    assert any("memory.limit_in_bytes=4000" in w for _, w in limits)


def test_memory_limits_read_a_containers_own_cgroup_at_the_mount_root(tmp_path):
    """In a container the process's cgroup is the mount's root: v2 with a private cgroup
    namespace reads "0::/", v1 names a path of the host's tree that the container's
    mount does not have. The limit is then the root's, not none."""
    from shmclient.shm import memory_limits

    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text("MemAvailable:   1000000 kB\n")
    root = tmp_path / "v2"
    root.mkdir()
    (root / "cgroup.controllers").write_text("memory\n")
    (root / "memory.max").write_text("9000\n")
    (root / "memory.current").write_text("2000\n")
    (proc / "self" / "cgroup").write_text("0::/\n")
    assert sorted(b for b, _ in memory_limits(str(proc), str(root))) == [7000, 1024000000]
    root = tmp_path / "v1"
    (root / "memory").mkdir(parents=True)
    (root / "memory" / "memory.limit_in_bytes").write_text("5000\n")
    (root / "memory" / "memory.usage_in_bytes").write_text("1000\n")
    (proc / "self" / "cgroup").write_text("4:memory:/docker/0123abcd\n")
    assert sorted(b for b, _ in memory_limits(str(proc), str(root))) == [4000, 1024000000]


@pytest.fixture
def memcg():
    """A memory cgroup of 1.5 GiB (v1) for a child process; removed afterwards."""
    import os

    if os.geteuid() != 0 or not os.access(MEMCG_ROOT, os.W_OK):
        pytest.skip("needs root and a writable cgroup v1 memory hierarchy")
    with open("/proc/meminfo") as f:
        avail = next(int(l.split()[1]) * 1024 for l in f if l.startswith("MemAvailable:"))
    if avail < 4 * GiB:
        pytest.skip("not enough free memory on this host for a 1.5 GiB cgroup")
    path = f"{MEMCG_ROOT}/shmc-test-{os.getpid()}"
    os.mkdir(path)
    try:
        with open(f"{path}/memory.limit_in_bytes", "w") as f:
            f.write(str(3 * GiB // 2))
        yield path
    finally:
        os.rmdir(path)  # the child has exited: the cgroup is empty


MEMCG_CHILD = r"""
import json, sys, torch
from shmclient import make_client
from shmclient.config import EngineConfig
from shmclient.errors import ShmCapacityError
from shmclient.shm import Segment
from shmclient.tensors import ShmTensorSender

res = {}
def attempt(key, fn):
    try:
        fn()
        res[key] = "ok"
    except ShmCapacityError as e:
        res[key] = "ShmCapacityError: " + str(e)

attempt("segment", lambda: Segment.create(2 << 30).close())
attempt("ring", lambda: make_client(True, False, EngineConfig(ring_capacity_bytes=2 << 30)))
attempt("ring64", lambda: make_client(True, False, EngineConfig(ring_capacity_bytes=64 << 30)))
sender = ShmTensorSender(Segment.create(2 << 30, prefix="shmc-t", reserve=False))
h = sender.put(torch.ones(1 << 18), 1 << 20)
res["arena_growth"] = h[0] if h else None
sender.close()
attempt("small", lambda: Segment.create(64 << 20).close())
print(json.dumps(res))
"""


def test_reservations_that_do_not_fit_a_cgroup_raise_instead_of_oom_kill(memcg):
    """Under a 1.5 GiB memory cgroup, reserving 2 GiB (a segment, a channel's rings, a
    64 GiB ring, an arena's lazy reservation) fails with ShmCapacityError naming the
    bytes and the limit, where it used to get the process OOM-killed."""
    import json

    def enter():
        with open(f"{memcg}/cgroup.procs", "w") as f:
            f.write("0")  # this (forked) process

    out = subprocess.run([sys.executable, "-c", MEMCG_CHILD], capture_output=True, text=True,
                         timeout=120, preexec_fn=enter)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    res = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("segment", "ring", "ring64"):
        assert res[key].startswith("ShmCapacityError"), res
        assert "bytes are free under" in res[key], res
    for key in ("segment", "ring"):  # (64 GiB is over the host's MemAvailable first)
        assert "memory.limit_in_bytes=1610612736" in res[key], res
    assert "2147483648" in res["segment"] or "2147549184" in res["segment"]
    assert res["arena_growth"] == ONE_OFF  # the arena did not fit: a one-off took it
    assert res["small"] == "ok"


# ----------------------------------------------------------------- sealing, fds


def fd_links(pid: int) -> list[str]:
    import os

    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass
    return out


def test_segments_are_sealed_against_truncation_by_any_holder():
    """S4: an ftruncate by the creator or by a process that opened the segment through
    /proc fails with EPERM (it used to SIGBUS the peer's mapping)."""
    import errno
    import os

    from shmclient.shm import Segment, open_handle

    for reserve in (True, False):
        seg = Segment.create(1 << 20, reserve=reserve)
        other = open_handle(seg.name)
        try:
            for fd in (seg.fd, other):
                for size in (0, 4096, 2 << 20):
                    with pytest.raises(OSError) as e:
                        os.ftruncate(fd, size)
                    assert e.value.errno == errno.EPERM
            assert os.fstat(seg.fd).st_size == 1 << 20
        finally:
            os.close(other)
            seg.release_handle()
            seg.close()


def test_after_start_up_neither_side_holds_a_segment_fd():
    """S4: once the engine has attached, no segment is reachable through /proc/<pid>/fd
    of the frontend or the engine (the engine closes the fds it inherited)."""
    import os

    client = build("sync-shm", CFG)
    try:
        engine_pid = client.resources.proc.pid
        for pid in (os.getpid(), engine_pid):
            memfds = [l for l in fd_links(pid) if l.startswith("/memfd:")]
            assert memfds == [], (pid, memfds)
    finally:
        client.shutdown()


# ----------------------------------------------------------------- one-off handles


def oneoff_request(name: str, handle: str, nbytes: int = 4096) -> bytes:
    value = ext(EXT_TORCH, ["uint8", [nbytes], [ONE_OFF, 7, handle], None])
    return msgspec.msgpack.encode(EngineCoreRequest(request_id=name, prompt_embeds=value))


def test_one_off_handle_must_name_a_sealed_memfd_of_the_peer(shm_pair, tmp_path):
    """S5: a one-off handle naming a regular file, an unsealed memfd, or a sealed memfd
    of a process that is not the peer is refused for that message alone; the file is
    never mapped (it used to be mapped read-write MAP_SHARED)."""
    import os

    from shmclient.shm import Segment

    front, engine = shm_pair
    path = tmp_path / "victim"
    path.write_bytes(b"\0" * 4096)
    victim = os.open(path, os.O_RDWR)
    plain = os.memfd_create("shmc-plain", os.MFD_CLOEXEC)
    os.ftruncate(plain, 4096)
    sealed = Segment.create(4096)
    try:
        me = os.getpid()
        cases = {
            "regular-file": f"memfd:{me}:{victim}:{os.fstat(victim).st_ino}",
            "unsealed-memfd": f"memfd:{me}:{plain}:{os.fstat(plain).st_ino}",
            "wrong-inode": f"memfd:{me}:{sealed.fd}:{os.fstat(sealed.fd).st_ino + 1}",
            "pipe-kind": f"pipe:{me}:{sealed.fd}:{os.fstat(sealed.fd).st_ino}",
        }
        for name, handle in cases.items():
            waiting.send(front, REQ_ADD, oneoff_request(name, handle), timeout=5.0)
            (_, bad), = waiting.recv(engine, timeout=5.0)
            assert type(bad) is BadMessage, name
            assert bad.field("request_id") == name
        # a sealed memfd, but of a process that is not the peer
        engine.set_peer_pid(me + 1_000_000)
        waiting.send(front, REQ_ADD, oneoff_request("not-peer", sealed.name), timeout=5.0)
        (_, bad), = waiting.recv(engine, timeout=5.0)
        assert type(bad) is BadMessage and "not a segment of the peer" in bad.error
        # the peer's sealed memfd opens; a write to what was received stays private
        engine.set_peer_pid(me)
        sealed.buf[:4] = b"abcd"
        waiting.send(front, REQ_ADD, oneoff_request("good", sealed.name), timeout=5.0)
        (_, got), = waiting.recv(engine, timeout=5.0)
        t = got.prompt_embeds
        assert bytes(t[:4].numpy()) == b"abcd"
        t[:4] = 0
        assert bytes(sealed.buf[:4]) == b"abcd"
        assert path.read_bytes() == b"\0" * 4096
    finally:
        os.close(victim)
        os.close(plain)
        sealed.release_handle()
        sealed.close()


def _open_in_thread(fn, fifo: str):
    """Run ``fn()`` in a thread; if it is still inside after 5 s (blocked in an open of
    ``fifo``, waiting for a writer), open the FIFO for writing to let it out. What it
    returned or raised, and whether it had to be let out."""
    import os
    import threading

    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join(5.0)
    stuck = t.is_alive()
    if stuck:
        w = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        t.join(10.0)
        os.close(w)
    if isinstance(out.get("value"), int):
        os.close(out["value"])
    return out, stuck


def test_a_handle_naming_a_fifo_is_refused_without_blocking(tmp_path):
    """A peer's handle may name any fd of the peer, a FIFO among them: opening one for
    reading used to wait for a writer, so the decoding thread (one-off handles) or the
    start-up (segments) blocked for ever before the memfd check ran."""
    import os

    from shmclient.shm import Segment, open_peer_memfd

    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    r = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # held, no writer
    try:
        handle = f"memfd:{os.getpid()}:{r}:{os.fstat(r).st_ino}"
        for fn in (lambda: open_peer_memfd(handle, os.getpid()), lambda: Segment.attach(handle)):
            out, stuck = _open_in_thread(fn, fifo)
            assert not stuck, "the open of a FIFO blocked"
            assert type(out.get("error")) is ValueError and "memfd" in str(out["error"]), out
    finally:
        os.close(r)


def test_a_segment_handle_must_name_a_sealed_memfd():
    """Rings and arenas are attached from the peer's handles too: an unsealed memfd (which
    the peer could shrink under our mapping: SIGBUS at the next read) or a regular file
    is refused, as for one-off handles."""
    import os
    import tempfile

    from shmclient.shm import Segment

    plain = os.memfd_create("shmc-plain", os.MFD_CLOEXEC)
    os.ftruncate(plain, 4096)
    f = tempfile.TemporaryFile()
    f.write(b"\0" * 4096)
    f.flush()
    try:
        me = os.getpid()
        for what, fd in (("unsealed", plain), ("regular file", f.fileno())):
            with pytest.raises(ValueError, match="sealed|memfd"):
                Segment.attach(f"memfd:{me}:{fd}:{os.fstat(fd).st_ino}")
        sealed = Segment.create(4096)
        try:
            peer = Segment.attach(sealed.name)  # what create makes still attaches
            peer.close()
        finally:
            sealed.release_handle()
            sealed.close()
    finally:
        os.close(plain)
        f.close()


@pytest.mark.parametrize("case", ["larger", "smaller", "sparse", "bad-capacity"])
def test_a_ring_handle_of_the_wrong_size_or_not_allocated_is_refused_before_mapping(case, monkeypatch):
    """A ring's segment is mapped with every page at once (MAP_POPULATE). Its size was
    checked only after that (and only as a lower bound): a peer's handle to a sealed
    memfd sized far beyond the ring, and never allocated, made this process allocate
    all of it (in a container: killed by its memory limit). Now the size must be the
    ring's exactly and the memory allocated, both before anything is mapped."""
    import fcntl
    import os

    from shmclient import shm
    from shmclient.ring import HEADER_BYTES, RingSpec
    from shmclient.ring_consumer import RingConsumer

    capacity = 1 << 16
    size = {"larger": HEADER_BYTES + (capacity << 4), "smaller": HEADER_BYTES + capacity // 2}.get(
        case, HEADER_BYTES + capacity)
    fd = os.memfd_create("shmc-hostile", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    mapped = []
    real_map = shm._map
    monkeypatch.setattr(shm, "_map", lambda *a, **k: mapped.append(a) or real_map(*a, **k))
    try:
        os.ftruncate(fd, size)
        if case != "sparse":
            os.posix_fallocate(fd, 0, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, shm.SEALS)
        handle = f"memfd:{os.getpid()}:{fd}:{os.fstat(fd).st_ino}"
        spec = RingSpec(handle, 1 << 41 if case == "bad-capacity" else capacity)
        with pytest.raises(ValueError, match={"sparse": "allocated", "bad-capacity": "capacity must be"}.get(
                case, "bytes, not the")):
            RingConsumer.attach(spec)
        assert mapped == []
    finally:
        os.close(fd)


# ----------------------------------------------------------------- ipc sockets


def _connect_as_nobody(path: str) -> int:
    """Fork a child that drops to uid/gid 65534 and connects to the unix socket ``path``
    (``@name``: abstract). Its exit status: 0 refused, 1 connected, 2 other error."""
    import os
    import socket

    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 2
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(5.0)
            try:
                s.connect("\0" + path[1:] if path.startswith("@") else path)
                code = 1
            except (PermissionError, FileNotFoundError, ConnectionRefusedError):
                code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.mark.parametrize("transport", ["shm", "zmq"])
def test_control_and_data_sockets_refuse_another_uid(transport, monkeypatch):
    """S1: while an engine starts, the control socket (and the zmq transport's data
    sockets) can only be reached by this uid: another uid's connect is refused (an
    abstract socket let it complete the handshake in the client's place); once the
    engine is connected, the sockets and their directory are gone."""
    import os

    from shmclient import control, launcher

    if os.geteuid() != 0:
        pytest.skip("needs root to run a child as another uid")
    seen: dict[str, int] = {}
    real = launcher.EngineResources._handshake

    def probe(self, config, spec):
        addrs = [self.control_address]
        if transport == "zmq":
            addrs += [spec.input_address, spec.output_address]
        for a in addrs:
            seen[a] = _connect_as_nobody(a[len("ipc://"):])
        return real(self, config, spec)

    monkeypatch.setattr(launcher.EngineResources, "_handshake", probe)
    client = build(f"sync-{transport}", CFG)
    try:
        assert len(seen) == (3 if transport == "zmq" else 1)
        assert set(seen.values()) == {0}, seen
        for a in seen:
            assert not os.path.exists(os.path.dirname(a[len("ipc://"):])), a
        assert client.call_utility("echo", "ok") == "ok"
    finally:
        client.shutdown()


def test_stale_private_ipc_directory_of_a_dead_creator_is_removed(tmp_path, monkeypatch):
    import os

    from shmclient import control_sockets as control

    monkeypatch.setenv(control.IPC_DIR_ENV, str(tmp_path))
    stale = tmp_path / f"shmc-ipc-{2**22 + 12345}-abc"
    stale.mkdir()
    (stale / "ctl").write_text("")
    d = control.IpcDir()
    try:
        assert not stale.exists()
        assert os.stat(d.path).st_mode & 0o777 == 0o700
    finally:
        d.remove()
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------- CUDA IPC handles


def cuda_handle(**kw) -> list:
    """A well-formed CUDA IPC handle (fields as ``CudaIpcSender.share`` makes them)."""
    f = dict(kind=2, bid=5, uuid="GPU-0", h=b"\x03c" + b"\x01" * 64, st_size=4096, st_offset=0,
             size=[4, 8], stride=[8, 1], offset=0, dtype="float32",
             rc_handle=b"/torch_123_456_0", rc_offset=3, ev_handle=b"\x02" * 64, ev_sync=True)
    f.update(kw)
    return list(f.values())


BAD_CUDA = [
    ("short", None),
    ("bid-str", dict(bid="x")),
    ("bid-zero", dict(bid=0)),
    ("dtype-inductor", dict(dtype="_inductor")),
    ("dtype-nn", dict(dtype="nn")),
    ("view-past-storage", dict(size=[1024, 8])),
    ("offset-past-storage", dict(offset=1020)),
    ("stride-mismatch", dict(stride=[1])),
    ("negative-size", dict(size=[-1, 8])),
    ("rc-offset-outside", dict(rc_offset=10000)),
    ("rc-offset-negative", dict(rc_offset=-1)),
    ("rc-name-arbitrary", dict(rc_handle=b"/etc/passwd")),
    ("rc-name-other-shm", dict(rc_handle=b"/shmc-victim")),
    ("rc-not-peer", dict(rc_handle=b"/torch_999_456_0")),
    ("handle-not-bytes", dict(h="x")),
    ("ev-sync-not-bool", dict(ev_sync=1)),
    # torch reads 64 bytes from a shorter event handle; an expandable segment's handle
    # names a process and descriptors it opens by pidfd_getfd, and a segment size it
    # divides by (0: SIGFPE); handles of other lengths are no CUDA IPC handle at all
    ("ev-short", dict(ev_handle=b"\x02")),
    ("ev-long", dict(ev_handle=b"\x02" * 65)),
    ("handle-expandable", dict(h=b"\x03e" + b"\x00" * 40)),
    ("handle-short", dict(h=b"\x01")),
    ("handle-65", dict(h=b"\x01" * 65)),
    ("handle-unknown-type", dict(h=b"\x03x" + b"\x01" * 64)),
]


def test_cuda_ipc_handle_validator_refuses_what_the_peer_must_not_choose():
    """S6 (runs without a GPU): every field of a CUDA IPC handle is checked before
    torch sees it: dtype allowlist, view inside the storage, ref-counter file of the
    peer and counter offset inside it."""
    from shmclient.tensors_cuda import check_handle

    good = check_handle(cuda_handle(), peer_pid=123)
    assert good[0] == 5 and good[8] is torch.float32
    for h in (b"\x01" * 64, b"\x02c" + b"\x01" * 64, None):  # older torch's, 2.12's; none
        check_handle(cuda_handle(h=h), peer_pid=123)
    for name, kw in BAD_CUDA:
        h = cuda_handle()[:10] if kw is None else cuda_handle(**kw)
        with pytest.raises(SerializationError):
            check_handle(h, peer_pid=123)
        assert name


def test_cuda_ipc_handles_refused_when_enable_cuda_ipc_is_false():
    """S6: a receiver whose side has enable_cuda_ipc=False opens no CUDA handle at all
    (a typed error for that message; nothing queued for release)."""
    from shmclient.shm import Segment
    from shmclient.tensors import ShmTensorReceiver

    seg = Segment.create(1 << 16, reserve=False)
    try:
        rx = ShmTensorReceiver(Segment.attach(seg.name), enable_cuda_ipc=False)
        with pytest.raises(SerializationError, match="enable_cuda_ipc=False"):
            rx.get_cuda(cuda_handle())
        assert rx.take_releases() is None
        rx.close()
    finally:
        seg.release_handle()
        seg.close()


# ----------------------------------------------------------------- remote authentication

HOST = "127.0.0.1"


def remote_engine(address: str, secret: str | None, *extra: str, insecure: bool = False):
    import os

    env = {k: v for k, v in os.environ.items()
           if k not in ("SHMCLIENT_SECRET", "SHMCLIENT_SECRET_FILE", "SHMCLIENT_ALLOW_UNAUTHENTICATED")}
    if secret is not None:
        env["SHMCLIENT_SECRET"] = secret
    if insecure:
        env["SHMCLIENT_ALLOW_UNAUTHENTICATED"] = "1"
    root = __file__.rsplit("/tests/", 1)[0]
    return subprocess.Popen(
        [sys.executable, "-m", "shmclient_engine", "--connect", address, "--ready-timeout", "30",
         *extra], cwd=root, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, text=True)


def finish(proc, timeout: float = 30.0) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate(timeout=10)
        raise
    return proc.returncode, err


def remote_config(port: int, **kw) -> EngineConfig:
    return EngineConfig(model="mock", max_model_len=512, transport="zmq",
                        data_parallel_size_local=0, data_parallel_address=HOST,
                        data_parallel_rpc_port=port, engine_ready_timeout_s=30.0, **kw)


@pytest.fixture
def secret_env(monkeypatch):
    for name in ("SHMCLIENT_SECRET", "SHMCLIENT_SECRET_FILE", "SHMCLIENT_ALLOW_UNAUTHENTICATED"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_remote_start_up_with_the_same_secret_works_and_allowed_modules_import(secret_env, tmp_path):
    """S2: frontend and engine prove the secret to each other; a module the engine's
    command line allows (--allow-module) is imported; the secret may come from a file."""
    from shmclient import SyncMPClient
    from tests.test_remote import free_port

    path = tmp_path / "secret"
    path.write_text("s3cret\n")
    secret_env.setenv("SHMCLIENT_SECRET_FILE", str(path))
    port = free_port()
    engine = remote_engine(f"tcp://{HOST}:{port}", "s3cret", "--allow-module", "tests.user_utilities")
    try:
        c = SyncMPClient(remote_config(port, utility_modules=("tests.user_utilities",)))
    except BaseException:
        engine.kill()
        finish(engine)
        raise
    try:
        assert c.echo("x") == "x"
    finally:
        c.shutdown()
    assert finish(engine)[0] == 0


def test_remote_engine_and_frontend_with_different_secrets_refuse_each_other(secret_env):
    from shmclient import AuthenticationError, SyncMPClient
    from tests.test_remote import free_port

    secret_env.setenv("SHMCLIENT_SECRET", "frontend-secret")
    port = free_port()
    engine = remote_engine(f"tcp://{HOST}:{port}", "engine-secret")
    try:
        with pytest.raises(AuthenticationError, match="could not prove it knows the shared secret"):
            SyncMPClient(remote_config(port))
    finally:
        code, err = finish(engine)
    assert code == 1
    assert "AuthenticationError" in err


def test_remote_engine_refuses_a_module_its_command_line_does_not_allow(secret_env):
    from shmclient import AuthenticationError, SyncMPClient
    from tests.test_remote import free_port

    secret_env.setenv("SHMCLIENT_SECRET", "s")
    port = free_port()
    engine = remote_engine(f"tcp://{HOST}:{port}", "s")
    try:
        with pytest.raises(AuthenticationError, match="--allow-module"):
            SyncMPClient(remote_config(port, utility_modules=("tests.user_utilities",)))
    finally:
        code, _ = finish(engine)
    assert code == 1


def test_rogue_engine_without_the_secret_gets_nothing_of_the_client(secret_env):
    """S2: an engine that connects without the secret is refused before START: it never
    sees the config or the data addresses, so it cannot read prompts or forge outputs."""
    import threading

    import zmq

    from shmclient import AuthenticationError, SyncMPClient
    from shmclient import control
    from tests.test_remote import free_port

    secret_env.setenv("SHMCLIENT_SECRET", "s")
    port = free_port()
    got: list[control.Message] = []

    def rogue(offer_nonce: bool):
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PAIR)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{HOST}:{port}")
        try:
            control.send(sock, control.Hello(pid=4242, protocol_version=control.PROTOCOL_VERSION,
                                             nonce=b"n" * 32 if offer_nonce else b""))
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                msg = control.recv(sock, 0.2)
                if msg is None:
                    continue
                got.append(msg)
                if isinstance(msg, control.Auth):
                    control.send(sock, control.Auth(proof=b"x" * 32))  # a guess
                if isinstance(msg, control.Shutdown):
                    break
        finally:
            sock.close(0)
            ctx.term()

    for offer, words in ((True, "could not prove"), (False, "offered no authentication")):
        got.clear()
        t = threading.Thread(target=rogue, args=(offer,))
        t.start()
        try:
            with pytest.raises(AuthenticationError, match=words):
                SyncMPClient(remote_config(port))
        finally:
            t.join(30)
        assert not t.is_alive()
        assert not any(isinstance(m, control.Start) for m in got), got


def test_a_start_up_failure_reported_before_the_engine_proved_the_secret_is_not_typed(secret_env):
    """A peer without the secret that reaches the control port first and reports a start-up
    failure, typed ConfigError with its own text (before any Hello, or after our Auth,
    where a real engine refuses our proof this way), is not believed: AuthenticationError,
    naming the address and quoting the text as its claim."""
    import threading

    import zmq

    from shmclient import AuthenticationError, SyncMPClient
    from shmclient import control
    from tests.test_remote import free_port

    secret_env.setenv("SHMCLIENT_SECRET", "s")
    port = free_port()
    lie = "EngineConfig.max_model_len is invalid: unset SHMCLIENT_SECRET"
    dead = control.EngineCoreDead(message=lie, error_type="ConfigError")
    done = threading.Event()

    def rogue(say_hello: bool):
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PAIR)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{HOST}:{port}")
        try:
            if say_hello:
                control.send(sock, control.Hello(pid=4242, protocol_version=control.PROTOCOL_VERSION,
                                                 nonce=b"n" * 32))
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline and not isinstance(control.recv(sock, 0.2), control.Auth):
                    pass
            control.send(sock, dead)
            done.wait(20)  # until the frontend gave up, so that it reads the report
        finally:
            sock.close(0)
            ctx.term()

    for say_hello, words in ((False, "before this frontend's authentication challenge"),
                             (True, "refused this frontend's proof")):
        done.clear()
        t = threading.Thread(target=rogue, args=(say_hello,))
        t.start()
        try:
            with pytest.raises(AuthenticationError, match=words) as ei:
                SyncMPClient(remote_config(port))
        finally:
            done.set()
            t.join(30)
        assert not t.is_alive()
        text = str(ei.value)
        assert f"tcp://{HOST}:{port}" in text and "claim" in text and repr(lie) in text


def test_remote_start_up_without_a_secret_is_refused_unless_opted_in(secret_env, caplog):
    from shmclient import AuthenticationError, SyncMPClient
    from tests.test_remote import free_port

    port = free_port()
    with pytest.raises(AuthenticationError, match="SHMCLIENT_SECRET"):
        SyncMPClient(remote_config(port))
    code, err = finish(remote_engine(f"tcp://{HOST}:{port}", None))
    assert code == 1 and "no shared secret" in err
    # the explicit opt-in on both sides: works, with a warning
    secret_env.setenv("SHMCLIENT_ALLOW_UNAUTHENTICATED", "1")
    engine = remote_engine(f"tcp://{HOST}:{port}", None, insecure=True)
    try:
        with caplog.at_level("WARNING", logger="shmclient"):
            c = SyncMPClient(remote_config(port))
    except BaseException:
        engine.kill()
        finish(engine)
        raise
    try:
        assert c.echo("y") == "y"
    finally:
        c.shutdown()
    assert finish(engine)[0] == 0
    assert any("WITHOUT authentication" in r.getMessage() for r in caplog.records)


def test_a_remote_engine_its_frontend_refuses_says_why_and_exits_non_zero(secret_env):
    """The frontend has a secret, the engine none (opted in): the frontend refuses it with
    Shutdown before Start. The engine, started by hand, says so and fails (it never
    served), instead of exiting 0 without a word."""
    from shmclient import AuthenticationError, SyncMPClient
    from tests.test_remote import free_port

    secret_env.setenv("SHMCLIENT_SECRET", "s")
    port = free_port()
    engine = remote_engine(f"tcp://{HOST}:{port}", None, insecure=True)
    try:
        with pytest.raises(AuthenticationError, match="offered no authentication"):
            SyncMPClient(remote_config(port))
    finally:
        code, err = finish(engine)
    assert code == 1
    assert f"the frontend at tcp://{HOST}:{port} said Shutdown before Start" in err
    assert "refusing this engine" in err and "see its log" in err


def test_ctrl_c_opening_a_cuda_handle_leaves_it_to_the_salvage():
    """Ctrl-C while a CUDA IPC handle opens: the handle counted as opened, so the
    salvage skipped it and the sender kept that GPU tensor until the channel closed.
    The salvage opens it again (and drops it: its release goes back)."""
    from shmclient.codec import EXT_TORCH_CUDA

    class Receiver:
        calls: list = []

        def get_cuda(self, handle):
            self.calls.append(handle)
            if len(self.calls) == 1:
                raise KeyboardInterrupt
            raise SerializationError("(no GPU here: nothing opened)")

    rx = Receiver()
    handle = [2, 17, "GPU-zz", b"h", 4, 0, [1], [1], 0, "float32", b"/torch_1_2_0", 0, b"e", True]
    buf = msgspec.msgpack.encode([ext(EXT_TORCH_CUDA, ["float32", [1], handle, None])])
    dec = Decoder(tensors=rx)
    with pytest.raises(KeyboardInterrupt):
        dec.decode(buf)
    dec.salvage(buf)
    assert len(rx.calls) == 2
