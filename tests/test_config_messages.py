"""EngineConfig's messages say what to do: an unknown field name gets the closest valid
one, and every invalid value names its field, before any engine starts."""

from __future__ import annotations

import pytest

from shmclient.config import EngineConfig, UnknownFieldError
from shmclient.errors import ConfigError


@pytest.mark.parametrize("typo,meant", [
    ("ring_capacity", "ring_capacity_bytes"), ("max_num_seq", "max_num_seqs"),
    ("spinus", "spin_us"), ("utility_module", "utility_modules"), ("devices", "device"),
])
def test_an_unknown_field_names_the_closest_one(typo, meant):
    with pytest.raises(UnknownFieldError) as info:
        EngineConfig(**{typo: 1})
    assert f"no field {typo!r}" in str(info.value) and f"did you mean {meant!r}" in str(info.value)
    # a TypeError, as Python says of an unknown keyword, and a ConfigError, as ours say
    assert isinstance(info.value, TypeError) and isinstance(info.value, ConfigError)
    with pytest.raises(UnknownFieldError, match=f"did you mean {meant!r}"):
        EngineConfig().replace(**{typo: 1})


def test_an_unknown_field_with_nothing_close_lists_the_fields():
    with pytest.raises(UnknownFieldError) as info:
        EngineConfig(bogus=1)
    text = str(info.value)
    assert "no field 'bogus'" in text and "ring_capacity_bytes" in text and "model" in text


def test_positional_arguments_keep_msgspecs_message():
    with pytest.raises(TypeError) as info:
        EngineConfig("tiny")  # type: ignore[misc]
    assert not isinstance(info.value, UnknownFieldError)


def test_a_ring_capacity_the_ring_refuses_is_refused_by_the_config_naming_the_field():
    # The ring takes multiples of 8 up to 1 TiB; these used to pass the config and fail
    # in the ring, with a message that named no field.
    for bad in (5001, 4097, (1 << 40) + 8):
        with pytest.raises(ConfigError, match=f"ring_capacity_bytes={bad}"):
            EngineConfig(ring_capacity_bytes=bad)
    assert EngineConfig(ring_capacity_bytes=5000).ring_capacity_bytes == 5000


WEIRD = [None, "x", -1, 0, 1.5, float("nan"), True, [1], {}, object(), 10**30, b"a", ("a",)]


def test_every_invalid_value_of_every_field_names_its_field():
    checked = 0
    for field in EngineConfig.__struct_fields__:
        for value in WEIRD:
            try:
                EngineConfig(**{field: value})
            except ConfigError as e:
                # its own field, or a pair (hidden_size=64 "must be a multiple of num_heads=7")
                assert f"{field}=" in str(e), (field, value, str(e))
                checked += 1
    assert checked > 300
