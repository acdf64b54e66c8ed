"""Wire schemas and the public surface: what a vLLM user relies on without reading code."""

from __future__ import annotations

import subprocess
import sys
import time

import msgspec
import pytest

import shmclient
from shmclient import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    FinishReason,
    SamplingParams,
    UtilityOutput,
)

PUBLIC = {
    "AsyncMPClient", "AuthenticationError", "ClientClosedError", "ConfigError", "DPAsyncMPClient", "DPLBAsyncMPClient",
    "EngineConfig", "EngineCoreClient",
    "EngineCoreOutput", "EngineCoreOutputs", "EngineCoreRequest", "EngineCoreRequestType",
    "DuplicateRequestError", "EngineDeadError", "FinishReason", "ForkedError", "InprocClient",
    "InvalidRequestError", "LoRARequest",
    "MPClient", "PROTOCOL_VERSION", "PeerDeadError", "PeerNotConsumingError",
    "PeerNotProducingError", "PeerTimeoutError", "PoolingParams", "ProtocolError",
    "SamplingParams", "SchedulerStats", "SerializationError", "ShmCapacityError", "ShmClientError",
    "SyncEngineCoreClient", "SyncMPClient", "UsageError", "WouldBlock", "UtilityCallError", "UtilityOutput", "make_async_mp_client",
    "make_client",
}


def test_public_exports_are_pinned():
    assert set(shmclient.__all__) == PUBLIC
    for name in PUBLIC:
        assert getattr(shmclient, name) is not None, name


def test_import_starts_nothing_and_does_not_import_the_engine():
    code = (
        "import sys, threading, shmclient; "
        "assert 'shmclient_engine' not in sys.modules and 'shmclient_engine.core' not in sys.modules; "
        "assert threading.active_count() == 1; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr


def test_request_type_bytes():
    assert EngineCoreRequestType.ADD.value == b"\x00"
    assert EngineCoreRequestType.ABORT.value == b"\x01"
    assert EngineCoreRequestType.START_DP_WAVE.value == b"\x02"
    assert EngineCoreRequestType.UTILITY.value == b"\x03"
    assert EngineCoreRequestType.UTILITY.code == 3


def test_finish_reason_values_and_strings_are_vllms():
    # vLLM v1: STOP=0, LENGTH=1, ABORT=2, ERROR=3, REPETITION=4, str() the OpenAI spelling.
    assert [(r.name, int(r)) for r in FinishReason] == [
        ("STOP", 0), ("LENGTH", 1), ("ABORT", 2), ("ERROR", 3), ("REPETITION", 4)]
    assert [str(r) for r in FinishReason] == ["stop", "length", "abort", "error", "repetition"]
    assert not EngineCoreOutput(request_id="a").finished
    assert EngineCoreOutput(request_id="a", finish_reason=FinishReason.ABORT).finished


def test_outputs_timestamp_defaults_to_now():
    before = time.monotonic()
    outs = EngineCoreOutputs()
    assert before <= outs.timestamp <= time.monotonic()
    assert EngineCoreOutputs(timestamp=5.0).timestamp == 5.0


def test_array_like_in_field_order():
    sp = SamplingParams(max_tokens=7, stop_token_ids=[9])
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(sp)) == [7, 1.0, 1.0, 0, None, [9], False]
    req = EngineCoreRequest(request_id="r", prompt_token_ids=[1, 2])
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(req))[:2] == ["r", [1, 2]]


def test_old_message_without_trailing_fields_gets_defaults():
    # What an older sender writes: only the fields it knew, in order.
    old = msgspec.msgpack.encode(["r9", [4, 5], [3, 0.5]])
    req = msgspec.msgpack.decode(old, type=EngineCoreRequest)
    assert req.request_id == "r9" and req.prompt_token_ids == [4, 5]
    assert req.sampling_params == SamplingParams(max_tokens=3, temperature=0.5)
    assert req.client_index == 0 and req.prompt_embeds is None and req.arrival_time == 0.0
    out = msgspec.msgpack.decode(msgspec.msgpack.encode([3]), type=UtilityOutput)
    assert out == UtilityOutput(call_id=3)


def test_wrong_shape_message_is_a_typed_error():
    with pytest.raises(msgspec.ValidationError, match=r"Expected `str`, got `int` - at `\$\[0\]`"):
        msgspec.msgpack.decode(msgspec.msgpack.encode([1, [1]]), type=EngineCoreRequest)
