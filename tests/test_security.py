"""Hardening against a hostile or broken peer: tensor handles and dtype names from the wire
are validated (one bad message fails alone), shared memory is sealed and checked, and
every reservation is checked against the memory the process may still use."""

from __future__ import annotations

import struct
import subprocess
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
    ("shape-negative", EXT_TORCH, ["float32", [-1], None, None]),
    ("shape-float", EXT_TORCH, ["float32", [1.5], None, None]),
    ("shape-huge", EXT_TORCH, ["float32", [1 << 40, 1 << 40], [ARENA, 7, 0], None]),
    ("shape-not-list", EXT_TORCH, ["float32", 4, None, None]),
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


def test_decoder_refuses_bad_dtype_with_a_typed_error():
    hdr = msgspec.msgpack.encode(["_inductor", [1], None, None])
    buf = msgspec.msgpack.encode(msgspec.msgpack.Ext(EXT_TORCH, struct.pack("<H", len(hdr)) + hdr + b"x"))
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
