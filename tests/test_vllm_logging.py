"""The vLLM plug-in says what it does: one INFO line when the rings take over a client,
one WARNING naming the reason when they do not (on vLLM's own logger, so the lines come
out with vLLM's)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

pytest.importorskip("vllm")

import shmclient.vllm as plugin  # noqa: E402
from shmclient_bench import vllm as bench_vllm  # noqa: E402


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_an_untested_version_logs_one_warning_naming_the_reason():
    h = _Records()
    plugin.log.addHandler(h)
    try:
        with pytest.warns(RuntimeWarning):
            assert plugin.supported_version("0.31.9") is False
    finally:
        plugin.log.removeHandler(h)
    warnings = [r for r in h.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    msg = warnings[0].getMessage()
    assert "this is vLLM 0.31.9" in msg and "vLLM's own ZMQ transport is used" in msg


def test_taking_over_logs_one_info_line(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(bench_vllm.CONFIG))
    code = f"""
        from vllm import LLM
        llm = LLM(model={str(model)!r}, **{bench_vllm.ENGINE_KW!r})
        del llm
    """
    env = dict(os.environ, SHMCLIENT_VLLM="1")
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                       timeout=280, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout + r.stderr
    lines = [ln for ln in out.splitlines() if "shmclient.vllm:" in ln and "shared-memory rings" in ln]
    assert len(lines) == 1, out[-3000:]
    assert "INFO" in lines[0] and "SyncMPClient" in lines[0]
