"""Bad input, field by field, on every client and transport.

Two tables, each walked in one test per client kind (the autouse leak check costs ~0.1 s
a test): what the door refuses (every field of every message a client sends: each must
raise ``InvalidRequestError`` naming the field, synchronously, before anything travels),
and what the engine does with the same messages when they get past a door (an older or
foreign client): each fails alone, with ``FinishReason.ERROR`` or a failed utility call,
and the engine keeps serving. Below them, the channel's own isolation (a message that
does not decode is handed up in its place; the messages around it are kept).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import random
import time

import msgspec
import numpy as np
import pytest
import torch
import zmq

from shmclient.config import EngineConfig
from shmclient import (
    EngineCoreRequest,
    FinishReason,
    InvalidRequestError,
    LoRARequest,
    PoolingParams,
    ProtocolError,
    SamplingParams,
    SerializationError,
    ShmClientError,
    UtilityCallError,
    client_mp,
)
from shmclient import waiting
from shmclient.channel import REQ_ABORT, REQ_ADD, REQ_UTILITY, BadMessage, ShmChannel
from shmclient.channel_zmq import ZmqChannel
from shmclient.errors import PeerDeadError
from shmclient.messages import UtilityRequest

from .drivers import KINDS, Driver, build, req

CFG = EngineConfig(model="mock", max_model_len=256, hidden_size=32, vocab_size=1024)
MP_KINDS = [k for k in KINDS if k != "inproc"]


def add(rid: str, **kw) -> EngineCoreRequest:
    kw.setdefault("prompt_token_ids", [1, 2, 3])
    kw.setdefault("sampling_params", SamplingParams(max_tokens=2))
    return EngineCoreRequest(request_id=rid, **kw)


def sp(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=2, **kw)


def embeds(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype)


#: (label, request maker taking the request id, words the error must contain).
#: Every field of EngineCoreRequest, SamplingParams, PoolingParams and LoRARequest.
BAD_ADDS = [
    ("ids-floats", lambda r: add(r, prompt_token_ids=[1.0, 2.5]), r"prompt_token_ids\[0\]"),
    ("ids-bool", lambda r: add(r, prompt_token_ids=[True]), r"prompt_token_ids\[0\]"),
    ("ids-numpy-array", lambda r: add(r, prompt_token_ids=np.array([1, 2])), "prompt_token_ids"),
    ("ids-numpy-ints", lambda r: add(r, prompt_token_ids=[np.int64(1)]), r"prompt_token_ids\[0\]"),
    ("ids-dict", lambda r: add(r, prompt_token_ids={"a": 1}), "prompt_token_ids"),
    ("ids-str-items", lambda r: add(r, prompt_token_ids=["a"]), r"prompt_token_ids\[0\]"),
    ("ids-nested", lambda r: add(r, prompt_token_ids=[[1]]), r"prompt_token_ids\[0\]"),
    ("ids-str", lambda r: add(r, prompt_token_ids="abc"), "prompt_token_ids"),
    ("ids-tuple", lambda r: add(r, prompt_token_ids=(1, 2)), "prompt_token_ids"),
    ("ids-negative", lambda r: add(r, prompt_token_ids=[1, -1]), r"prompt_token_ids\[1\]"),
    ("ids-vocab", lambda r: add(r, prompt_token_ids=[1, 1024]), r"prompt_token_ids\[1\].*vocab"),
    ("ids-huge", lambda r: add(r, prompt_token_ids=[2**64]), r"prompt_token_ids\[0\]"),
    ("ids-empty", lambda r: add(r, prompt_token_ids=[]), "empty prompt"),
    ("ids-too-long", lambda r: add(r, prompt_token_ids=[1] * 300), "max_model_len"),
    ("sp-dict", lambda r: add(r, sampling_params={"max_tokens": 3}), "sampling_params"),
    ("sp-temp-str", lambda r: add(r, sampling_params=sp(temperature="hot")), "temperature"),
    ("sp-temp-nan", lambda r: add(r, sampling_params=sp(temperature=math.nan)), "temperature"),
    ("sp-temp-inf", lambda r: add(r, sampling_params=sp(temperature=math.inf)), "temperature"),
    ("sp-temp-neg", lambda r: add(r, sampling_params=sp(temperature=-0.5)), "temperature"),
    ("sp-temp-bool", lambda r: add(r, sampling_params=sp(temperature=True)), "temperature"),
    ("sp-max-float", lambda r: add(r, sampling_params=SamplingParams(max_tokens=2.5)), "max_tokens"),
    ("sp-max-str", lambda r: add(r, sampling_params=SamplingParams(max_tokens="8")), "max_tokens"),
    ("sp-max-zero", lambda r: add(r, sampling_params=SamplingParams(max_tokens=0)), "max_tokens"),
    ("sp-max-bool", lambda r: add(r, sampling_params=SamplingParams(max_tokens=True)), "max_tokens"),
    ("sp-top-p-zero", lambda r: add(r, sampling_params=sp(top_p=0.0)), "top_p"),
    ("sp-top-p-neg", lambda r: add(r, sampling_params=sp(top_p=-0.1)), "top_p"),
    ("sp-top-p-nan", lambda r: add(r, sampling_params=sp(top_p=math.nan)), "top_p"),
    ("sp-top-p-big", lambda r: add(r, sampling_params=sp(top_p=1.5)), "top_p"),
    ("sp-top-k-low", lambda r: add(r, sampling_params=sp(top_k=-2)), "top_k"),
    ("sp-top-k-float", lambda r: add(r, sampling_params=sp(top_k=1.5)), "top_k"),
    ("sp-seed-str", lambda r: add(r, sampling_params=sp(seed="x")), "seed"),
    ("sp-seed-huge", lambda r: add(r, sampling_params=sp(seed=2**70)), "seed"),
    ("sp-seed-bool", lambda r: add(r, sampling_params=sp(seed=True)), "seed"),
    ("sp-stop-str-items", lambda r: add(r, sampling_params=sp(stop_token_ids=["a"])), "stop_token_ids"),
    ("sp-stop-float", lambda r: add(r, sampling_params=sp(stop_token_ids=[1.5])), "stop_token_ids"),
    ("sp-stop-str", lambda r: add(r, sampling_params=sp(stop_token_ids="ab")), "stop_token_ids"),
    ("sp-stop-none", lambda r: add(r, sampling_params=sp(stop_token_ids=None)), "stop_token_ids"),
    ("sp-ignore-eos", lambda r: add(r, sampling_params=sp(ignore_eos="yes")), "ignore_eos"),
    ("sp-ignore-eos-int", lambda r: add(r, sampling_params=sp(ignore_eos=1)), "ignore_eos"),
    ("pp-normalize", lambda r: add(r, sampling_params=None,
                                   pooling_params=PoolingParams(normalize="yes")), "normalize"),
    ("pp-task", lambda r: add(r, sampling_params=None,
                              pooling_params=PoolingParams(task="classify")), "task"),
    ("pp-task-int", lambda r: add(r, sampling_params=None, pooling_params=PoolingParams(task=5)),
     "task"),
    ("pp-dict", lambda r: add(r, sampling_params=None, pooling_params={"task": "embed"}),
     "pooling_params"),
    ("sp-and-pp", lambda r: add(r, pooling_params=PoolingParams()), "not both"),
    ("eos-str", lambda r: add(r, eos_token_id="x"), "eos_token_id"),
    ("eos-neg", lambda r: add(r, eos_token_id=-1), "eos_token_id"),
    ("eos-vocab", lambda r: add(r, eos_token_id=5000), "eos_token_id"),
    ("eos-bool", lambda r: add(r, eos_token_id=True), "eos_token_id"),
    ("arrival-str", lambda r: add(r, arrival_time="now"), "arrival_time"),
    ("arrival-nan", lambda r: add(r, arrival_time=math.nan), "arrival_time"),
    ("arrival-inf", lambda r: add(r, arrival_time=math.inf), "arrival_time"),
    ("arrival-neg", lambda r: add(r, arrival_time=-1.0), "arrival_time"),
    ("lora-str", lambda r: add(r, lora_request="adapter"), "lora_request"),
    ("lora-name", lambda r: add(r, lora_request=LoRARequest(5, 1)), "lora_name"),
    ("lora-id-zero", lambda r: add(r, lora_request=LoRARequest("a", 0)), "lora_int_id"),
    ("lora-id-str", lambda r: add(r, lora_request=LoRARequest("a", "1")), "lora_int_id"),
    ("lora-path", lambda r: add(r, lora_request=LoRARequest("a", 1, 5)), "lora_path"),
    ("salt-int", lambda r: add(r, cache_salt=5), "cache_salt"),
    ("salt-bytes", lambda r: add(r, cache_salt=b"x"), "cache_salt"),
    ("dp-rank-neg", lambda r: add(r, data_parallel_rank=-1), "data_parallel_rank"),
    ("dp-rank-str", lambda r: add(r, data_parallel_rank="0"), "data_parallel_rank"),
    ("embeds-int", lambda r: add(r, prompt_token_ids=None, prompt_embeds=embeds(2, 32, dtype=torch.int64)),
     "floating point"),
    ("embeds-complex", lambda r: add(r, prompt_token_ids=None,
                                     prompt_embeds=embeds(2, 32, dtype=torch.complex64)),
     "floating point"),
    ("embeds-1d", lambda r: add(r, prompt_token_ids=None, prompt_embeds=embeds(32)),
     r"prompt_embeds must have shape \[num_tokens, 32\]"),
    ("embeds-3d", lambda r: add(r, prompt_token_ids=None, prompt_embeds=embeds(1, 2, 32)),
     "prompt_embeds must have shape"),
    ("embeds-width", lambda r: add(r, prompt_token_ids=None, prompt_embeds=embeds(2, 5)),
     "hidden_size"),
    ("embeds-no-rows", lambda r: add(r, prompt_token_ids=None, prompt_embeds=embeds(0, 32)),
     "empty prompt"),
    ("embeds-numpy", lambda r: add(r, prompt_token_ids=None,
                                   prompt_embeds=np.zeros((2, 32), np.float32)), "torch.Tensor"),
    ("embeds-list", lambda r: add(r, prompt_token_ids=None, prompt_embeds=[[0.0] * 32]),
     "torch.Tensor"),
    ("embeds-and-ids", lambda r: add(r, prompt_embeds=embeds(2, 32)), "not both"),
    ("embeds-nan", lambda r: add(r, prompt_token_ids=None, prompt_embeds=embeds(2, 32).fill_(math.nan)),
     "NaN or infinite"),
    ("embeds-inf", lambda r: add(r, prompt_token_ids=None,
                                 prompt_embeds=embeds(2, 32).index_fill_(1, torch.tensor([3]), -math.inf)),
     "NaN or infinite"),
    # float8_e4m3fn has no isfinite in torch: checked in float32 (a raw
    # NotImplementedError before); float4_e2m1fn_x2 has no float32 form at all.
    ("embeds-f8-nan", lambda r: add(r, prompt_token_ids=None, prompt_embeds=embeds(
        2, 32).fill_(math.nan).to(torch.float8_e4m3fn)), "NaN or infinite"),
    ("embeds-f4", lambda r: add(r, prompt_token_ids=None,
                                prompt_embeds=embeds(2, 32, dtype=torch.float4_e2m1fn_x2)),
     "float4_e2m1fn_x2, which cannot be checked"),
    ("client-index-neg", lambda r: add(r, client_index=-1), "client_index"),
    ("client-index-str", lambda r: add(r, client_index="0"), "client_index"),
    ("client-index-bool", lambda r: add(r, client_index=True), "client_index"),
    ("wave-neg", lambda r: add(r, current_wave=-1), "current_wave"),
    ("wave-float", lambda r: add(r, current_wave=1.5), "current_wave"),
    ("priority-str", lambda r: add(r, priority="high"), "priority"),
    ("priority-huge", lambda r: add(r, priority=2**63), "priority"),
    ("priority-float", lambda r: add(r, priority=1.5), "priority"),
]

#: request_id itself: the door names it; past the door, an id the engine cannot read
#: cannot be answered (logged), one it can read is answered with ERROR.
BAD_IDS = [
    ("id-int", lambda r: EngineCoreRequest(request_id=5, prompt_token_ids=[1]), "request_id"),
    ("id-none", lambda r: EngineCoreRequest(request_id=None, prompt_token_ids=[1]), "request_id"),
    ("id-bytes", lambda r: EngineCoreRequest(request_id=b"x", prompt_token_ids=[1]), "request_id"),
    ("id-empty", lambda r: EngineCoreRequest(request_id="", prompt_token_ids=[1]), "request_id"),
]

#: Refused at the door, but the same message as a good value once on the wire.
WIRE_EQUIVALENT = {"ids-tuple"}

BAD_ABORTS = [
    ("abc", "single str"),
    (b"ab", "single bytes"),
    (123, "list of request ids"),
    ([1, 2], r"request_ids\[0\]=1"),
    (["ok", None], r"request_ids\[1\]=None"),
]

BAD_METHODS = [123, "", None, b"echo"]


async def _door_refuses(drv: Driver, call, words: str, problems: list, label: str) -> None:
    try:
        await call()
    except InvalidRequestError as e:
        assert isinstance(e, ValueError) and isinstance(e, ShmClientError)
        if not _search(words, str(e)):
            problems.append(f"{label}: message {str(e)!r} does not name {words!r}")
    except BaseException as e:  # noqa: BLE001
        problems.append(f"{label}: {type(e).__name__}: {e} instead of InvalidRequestError")
    else:
        problems.append(f"{label}: accepted")


def _search(pattern: str, text: str) -> bool:
    import re

    return re.search(pattern, text) is not None


@pytest.fixture(scope="module", params=KINDS)
def drv(request):
    client = build(request.param, CFG)
    yield Driver(request.param, client)
    client.shutdown()


async def test_door_refuses_every_bad_field_of_every_message(drv):
    """Each bad value of each field raises InvalidRequestError naming it, on the call."""
    problems: list[str] = []
    for label, make, words in BAD_ADDS + BAD_IDS:
        r = make(label)
        await _door_refuses(drv, lambda: drv.add(r), words, problems, label)
    await _door_refuses(drv, lambda: drv.add({"request_id": "d"}), "EngineCoreRequest",
                        problems, "not-a-request")
    for ids, words in BAD_ABORTS:
        await _door_refuses(drv, lambda: drv.abort(ids), words, problems, f"abort {ids!r}")
    for method in BAD_METHODS:
        await _door_refuses(drv, lambda: drv.call_utility(method), "method", problems,
                            f"call_utility({method!r})")
    assert not problems, "\n".join(problems)
    # Nothing of it travelled or stuck: the client is alive and serves as before.
    await drv.add(req("after-door", max_tokens=3))
    res = await drv.collect(["after-door"])
    assert len(res["after-door"]["tokens"]) == 3
    if not drv.is_inproc:
        assert not drv.client.is_dead and drv.client._live == set()


async def test_too_deep_utility_argument_is_a_serialization_error(drv):
    deep: list = []
    for _ in range(2000):
        deep = [deep]
    if drv.is_inproc:  # nothing crosses a boundary in process
        assert await drv.util("echo", deep) is deep
        return
    with pytest.raises(SerializationError, match="nested"):
        await drv.util("echo", deep)
    assert await drv.util("echo", 5) == 5


@pytest.mark.parametrize("transport", ["shm", "zmq"])
async def test_a_call_nested_too_deep_for_the_engine_to_decode_is_answered(transport):
    """A value the client could encode but the engine cannot decode (its decode runs
    deeper in its stack; here bytes passed through as they are): the salvage of the
    failed decode failed the same way, the call id went unread and the call waited for
    good. The call's leading fields are read without recursion now: it fails, saying
    why."""
    from shmclient import AsyncMPClient, UtilityCallError

    c = await AsyncMPClient.create(CFG.replace(transport=transport))
    try:
        deep = msgspec.Raw(b"\x91" * 5_000 + b"\xc0")  # (small: a zmq frame is copied)
        with pytest.raises(UtilityCallError, match="could not decode the call"):
            await asyncio.wait_for(c.call_utility_async("echo", deep), 10)
        assert await c.echo_async(5) == 5
    finally:
        await c.shutdown_async()


@pytest.mark.parametrize("nbytes", [400_000, 4 << 20], ids=["arena", "one-off"])
def test_shm_a_message_too_deep_to_decode_gives_its_tensors_blocks_back(shm_pair, nbytes):
    """The salvage's walk without recursion passed the tensors' handles by: the block
    of a tensor after the deep part stayed taken in the sender's arena for good."""
    front, engine = shm_pair
    deep = msgspec.Raw(b"\x91" * 5_000 + b"\xc0")
    payload = front.encode(UtilityRequest(0, 9, "echo", (deep, np.zeros(nbytes // 8))))
    waiting.send(front, REQ_UTILITY, payload, timeout=5.0)
    stats = front._tensor_tx.statistics
    assert stats().blocks_in_flight + stats().one_offs_in_flight == 1
    (_, bad), = waiting.recv(engine, timeout=5.0)
    assert type(bad) is BadMessage and bad.field("call_id") == 9
    engine.flush_releases()
    front.try_recv()  # reads the release record
    assert stats().blocks_in_flight + stats().one_offs_in_flight == 0


@pytest.mark.parametrize("damage", ["invalid utf-8 before the tensor", "a byte left over"])
def test_shm_a_message_no_decode_takes_is_still_answered_and_gives_its_blocks_back(shm_pair, damage):
    """Bytes the untyped decode refuses too (a string that is not UTF-8, a byte after
    the message): the salvage gave up (only a nesting too deep was read without
    recursion), so the request id went unread (the engine could not answer it) and a
    tensor after the damage kept its block in the sender's arena for good."""
    from shmclient.messages import EngineCoreRequest

    front, engine = shm_pair
    r = EngineCoreRequest(request_id="req-7", prompt_token_ids=None, cache_salt="SALT",
                          prompt_embeds=torch.zeros(64, 32))
    raw = bytes(front.encode(r))
    assert raw.count(b"SALT") == 1 and raw.index(b"SALT") < raw.index(b"float32")
    raw = raw.replace(b"SALT", b"S\xffLT") if damage.startswith("invalid") else raw + b"\xc0"
    waiting.send(front, REQ_ADD, raw, timeout=5.0)
    stats = front._tensor_tx.statistics
    assert stats().blocks_in_flight == 1
    (_, bad), = waiting.recv(engine, timeout=5.0)
    assert type(bad) is BadMessage and bad.field("request_id") == "req-7"
    engine.flush_releases()
    front.try_recv()  # reads the release record
    assert stats().blocks_in_flight == 0


def test_an_arena_handle_out_of_bounds_gives_its_block_back():
    """A handle whose offset is past the arena or not aligned, or whose kind is not
    known: the failed open did not release the block (the decoder counts on it), and
    the salvage skipped it as opened: its id was never released."""
    from shmclient.codec import EXT_TORCH, HLEN, hdr_encode
    from shmclient.framing import decoders
    from shmclient.shm import Segment
    from shmclient.tensors_receiver import ShmTensorReceiver

    seg = Segment.create(1 << 20)
    seg.release_handle()  # (nothing attaches: no descriptor stays open)
    rx = ShmTensorReceiver(seg)
    dec = decoders(rx)[REQ_UTILITY]
    try:
        for bid, handle in ((7, [0, 7, 1 << 20]), (8, [0, 8, 100]), (9, [5, 9, 0])):
            h = hdr_encode(["uint8", [256], handle, None])
            buf = msgspec.msgpack.encode(
                [0, 1, "echo", [msgspec.msgpack.Ext(EXT_TORCH, HLEN.pack(len(h)) + h)]])
            with pytest.raises(Exception, match=f"block {bid}|kind 5"):
                dec.decode(buf)
            dec.salvage(buf)
            assert rx.take_releases() == bid.to_bytes(8, "little"), handle
    finally:
        rx.close()


def test_the_salvage_of_a_message_too_deep_to_decode_reads_its_leading_fields():
    from shmclient.codec_decoder import Decoder, shallow_fields

    head = b"\x96" + msgspec.msgpack.encode(7) + msgspec.msgpack.encode("id-1") + b"\xcb" + bytes(8)
    deep = head + b"\x92\x05" + b"\x91" * 100_000 + b"\xc0" + b"\xc3\xa1x"
    assert Decoder(UtilityRequest).salvage(deep) == [7, "id-1", 0.0, [5], True, "x"]
    assert shallow_fields(deep[:-3]) is None  # cut short: nothing is guessed
    assert shallow_fields(b"\x81\x01\x02") is None  # not an array
    rng = random.Random(7)  # a hostile peer's bytes: never an exception
    for _ in range(5_000):
        shallow_fields(bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 48))))


@pytest.fixture
def no_door(monkeypatch):
    """Let bad messages through the MP clients' door (as a foreign client would send)."""
    monkeypatch.setattr(client_mp, "check_request", lambda *a, **k: None)
    monkeypatch.setattr(client_mp, "check_abort_ids", lambda ids: ids)
    monkeypatch.setattr(client_mp, "check_utility_call", lambda method: None)


@pytest.fixture(scope="module", params=MP_KINDS)
def mp_drv(request):
    client = build(request.param, CFG)
    yield Driver(request.param, client)
    client.shutdown()


async def test_refused_request_finishes_with_finish_reason_error_and_engine_keeps_serving(
    mp_drv, no_door
):
    """vLLM's FinishReason.ERROR: a request the engine refuses or cannot decode finishes
    with ERROR (reason in stop_reason); a bad utility call fails; a bad abort is dropped;
    the engine never dies of it."""
    drv = mp_drv
    sent: dict[str, str] = {}
    for label, make, words in BAD_ADDS + BAD_IDS[3:]:
        if label in WIRE_EQUIVALENT:
            continue
        r = make(label)
        try:
            await drv.add(r)
        except SerializationError:
            continue  # the value cannot even be encoded (e.g. an int above 2**64)
        sent[r.request_id] = words
    assert len(sent) >= len(BAD_ADDS) - 3  # all but the unencodable ones went out
    # Interleaved with ids the engine cannot read (logged, nothing to answer) and aborts
    # it cannot decode (dropped), then one good request: all in one ordered stream.
    for _label, make, _words in BAD_IDS[:3]:
        await drv.add(make("x"))
    for ids, _words in BAD_ABORTS:
        await drv.abort(ids)
    await drv.add(req("good-after-bad", max_tokens=4))
    res = await drv.collect([*sent, "good-after-bad"])
    wrong = []
    for rid, words in sent.items():
        r = res[rid]
        if r["reason"] is not FinishReason.ERROR or r["n_finished"] != 1 or r["tokens"]:
            wrong.append(f"{rid!r}: {r['reason']!r} after {r['tokens']}")
        elif not isinstance(r["stop_reason"], str) or not r["stop_reason"]:
            wrong.append(f"{rid!r}: no reason text: {r['stop_reason']!r}")
    assert not wrong, "\n".join(wrong)
    assert res["good-after-bad"]["reason"] is FinishReason.LENGTH
    assert len(res["good-after-bad"]["tokens"]) == 4
    # The decoder's own message reaches the client for a wrongly typed field.
    assert "Expected `int`, got `float`" in res["ids-floats"]["stop_reason"]
    assert "temperature" in res["sp-temp-nan"]["stop_reason"]
    # A utility call that does not decode fails alone, with the decoder's message.
    with pytest.raises(UtilityCallError, match=r"Call to 123 method failed: .*Expected `str`"):
        await drv.call_utility(123)
    assert await drv.util("echo", "still serving") == "still serving"
    assert not drv.client.is_dead


@pytest.mark.parametrize("duplicate", ["decodes", "does not decode", "is invalid"])
def test_a_duplicate_of_a_live_id_is_dropped_without_finishing_the_live_request(duplicate):
    """A frontend (not this project's clients, which refuse it first) sends a request
    whose id is live in the engine: the engine's refusal used to finish that id with
    ERROR, so the frontend took the live request as over while the engine went on
    generating for it. Nothing is answered under the id now, whether the duplicate
    decodes or not (a float token id), and also where it decodes but is invalid (a token
    outside the vocabulary: that check came before the live-id check, so it was answered
    with ERROR); the live request ends as it would have."""
    from shmclient import SyncMPClient

    c = SyncMPClient(CFG.replace(step_delay_s=0.002))
    try:
        r = req("live", max_tokens=12)
        c.add_request(r)
        if duplicate == "decodes":  # around the client's own check
            send(c.channel, REQ_ADD, r)
        elif duplicate == "is invalid":
            send(c.channel, REQ_ADD, req("live", prompt=[CFG.vocab_size], max_tokens=12))
        else:
            waiting.send(c.channel, REQ_ADD, msgspec.msgpack.encode(["live", [1.0]]), timeout=5.0)
        c.add_request(req("after", max_tokens=2))
        finished: dict[str, FinishReason] = {}
        tokens = 0
        deadline = time.monotonic() + 30
        while len(finished) < 2 and time.monotonic() < deadline:
            for o in c.get_output(timeout=10).outputs:
                if o.request_id == "live":
                    assert "live" not in finished, f"output after its finish: {o!r}"
                    tokens += len(o.new_token_ids)
                if o.finish_reason is not None:
                    finished[o.request_id] = o.finish_reason
        assert finished == {"live": FinishReason.LENGTH, "after": FinishReason.LENGTH}
        assert tokens == 12
    finally:
        c.shutdown()


class _RepliesUndecodable:
    """The client's decoder of output batches, failing on every utility reply as on
    bytes the engine should never have sent (a bug of a third-party engine)."""

    def __init__(self, dec) -> None:
        self.dec = dec

    def _check(self, obj):
        if obj.utility_output is not None:
            raise ValueError("crafted: this reply does not decode")
        return obj

    def decode(self, buf):
        return self._check(self.dec.decode(buf))

    def decode_frames(self, bufs):
        return self._check(self.dec.decode_frames(bufs))

    def salvage(self, buf):
        return self.dec.salvage(buf)


async def test_a_utility_reply_that_does_not_decode_fails_its_call(mp_drv):
    """The call whose reply did not decode fails with the decoder's error (it waited
    for ever before: the reply was dropped); the engine goes on serving."""
    from shmclient.channel import REC_OUTPUTS

    drv = mp_drv
    decoders = drv.client.channel._decoders
    real = decoders[REC_OUTPUTS]
    decoders[REC_OUTPUTS] = _RepliesUndecodable(real)
    try:
        with pytest.raises(UtilityCallError, match="Call to echo method failed: its reply did not decode: "
                                                   "ValueError: crafted"):
            if drv.is_async:
                await asyncio.wait_for(drv.util("echo", 5), 30)
            else:
                pool = concurrent.futures.ThreadPoolExecutor(1)
                try:
                    pool.submit(drv.client.echo, 5).result(timeout=30)
                finally:
                    pool.shutdown(wait=False)
    finally:
        decoders[REC_OUTPUTS] = real
    assert await drv.util("echo", "still serving") == "still serving"


# ----------------------------------------------------------------- channel isolation


def send(channel, rtype, obj):
    waiting.send(channel, rtype, channel.encode(obj), timeout=5.0)


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


def test_shm_recv_keeps_messages_around_one_that_does_not_decode(shm_pair):
    front, engine = shm_pair
    send(front, REQ_ADD, add("before"))
    waiting.send(front, REQ_ADD, msgspec.msgpack.encode(["bad", [1.0, 2.5]]), timeout=5.0)
    send(front, REQ_ADD, add("after"))
    got = waiting.recv(engine, timeout=5.0)
    assert [t for t, _ in got] == [REQ_ADD] * 3
    first, bad, last = (obj for _, obj in got)
    assert first.request_id == "before" and last.request_id == "after"
    assert type(bad) is BadMessage
    assert bad.field("request_id") == "bad" and bad.field("client_index") is None
    assert "Expected `int`, got `float` - at `$[1][0]`" in bad.error


def test_shm_undecodable_message_gives_its_tensor_block_back(shm_pair):
    front, engine = shm_pair
    big = torch.randn(64, 32)  # out of band, in the frontend's arena
    send(front, REQ_ADD, EngineCoreRequest(request_id=5, prompt_embeds=big))
    assert front._tensor_tx.statistics().blocks_in_flight == 1
    (_, bad), = waiting.recv(engine, timeout=5.0)
    assert type(bad) is BadMessage and bad.field("request_id") == 5
    engine.flush_releases()
    front.try_recv()  # reads the release record
    assert front._tensor_tx.statistics().blocks_in_flight == 0


@pytest.mark.parametrize("nbytes", [400_000, 4 << 20], ids=["arena", "one-off"])
def test_shm_a_tensor_whose_dtype_is_refused_still_gives_its_block_back(shm_pair, nbytes):
    """The salvage of a message that did not decode frees the blocks of its tensors by
    opening them, which repeats the dtype check that failed: the block (or the one-off
    segment, past the arena's size) stayed taken for good. It is released by id now."""
    import numpy as np

    front, engine = shm_pair
    arr = np.zeros(nbytes // 8, "<M8[ns]")
    payload = front.encode(UtilityRequest(0, 1, "echo", (arr,)))
    raw = bytes(payload)
    assert raw.count(b"<M8[ns]") == 1
    waiting.send(front, REQ_UTILITY, raw.replace(b"<M8[ns]", b"<M8[xs]"), timeout=5.0)
    stats = front._tensor_tx.statistics
    assert stats().blocks_in_flight + stats().one_offs_in_flight == 1
    (_, bad), = waiting.recv(engine, timeout=5.0)
    assert type(bad) is BadMessage and "'<M8[xs]'" in bad.error
    engine.flush_releases()
    front.try_recv()  # reads the release record
    assert stats().blocks_in_flight + stats().one_offs_in_flight == 0


def test_a_numpy_dtype_the_receiver_refuses_is_refused_when_encoding():
    """A datetime of a long unit (its dtype string past the 16 characters the decoder
    takes) was sent, and refused by the receiver only."""
    import numpy as np

    from shmclient.codec import Encoder

    with pytest.raises(SerializationError, match="the receiving side does not take"):
        Encoder().encode(np.zeros(3, "M8[1234567890ns]"))


def test_shm_unknown_record_type_is_a_protocol_error_after_what_came_before(shm_pair):
    front, engine = shm_pair
    send(front, REQ_ADD, add("kept"))
    waiting.send(front.tx, 0x7E, b"junk", timeout=1.0)
    got = waiting.recv(engine, timeout=5.0)
    assert [obj.request_id for _, obj in got] == ["kept"]
    with pytest.raises(ProtocolError, match="unknown record type 0x7e"):
        engine.try_recv()


@pytest.fixture
def zmq_pair():
    ctx = zmq.Context()
    front, spec = ZmqChannel.create(ctx, f"ipc://@shmc-test-{time.monotonic_ns()}")
    engine = ZmqChannel.attach(ctx, spec)
    front.wait_registered(timeout=5.0)
    yield front, engine
    engine.close()
    front.close()
    ctx.term()


def test_zmq_a_peer_sending_to_the_request_socket_is_dropped(zmq_pair):
    """The request socket is read only until the engine registered, and took any peer's
    messages without bound: whoever reached the port could fill the frontend's memory
    (400 messages of 1 MiB: +400 MiB, for the client's life). A frame past the empty
    registration now drops the peer that sent it."""
    from zmq.utils.monitor import recv_monitor_message

    front, engine = zmq_pair
    mon = front._tx.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    ctx = zmq.Context()
    rogue = ctx.socket(zmq.DEALER)
    rogue.setsockopt(zmq.LINGER, 0)
    try:
        rogue.connect(front._tx.getsockopt_string(zmq.LAST_ENDPOINT))
        rogue.send(b"y" * 4096)
        assert mon.poll(10_000), "the peer was not dropped"
        assert recv_monitor_message(mon)["event"] == zmq.EVENT_DISCONNECTED
        assert not front._tx.poll(0)  # nothing of it was queued
        front.send_nowait(REQ_UTILITY, front.encode(UtilityRequest(0, 1, "echo", (1,))))
        (_, call), = waiting.recv(engine, timeout=5.0)
        assert call.call_id == 1
    finally:
        rogue.close()
        ctx.term()
        front._tx.disable_monitor()
        mon.close(0)


def test_zmq_close_waits_for_a_send_under_way(zmq_pair):
    """``close`` closed the request socket under a send in another thread (a zmq socket
    is not thread-safe: undefined behaviour, an assertion in libzmq at worst)."""
    import threading

    front, _engine = zmq_pair
    real_tx, real_lock = front._tx, front._send_lock
    in_send, go_on, asked = threading.Event(), threading.Event(), threading.Event()
    seen_closed = []

    class InSend:  # the socket, with a send that takes its time
        def send_multipart(self, *args, **kw):
            in_send.set()
            assert go_on.wait(10)
            seen_closed.append(real_tx.closed)
            return real_tx.send_multipart(*args, **kw)

        def close(self, linger=None):
            real_tx.close(linger=linger)

    class Watched:  # the send lock, telling when a second thread asks for it
        def __enter__(self):
            if in_send.is_set():
                asked.set()
            return real_lock.__enter__()

        def __exit__(self, *exc):
            return real_lock.__exit__(*exc)

    front._tx, front._send_lock = InSend(), Watched()
    payload = front.encode(UtilityRequest(0, 1, "echo", (1,)))
    sender = threading.Thread(target=front.send_nowait, args=(REQ_UTILITY, payload))
    sender.start()
    assert in_send.wait(10)
    closer = threading.Thread(target=front.close)
    closer.start()
    try:
        assert asked.wait(5), "close did not wait for the send under way"
    finally:
        go_on.set()
        sender.join(10)
        closer.join(10)
    assert seen_closed == [False] and real_tx.closed


def test_zmq_message_that_does_not_decode_fails_alone(zmq_pair):
    front, engine = zmq_pair
    send(front, REQ_ADD, add("before"))
    waiting.send(front, REQ_ABORT, [msgspec.msgpack.encode([1, 2])], timeout=5.0)
    send(front, REQ_ADD, add("after"))
    got: list = []
    deadline = time.monotonic() + 5.0
    while len(got) < 3 and time.monotonic() < deadline:
        got += waiting.recv(engine, timeout=1.0)
    assert [t for t, _ in got] == [REQ_ADD, REQ_ABORT, REQ_ADD]
    assert got[0][1].request_id == "before" and got[2][1].request_id == "after"
    assert type(got[1][1]) is BadMessage and "Expected `str`" in got[1][1].error


def test_zmq_send_to_a_gone_engine_is_peer_dead_not_zmq_error(zmq_pair):
    """Defect: add_request right after the engine died raised zmq's 'Host unreachable'."""
    front, engine = zmq_pair
    engine.close()
    deadline = time.monotonic() + 10.0
    with pytest.raises(PeerDeadError, match="not connected"):
        while time.monotonic() < deadline:  # until the ROUTER has seen the disconnect
            send(front, REQ_ADD, add("x"))
            front._tx.poll(10)
