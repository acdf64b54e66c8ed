"""EngineConfig: defaults, immutability, msgpack round trip, and one ConfigError per bad
value, each naming its field and the value."""

from __future__ import annotations

import msgspec
import pytest

from shmclient.config import MiB, EngineConfig
from shmclient.errors import ConfigError


def test_defaults_are_valid_and_documented_values():
    c = EngineConfig()
    assert (c.model, c.device, c.transport) == ("mock", "cpu", "shm")
    assert c.max_model_len == 2048 and c.block_size == 16 and c.num_gpu_blocks is None
    assert c.kv_cache_memory_bytes == 256 * MiB and c.ring_capacity_bytes == 4 * MiB
    assert c.tensor_arena_bytes == 64 * MiB and c.gpu_memory_utilization == 0.5
    assert c.engine_ready_timeout_s is None and c.enable_cuda_ipc is True
    assert c.fault_injection is None and c.utility_modules == ()
    assert c.engine_module == "shmclient_engine" and c.step_delay_s == 0.0


def test_frozen_and_keyword_only():
    c = EngineConfig()
    with pytest.raises(AttributeError):
        c.seed = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        EngineConfig("tiny")  # type: ignore[misc]


def test_msgpack_round_trip():
    c = EngineConfig(model="tiny", device="cuda:1", num_gpu_blocks=7, step_delay_s=0.25,
                     engine_module="pkg.engine",
                     engine_ready_timeout_s=2.5)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(c), type=EngineConfig)
    assert back == c


def test_decoding_validates_too():
    raw = msgspec.msgpack.encode({"block_size": 0})
    with pytest.raises(msgspec.ValidationError, match="block_size"):
        msgspec.msgpack.decode(raw, type=EngineConfig)


def test_replace_validates_and_copies():
    c = EngineConfig()
    d = c.replace(seed=5, device="cuda")
    assert (d.seed, d.device, c.seed, c.device) == (5, "cuda", 0, "cpu")
    with pytest.raises(ConfigError, match="max_num_seqs"):
        c.replace(max_num_seqs=0)


# One test per list, not one per value: the autouse leak check costs ~0.1 s a test.
BAD_VALUES = [
    ("model", "gpt2"), ("model", 1), ("device", "gpu"), ("device", "cuda:"),
    ("device", "cuda:-1"), ("device", "cuda:01"), ("device", "CPU"), ("transport", "tcp"),
    ("max_model_len", 0), ("max_model_len", 1.5), ("max_model_len", True),
    ("block_size", 0), ("block_size", -16), ("num_gpu_blocks", 0), ("num_gpu_blocks", "8"),
    ("max_num_seqs", 0), ("max_num_batched_tokens", 0), ("seed", -1), ("seed", 2**64),
    ("seed", 1.0), ("kv_cache_memory_bytes", 0), ("gpu_memory_utilization", 0.0),
    ("gpu_memory_utilization", 1.5), ("gpu_memory_utilization", float("nan")),
    ("gpu_memory_utilization", "0.5"), ("vocab_size", 0), ("hidden_size", 0),
    ("hidden_size", 66), ("num_layers", 0), ("num_heads", 0), ("eos_token_id", -1),
    ("eos_token_id", 1024), ("ring_capacity_bytes", 100), ("tensor_arena_bytes", -1), ("cpu_threads", 0),
    ("spin_us", -1.0), ("spin_us", float("inf")), ("spin_us", None),
    ("engine_ready_timeout_s", 0), ("engine_ready_timeout_s", -1.0),
    ("enable_cuda_ipc", 1), ("fault_injection", 3), ("fault_injection", "raise_in_step:3"),
    ("fault_injection", "hang_before_ready"), ("fault_injection", "exit_before_ready:7"),
    ("fault_injection", "step_delay:-1"), ("fault_injection", "step_delay:nan"),
    ("fault_injection", "step_delay:"), ("step_delay_s", -0.5), ("step_delay_s", "0.1"),
    ("step_delay_s", float("inf")), ("engine_module", ""), ("engine_module", "a b"),
    ("engine_module", "pkg..eng"), ("engine_module", None),
    ("utility_modules", "tests.user_utilities"), ("utility_modules", ("a b",)),
    ("utility_modules", ("",)), ("utility_modules", (3,)), ("utility_modules", ("a..b",)),
]


