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

from .conftest import importorskip_vllm  # noqa: E402
importorskip_vllm()  # an error, not a skip, under SHMCLIENT_REQUIRE_VLLM=1

import shmclient.vllm as plugin  # noqa: E402
from shmclient_bench import vllm as bench_vllm  # noqa: E402


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_vllm_that_differs_logs_one_warning_naming_what_differs():
    from shmclient.vllm import versions

    got = list(versions.fingerprints())
    i = versions.TOUCHED.index(("vllm.v1.engine.core", "EngineCoreProc.process_input_sockets", "body"))
    got[i] = "0" * 16  # as if vLLM's input loop had changed
    h = _Records()
    plugin.log.addHandler(h)
    try:
        with pytest.warns(RuntimeWarning, match="process_input_sockets"):
            assert plugin.supported_version("0.32.9", tuple(got)) is False
    finally:
        plugin.log.removeHandler(h)
    warnings = [r for r in h.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    msg = warnings[0].getMessage()
    assert "vLLM 0.32.9 differs from the tested vLLM" in msg and "EngineCoreProc.process_input_sockets" in msg
    assert "vLLM's own ZMQ transport is used" in msg


def test_an_unknown_version_number_with_known_contents_runs_with_an_info_line():
    h = _Records()
    plugin.log.addHandler(h)
    # The logger's level is the process's logging set-up (vLLM's, once it configured its
    # loggers); this test is about what the plug-in logs, whatever ran before it.
    level = plugin.log.level
    plugin.log.setLevel(logging.INFO)
    try:
        assert plugin.supported_version("0.32.0+nv25.12") is True
    finally:
        plugin.log.setLevel(level)
        plugin.log.removeHandler(h)
    [info] = [r for r in h.records if r.levelno == logging.INFO]
    assert "0.32.0+nv25.12 is not a tested release" in info.getMessage()
    assert not [r for r in h.records if r.levelno == logging.WARNING]


def run_switched_on(code: str) -> str:
    """Run ``code`` in a fresh Python with SHMCLIENT_VLLM=1; its stdout and stderr."""
    env = dict(os.environ, SHMCLIENT_VLLM="1")
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                       timeout=280, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout + r.stderr


def test_taking_over_logs_one_info_line(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(bench_vllm.CONFIG))
    code = f"""
        from vllm import LLM
        llm = LLM(model={str(model)!r}, **{bench_vllm.ENGINE_KW!r})
        del llm
    """
    out = run_switched_on(code)
    lines = [ln for ln in out.splitlines() if "shmclient.vllm:" in ln and "shared-memory rings" in ln]
    assert len(lines) == 1, out[-3000:]
    assert "INFO" in lines[0] and "SyncMPClient" in lines[0]


def test_a_vllm_that_differs_runs_stock_with_one_warning(tmp_path):
    """Switched on with a vLLM whose input loop is not one the plug-in knows: the client
    is vLLM's own, it serves, and one WARNING says why."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(bench_vllm.CONFIG))
    code = f"""
        import vllm  # first, as when vLLM loads the plug-in: its logging is set up
        import shmclient.vllm.versions as versions
        real = versions.fingerprints
        versions.fingerprints = lambda root=None: ("0" * 16,) + real(root)[1:]
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        llm = LLM(model={str(model)!r}, **{bench_vllm.ENGINE_KW!r})
        print("CLIENT", type(llm.llm_engine.engine_core).__name__)
        out = llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7])], SamplingParams(max_tokens=3), use_tqdm=False)
        print("TOKENS", len(out[0].outputs[0].token_ids))
        del llm
    """
    out = run_switched_on(code)
    assert "CLIENT SyncMPClient" in out and "TOKENS 3" in out
    warns = [ln for ln in out.splitlines()
             if "WARNING" in ln and "shmclient.vllm:" in ln and "own ZMQ transport is used" in ln]
    assert len(warns) == 1 and "EngineCoreClient.make_client" in warns[0], out[-3000:]
