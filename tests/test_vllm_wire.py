"""How the vLLM plug-in packs vLLM's frames into one ring record, and reads them back
from bytes it does not trust (no vLLM needed)."""

from __future__ import annotations

import os
import re
import struct

import pytest

from shmclient.vllm.wire import MAX_FRAMES, MULTI, message, pack, unpack


def test_one_frame_is_the_record_itself():
    frame = b"\x93\x01\x02\x03"
    assert message(0x03, [frame]) == (0x03, frame)


def test_several_frames_round_trip_with_multi_set():
    frames = [b"main", bytearray(b"tensor bytes"), memoryview(b"\x00" * 300), b""]
    rtype, payload = message(0x00, frames)
    assert rtype == 0x00 | MULTI
    got = unpack(memoryview(payload))
    assert [bytes(f) for f in got] == [bytes(f) for f in frames]
    assert type(got[0]) is bytes and all(type(f) is bytearray for f in got[1:])  # aux frames writable


def test_a_multidimensional_buffer_travels_as_its_bytes():
    import numpy as np

    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    got = unpack(memoryview(pack([b"m", memoryview(arr)])))
    assert bytes(got[1]) == arr.tobytes()


@pytest.mark.parametrize("payload, words", [
    (b"", "has no header"),
    (b"\x01\x00", "has no header"),
    (struct.pack("<I", 1) + struct.pack("<Q", 0), "says it has 1 frames"),
    (struct.pack("<I", MAX_FRAMES + 1), "frames (2 to"),
    (struct.pack("<I", 3) + struct.pack("<Q", 1), "needs 28 bytes"),
    (struct.pack("<I2Q", 2, 4, 4) + b"1234567", "add up to 8 bytes, the record holds 7"),
    (struct.pack("<I2Q", 2, 1 << 63, 0) + b"x", "add up to"),
])
def test_a_bad_header_raises_naming_what_is_wrong(payload, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        unpack(memoryview(payload))


def test_each_engine_finds_its_own_spec_and_none_when_it_has_none():
    import msgspec

    from shmclient.channel import ShmChannel
    from shmclient.vllm.wire import EngineSpec, decode_spec, encode_specs

    channels = [ShmChannel.create(ring_capacity=1 << 16, arena_bytes=0, spin_us=0.0, wake_fd=False)
                for _ in range(2)]
    try:
        specs = [EngineSpec(channel=spec, frontend_pid=1, output_mode="inline", engine_index=i)
                 for i, (_, spec) in enumerate(channels)]
        text = encode_specs(specs)
        assert decode_spec(text, 0) == specs[0]
        assert decode_spec(text, 1) == specs[1]
        assert decode_spec(text, 1).channel != decode_spec(text, 0).channel
        assert decode_spec(text, 2) is None  # an engine this frontend does not reach over the rings
        assert msgspec.msgpack.decode(bytes.fromhex(text))[1]["engine_index"] == 1
    finally:
        for channel, _ in channels:
            channel.close()


@pytest.mark.parametrize("text", ["zz", "00", (b"\x91\x01").hex()])
def test_a_spec_variable_shmclient_did_not_write_is_refused_by_name(text):
    from shmclient.vllm.wire import decode_spec

    with pytest.raises(ValueError, match="SHMCLIENT_VLLM_SPEC does not hold channel specs written by shmclient.vllm"):
        decode_spec(text, 0)


def _channel_specs(n: int):
    from shmclient.channel_handles import ChannelHandles

    handles = [ChannelHandles(ring_capacity=1 << 12, arena_bytes=0, spin_us=0.0) for _ in range(n)]
    return handles, [h.engine_spec for h in handles]


def test_an_engine_of_several_api_servers_gets_its_channels_in_client_order():
    from shmclient.vllm.wire import EngineSpec, decode_specs, encode_specs

    handles, channels = _channel_specs(4)
    try:
        specs = [EngineSpec(channel=channels[2 * e + c], frontend_pid=0, output_mode="inline", engine_index=e,
                            client_index=c, launcher_pid=1) for e in (0, 1) for c in (1, 0)]
        text = encode_specs(specs)
        assert [s.client_index for s in decode_specs(text, 1)] == [0, 1]
        assert [s.channel for s in decode_specs(text, 1)] == [channels[2], channels[3]]
        assert decode_specs(text, 2) == []
        # Two channels for one frontend, or a gap: the launcher's bug, refused by name.
        for bad in ([specs[0], specs[0]], [specs[0]]):
            with pytest.raises(ValueError, match="SHMCLIENT_VLLM_SPEC holds channels for frontends"):
                decode_specs(encode_specs(bad), 0)
    finally:
        for h in handles:
            h.release()


def test_an_api_server_gets_its_channels_in_engine_order():
    from shmclient.vllm.wire import FrontendSpec, decode_frontend_specs, encode_specs

    handles, channels = _channel_specs(2)
    try:
        specs = [FrontendSpec(channel=channels[e], engine_index=e, client_index=c, launcher_pid=1,
                              attached_pipe="", output_mode="inline") for e in (1, 0) for c in (0, 1)]
        text = encode_specs(specs)
        assert [(s.engine_index, s.client_index) for s in decode_frontend_specs(text, 1)] == [(0, 1), (1, 1)]
        assert decode_frontend_specs(text, 5) == []
        with pytest.raises(ValueError, match="two channels to one engine"):
            decode_frontend_specs(encode_specs([specs[0], specs[0]]), 0)
        with pytest.raises(ValueError, match="SHMCLIENT_VLLM_FRONTEND_SPEC does not hold"):
            decode_frontend_specs("zz", 0)
    finally:
        for h in handles:
            h.release()


@pytest.mark.parametrize("pid", [0, -1, 1 << 22 + 1, True, "12", None, 1.5])
def test_a_hello_naming_no_pid_is_refused(pid):
    from shmclient.vllm.wire import check_pid

    with pytest.raises(ValueError, match="HELLO record names pid"):
        check_pid(pid)


def test_a_hello_pid_passes():
    from shmclient.vllm.wire import check_pid

    assert check_pid(os.getpid()) == os.getpid()


@pytest.fixture
def arena_pair():
    """(sender, provider): an arena's sender and the plug-in's provider over its receiver."""
    pytest.importorskip("torch")
    from shmclient.shm import Segment
    from shmclient.tensors import ShmTensorReceiver, ShmTensorSender
    from shmclient.vllm.oob import ArenaProvider

    seg = Segment.create(1 << 20)
    sender = ShmTensorSender(seg)
    receiver = ShmTensorReceiver(Segment.attach(seg.name))
    try:
        yield sender, ArenaProvider(receiver)
    finally:
        receiver.close()
        sender.close()
        seg.release_handle()


@pytest.mark.parametrize("dtype, shape, words", [
    ("cuda", [4], "unknown or unsupported torch dtype 'cuda'"),
    ("Tensor", [4], "unknown or unsupported torch dtype 'Tensor'"),
    (5, [4], "unknown or unsupported torch dtype 5"),
    ("float32", "abcd", "shape must be a list of at most 64 ints >= 0, got 'abcd'"),
    ("float32", None, "shape must be a list of at most 64 ints >= 0, got None"),
    ("float32", [1] * 65, "shape must be a list of at most 64 ints"),
    ("float32", [b"x", 1000], "has dimension b'x'"),  # math.prod would repeat the bytes
    ("float32", [True, 4], "has dimension True"),
    ("float32", [2, -1], "has dimension -1"),
    ("float32", [0, 1 << 62], "is over 2**48 bytes"),
    ("float32", [1 << 31] * 3, "is over 2**48 bytes"),
    ("uint8", [0, 1 << 47, 1 << 47], "is over 2**48 bytes"),  # empty, but its strides overflow
])
def test_an_out_of_band_placeholder_with_a_bad_dtype_or_shape_is_refused_by_name(arena_pair, dtype, shape, words):
    from shmclient.errors import SerializationError
    from shmclient.vllm.oob import KEY

    _, provider = arena_pair
    with pytest.raises(SerializationError, match=re.escape(words)):
        provider(dtype, shape, {KEY: [0, 1, 0]})


def test_an_out_of_band_placeholder_whose_handle_is_no_list_is_refused(arena_pair):
    from shmclient.errors import SerializationError
    from shmclient.vllm.oob import KEY

    _, provider = arena_pair
    with pytest.raises(SerializationError, match="malformed tensor handle"):
        provider("float32", [4], {KEY: 7})


def test_an_out_of_band_tensor_within_bounds_comes_back(arena_pair):
    import torch

    from shmclient.vllm.oob import KEY

    sender, provider = arena_pair
    t = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    got = provider("float32", [2, 3, 4], {KEY: sender.put(t, t.nbytes)})
    assert got.dtype == torch.float32 and got.shape == (2, 3, 4) and torch.equal(got, t)
    del got  # the arena view, before the receiver closes
    empty = provider("bfloat16", (0, 5), {KEY: [0, 1, 0]})
    assert empty.dtype == torch.bfloat16 and empty.shape == (0, 5)


def _released_into(sender, provider) -> int:
    """Hand the receiver's releases to the sender; the sender's blocks still in flight."""
    rel = provider.receiver.take_releases()
    if rel is not None:
        sender.on_release(rel)
    return sender.statistics().blocks_in_flight


def test_a_message_lists_what_its_encode_placed_and_the_decoder_sees_only_vllms_frames():
    """``message`` with handles: MULTI and PLACED set, the list after vLLM's frames;
    ``placed`` reads it back; the decoder is given vLLM's frames only."""
    import msgspec

    from shmclient.vllm.wire import PLACED, _Frames, kind_of, placed

    handles = [[1, 7, 4096], [3, 8, "memfd:x", b"\x00"]]
    for frames in ([b"main"], [b"main", bytearray(b"aux")]):
        rtype, payload = message(0x03, frames, handles)
        assert rtype == 0x03 | MULTI | PLACED and kind_of(rtype) == 0x03
        assert placed(rtype, payload) == handles

        class Records:
            def decode(self, got):
                self.got = got
                return "decoded"

        dec = Records()
        assert _Frames(dec, rtype).decode(memoryview(payload)) == "decoded"
        assert [bytes(f) for f in dec.got] == [bytes(f) for f in frames]
    assert message(0x03, [b"main"], []) == (0x03, b"main")  # nothing placed: as before
    assert placed(0x03 | MULTI, pack([b"a", b"b"])) == []
    # a list that is not one: refused by name, or its odd entries left out
    bad = pack([b"main", msgspec.msgpack.encode({"not": "a list"})])
    with pytest.raises(ValueError, match="list of placed tensors"):
        placed(0x03 | MULTI | PLACED, bad)
    odd = pack([b"main", msgspec.msgpack.encode([7, [1], [1, "x"], [1, 2, 3]])])
    assert placed(0x03 | MULTI | PLACED, odd) == [[1, 2, 3]]


def _placed_message(first_frame_obj, handles):
    import msgspec

    return message(0x00, [msgspec.msgpack.encode(first_frame_obj)], handles)


def test_a_failed_decode_releases_the_listed_blocks_it_did_not_open(arena_pair):
    """A message whose decode fails after its first tensor: that tensor's block goes back
    when the tensor is dropped, the others the sender listed when the message is
    salvaged (nothing opened for them)."""
    import gc

    import torch

    from shmclient.vllm.oob import KEY
    from shmclient.vllm.wire import _Frames

    sender, provider = arena_pair
    tensors = [torch.full((128, 128), float(i)) for i in range(4)]  # 64 KiB: read as views
    handles = [sender.put(t, t.nbytes) for t in tensors]
    placeholders = [["float32", [128, 128], {KEY: h}] for h in handles]
    rtype, payload = _placed_message(["req-1", [placeholders[0], {"mm": [placeholders[1]]}], None,
                                      placeholders[2:], "tail"], handles)

    class FailsAfterTheFirstTensor:
        def decode(self, frames):
            self.first = provider("float32", [128, 128], {KEY: handles[0]})
            raise ValueError("a field of the wrong type")

    dec = FailsAfterTheFirstTensor()
    frames = _Frames(dec, rtype, provider)
    with pytest.raises(ValueError):
        frames.decode(memoryview(payload))
    assert _released_into(sender, provider) == 4
    raw = frames.salvage(memoryview(payload))
    assert raw[0] == "req-1"
    assert _released_into(sender, provider) == 1  # the opened one lives on in dec.first
    assert torch.equal(dec.first, tensors[0])
    del dec.first
    gc.collect()
    assert _released_into(sender, provider) == 0


def test_salvage_frees_only_what_the_sender_listed(arena_pair):
    """A placeholder-shaped value in the message (user data: a JSON schema, a prompt)
    naming a block placed for another message is not freed, listed or not: only the
    sender's own list is. A list that cannot be read frees nothing; nothing raises."""
    import torch

    from shmclient.vllm.oob import KEY
    from shmclient.vllm.wire import PLACED, _Frames

    sender, provider = arena_pair
    t = torch.zeros(64, 64)
    other = sender.put(t, t.nbytes)  # another message's block, still to be read
    mine = sender.put(t, t.nbytes)
    lookalike = ["float32", [64, 64], {KEY: other}]

    class Fails:
        def decode(self, frames):
            raise ValueError("bad")

    for rtype, payload in (_placed_message(["req-2", {"schema": lookalike}], [mine]),
                           message(0x00, [__import__("msgspec").msgpack.encode(["req-3", lookalike])])):
        frames = _Frames(Fails(), rtype, provider)
        with pytest.raises(ValueError):
            frames.decode(memoryview(payload))
        assert frames.salvage(memoryview(payload))[1] in ({"schema": lookalike}, lookalike)
    assert _released_into(sender, provider) == 1  # ``other`` stays taken; ``mine`` came back
    unreadable = pack([b"\x91\x01", b"\xc1"])
    frames = _Frames(Fails(), 0x00 | MULTI | PLACED, provider)
    assert frames.salvage(memoryview(unreadable)) == [1]
    assert frames.salvage(memoryview(b"\xc1")) is None
    assert _released_into(sender, provider) == 1


def test_the_encoders_consumer_hands_out_its_handles_once_and_frees_those_nobody_took(arena_pair):
    """``ArenaTensors``: ``take`` gives the last encode's handles once; an encode whose
    handles were not taken (it failed half-way, or its frames were never sent) has its
    blocks freed when the next encode starts."""
    import torch

    from shmclient.vllm.oob import ArenaTensors

    sender, _ = arena_pair
    consumer = ArenaTensors(sender, threshold=1024)
    big, small = torch.zeros(64, 64), torch.zeros(4)
    consumer.new_message()
    assert consumer(small) is None and consumer.take() == []
    placeholder = consumer(big)
    assert consumer.take() == [placeholder["shmc"]] and consumer.take() == []
    consumer.new_message()
    assert sender.statistics().blocks_in_flight == 1  # taken: its message carries it
    consumer(big)
    consumer(big)
    assert sender.statistics().blocks_in_flight == 3
    consumer.new_message()
    assert sender.statistics().blocks_in_flight == 1 and consumer.take() == []


def test_a_launch_whose_specs_do_not_fit_in_the_environment_keeps_vllms_transport(monkeypatch, caplog):
    """The ``vllm serve`` parent hands every pair's spec to its engines and API servers
    in one environment variable each; one longer than Linux passes (some 115 pairs)
    made every spawned process die at its start. Such a launch now keeps vLLM's
    transport, with a warning naming why (the limit is lowered here to this launch's
    size)."""
    import logging
    from types import SimpleNamespace

    import shmclient.vllm as plugin
    from shmclient.vllm import launch, wire

    monkeypatch.setenv("SHMCLIENT_VLLM", "1")
    monkeypatch.setenv("SHMCLIENT_VLLM_RING_BYTES", str(1 << 16))
    monkeypatch.setenv("SHMCLIENT_VLLM_ARENA_BYTES", "0")
    monkeypatch.setattr(plugin, "_verdict", True)  # the vLLM release check: no vLLM here
    parallel = SimpleNamespace(data_parallel_size=2, data_parallel_size_local=2, data_parallel_rank=0,
                               data_parallel_external_lb=False, data_parallel_hybrid_lb=False,
                               data_parallel_backend="mp")
    config = SimpleNamespace(parallel_config=parallel)
    addresses = SimpleNamespace(inputs=["a", "b", "c"])
    rings = launch.make_rings(config, addresses)
    assert rings is not None
    try:
        assert rings.too_long() is None
        longest = max(len(name) + len(value) + 2 for name, value in rings.environment.items())
    finally:
        rings.release()
    monkeypatch.setattr(wire, "ENV_STRING_MAX", longest - 1)
    with caplog.at_level(logging.WARNING, logger="vllm.shmclient"):
        assert launch.make_rings(config, addresses) is None
    assert "3 API servers x 2 engine cores" in caplog.text and "vLLM's own ZMQ transport is used" in caplog.text
    assert f"longer than the {longest - 1} bytes Linux passes" in caplog.text


@pytest.mark.parametrize("name", ["SHMCLIENT_VLLM_SPIN_US", "SHMCLIENT_VLLM_ASYNC_SPIN_US"])
@pytest.mark.parametrize("raw", ["-5", "nan", "inf"])
def test_a_spin_variable_must_be_finite_and_not_negative(monkeypatch, name, raw):
    """The async output task's spin was read when the task started, after the engines
    were up, and taken as it was: -5 and nan spun as such, and a large one held the
    event loop that long on every read. Both spins are checked with the other settings,
    before anything starts."""
    from shmclient.vllm.link import _Settings

    monkeypatch.setenv(name, raw)
    with pytest.raises(ValueError, match=f"{name} must be a finite number of microseconds >= 0"):
        _Settings()
    monkeypatch.setenv(name, "20")
    settings = _Settings()
    assert (settings.spin_us if name == "SHMCLIENT_VLLM_SPIN_US" else settings.async_spin_us) == 20.0


@pytest.mark.parametrize("name, raw, words", [
    ("SHMCLIENT_VLLM_RING_BYTES", "inf", "must be a whole number, got 'inf'"),
    ("SHMCLIENT_VLLM_RING_BYTES", "nan", "must be a whole number, got 'nan'"),
    ("SHMCLIENT_VLLM_RING_BYTES", "65536.5", "must be a whole number, got '65536.5'"),
    ("SHMCLIENT_VLLM_RING_BYTES", "100", "must be a multiple of 8, got 100"),
    ("SHMCLIENT_VLLM_RING_BYTES", "8", "must be between 64 and 1099511627776, got 8"),
    ("SHMCLIENT_VLLM_RING_BYTES", "1e13", "must be between 64 and 1099511627776, got 10000000000000"),
    ("SHMCLIENT_VLLM_ARENA_BYTES", "-inf", "must be a whole number, got '-inf'"),
    ("SHMCLIENT_VLLM_ARENA_BYTES", "-1", "must be >= 0, got -1"),
    ("SHMCLIENT_VLLM_TENSOR_MIN_BYTES", "nan", "must be a whole number, got 'nan'"),
    ("SHMCLIENT_VLLM_INLINE_MAX_OUTPUTS", "inf", "must be a whole number, got 'inf'"),
    ("SHMCLIENT_VLLM_INLINE_MAX_OUTPUTS", "-1", "must be >= 0, got -1"),
])
def test_a_number_variable_is_refused_naming_it_when_the_settings_are_read(monkeypatch, name, raw, words):
    """Defect: the numbers were int(float(text)): "inf" raised OverflowError, "nan" a
    ValueError without the variable's name, a fraction was cut, and a ring size the ring
    refuses (100: not a multiple of 8) passed here and failed when the channel was made,
    unnamed. Each is now a ValueError naming the variable, before anything starts."""
    from shmclient.vllm.link import _Settings

    monkeypatch.setenv(name, raw)
    with pytest.raises(ValueError, match=re.escape(f"{name} {words}")):
        _Settings()


def test_the_number_variables_take_whole_numbers_in_the_rings_limits(monkeypatch):
    from shmclient.ring import MAX_CAPACITY, MIN_CAPACITY
    from shmclient.vllm import link
    from shmclient.vllm.link import _Settings

    # The plug-in keeps its own copy of the ring's bounds (it may not import the ring).
    assert (link.RING_MIN_BYTES, link.RING_MAX_BYTES) == (MIN_CAPACITY, MAX_CAPACITY)

    for name, raw in [("SHMCLIENT_VLLM_RING_BYTES", str(MIN_CAPACITY)), ("SHMCLIENT_VLLM_ARENA_BYTES", "0"),
                      ("SHMCLIENT_VLLM_TENSOR_MIN_BYTES", "4096.0"), ("SHMCLIENT_VLLM_INLINE_MAX_OUTPUTS", "0")]:
        monkeypatch.setenv(name, raw)
    settings = _Settings()
    assert (settings.capacity, settings.arena, settings.tensor_min_bytes, settings.inline_max_outputs) == (
        MIN_CAPACITY, 0, 4096, 0)
    monkeypatch.setenv("SHMCLIENT_VLLM_RING_BYTES", "4e6")  # 4000000: a multiple of 8
    assert _Settings().capacity == 4_000_000