def test_each_bad_value_names_its_field():
    for field, value in BAD_VALUES:
        with pytest.raises(ConfigError) as info:
            EngineConfig(**{field: value})
        text = str(info.value)
        assert field in text and repr(value) in text, (field, value, text)


def test_ints_past_what_the_config_carries_are_refused_naming_the_field():
    """An int past msgpack's 64 bits was taken here and failed the engine's start with
    OverflowError (an untyped error after the engine process started); a number past
    any float failed the finiteness check the same way."""
    for field, value in (("max_model_len", 2**64), ("kv_cache_memory_bytes", 2**63),
                         ("num_gpu_blocks", 2**64), ("tensor_arena_bytes", 2**64),
                         ("max_num_seqs", 10**5000), ("spin_us", 10**400),
                         ("step_delay_s", 10**400)):
        with pytest.raises(ConfigError, match=f"EngineConfig.{field}=.* is invalid"):
            EngineConfig(**{field: value})


def test_which_ranks_are_remote_behind_an_external_load_balancer():
    ext = dict(data_parallel_size=4, data_parallel_external_lb=True, data_parallel_rank=3)
    assert not EngineConfig(**ext, data_parallel_size_local=1).is_remote
    assert not EngineConfig(**ext).is_remote
    assert EngineConfig(**ext, data_parallel_size_local=0, data_parallel_address="127.0.0.1",
                        transport="zmq").is_remote
    with pytest.raises(ConfigError, match="each client serves one rank"):
        EngineConfig(**ext, data_parallel_size_local=2)
    internal = dict(data_parallel_size=4, data_parallel_size_local=2, data_parallel_address="127.0.0.1")
    assert [EngineConfig(**internal).rank_is_remote(r) for r in range(4)] == [False, False, True, True]


def test_unknown_model_lists_valid_ones():
    with pytest.raises(ConfigError, match="'mock', 'tiny'"):
        EngineConfig(model="llama")


VALID = [
    dict(device="cuda"), dict(device="cuda:12"), dict(model="tiny"), dict(transport="zmq"),
    dict(num_gpu_blocks=1), dict(spin_us=0), dict(gpu_memory_utilization=1),
    dict(engine_ready_timeout_s=0.1), dict(step_delay_s=0.5), dict(step_delay_s=0),
    dict(engine_module="tests.fault_engine"),
    dict(hidden_size=12, num_heads=3), dict(vocab_size=3, eos_token_id=2),
]


def test_utility_modules_list_becomes_a_tuple_and_survives_msgpack():
    c = EngineConfig(utility_modules=["tests.user_utilities", "pkg.mod_2"])
    assert c.utility_modules == ("tests.user_utilities", "pkg.mod_2")
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(c), type=EngineConfig)
    assert back == c and hash(back) == hash(c)


def test_valid_values():
    for kw in VALID:
        c = EngineConfig(**kw)
        for k, v in kw.items():
            assert getattr(c, k) == v


def test_legacy_step_delay_spelling_is_the_same_config_as_step_delay_s():
    old = EngineConfig(fault_injection="step_delay:0.01")
    assert old == EngineConfig(step_delay_s=0.01)
    assert (old.step_delay_s, old.fault_injection) == (0.01, None)
    assert EngineConfig(fault_injection="step_delay:0.01", step_delay_s=0.01) == old
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(old), type=EngineConfig)
    assert back == old
    with pytest.raises(ConfigError, match="fault_injection.*step_delay_s=0.02"):
        EngineConfig(fault_injection="step_delay:0.01", step_delay_s=0.02)


def test_test_directives_in_fault_injection_say_where_they_went():
    with pytest.raises(ConfigError) as info:
        EngineConfig(fault_injection="raise_in_step:3")
    text = str(info.value)
    assert "EngineConfig.fault_injection='raise_in_step:3'" in text
    assert "moved" in text and "engine_module" in text and "step_delay_s" in text
