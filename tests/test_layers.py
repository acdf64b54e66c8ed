"""Layers: shmclient never imports an engine, and the engine a client uses is a parameter.

``EngineConfig.engine_module`` names it: the multiprocess clients run ``python -m <it>``,
``InprocClient`` calls its ``make_core``. These tests import every shmclient module in a
fresh interpreter and check that no engine module came along, and launch a user's engine
module (written to a temporary directory, wrapping the project's engine) on every kind of
client. The ring's own modules (the shared base and its two ends) are read for what they
import: nothing above them, and not each other in a circle. Every transport module
(segments, rings, codec, tensors, framing, channels, statistics) is read the same way: none
imports ``waiting``, a client, asyncio or the engine, and the codec reaches the tensor
transport only through its protocols.
"""

from __future__ import annotations

import ast
import glob
import json
import os
import subprocess
import sys
import textwrap

import psutil
import pytest

from shmclient import ConfigError, EngineDeadError, SyncMPClient, gpus
from shmclient.config import EngineConfig

from .drivers import Driver, build, req

ROOT = __file__.rsplit("/tests/", 1)[0]


def test_no_shmclient_module_imports_an_engine():
    # Walk the package in the child, so that a module added later is covered too; the
    # vLLM adapter is left out (it imports vLLM, which is not installed here). Then run a
    # multiprocess client there: launching the default engine must not import it either.
    code = textwrap.dedent(
        """
        import importlib, json, pkgutil, sys
        import shmclient
        names = sorted(m.name for m in pkgutil.walk_packages(shmclient.__path__, "shmclient.")
                       if not m.name.startswith("shmclient.vllm"))
        for name in names:
            importlib.import_module(name)
        def engine():
            return sorted(m for m in sys.modules
                          if m.split(".")[0] in ("shmclient_engine", "tests"))
        after_import = engine()
        c = shmclient.SyncMPClient(shmclient.EngineConfig(model="mock", max_model_len=64))
        try:
            assert c.echo(5) == 5
        finally:
            c.shutdown()
        print(json.dumps({"imported": names, "engine": after_import, "after_run": engine()}))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout)
    must_cover = {"shmclient.client", "shmclient.client_inproc", "shmclient.client_mp",
                  "shmclient.client_async", "shmclient.launcher", "shmclient.channel",
                  "shmclient.validate", "shmclient.config", "shmclient.control"}
    assert must_cover <= set(got["imported"]), sorted(must_cover - set(got["imported"]))
    assert got["engine"] == [], got["engine"]
    assert got["after_run"] == [], got["after_run"]


def test_a_client_and_the_mock_engine_load_torch_only_once_a_tensor_crosses():
    # Start-up: torch takes about a second to import, and neither a client nor an engine
    # process with the mock model needs it until a tensor crosses (here a pooled vector).
    # Then the engine runs it with EngineConfig.cpu_threads threads, as when it loaded it
    # at start.
    if gpus.gpu_driver_present():
        pytest.skip("a GPU driver is present: the handshake asks torch for the GPUs")
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one CPU: torch's own default is the one thread the engine is given")
    threads = 1
    code = textwrap.dedent(
        f"""
        import json, sys
        import shmclient
        from shmclient import EngineConfig, EngineCoreRequest, PoolingParams, SamplingParams
        c = shmclient.SyncMPClient(EngineConfig(
            model="mock", max_model_len=64, cpu_threads={threads},
            utility_modules=("tests.user_utilities",)))
        def run(rid, **kw):
            c.add_request(EngineCoreRequest(request_id=rid, prompt_token_ids=[3, 4, 5], **kw))
            while True:
                for out in c.get_output(timeout=30).outputs:
                    if out.request_id == rid and out.finished:
                        return out
        try:
            run("gen", sampling_params=SamplingParams(max_tokens=4))
            before = ["torch" in sys.modules, c.call_utility("torch_threads")]
            pooled = run("pool", pooling_params=PoolingParams()).pooling_output
            after = ["torch" in sys.modules, c.call_utility("torch_threads")]
        finally:
            c.shutdown()
        print(json.dumps({{"before": before, "after": after,
                          "pooled": [type(pooled).__module__, pooled[:3].tolist()]}}))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout)
    assert got["before"] == [False, None]
    assert got["after"] == [True, threads]
    assert got["pooled"] == ["torch", [3.0, 4.0, 5.0]]


def test_an_engine_whose_model_loads_torch_has_exactly_cpu_threads():
    # The tiny model loads torch as the core is built: the count is then set exactly, not
    # through the environment (which torch caps at the host's cores).
    threads = (os.cpu_count() or 1) + 1
    c = SyncMPClient(EngineConfig(model="tiny", max_model_len=64, cpu_threads=threads,
                                  utility_modules=("tests.user_utilities",)))
    try:
        assert c.call_utility("torch_threads") == threads
    finally:
        c.shutdown()


#: What each of the ring's modules may import from the package (anywhere in the module,
#: at the top or inside a function): the base never its ends, an end never the other one.
RING_LAYER = {
    "ring_resources": {"_ring", "shm"},
    "ring": {"_ring", "doorbell", "errors", "forksafe", "ring_resources", "shm", "stats"},
    "ring_producer": {"_ring", "doorbell", "errors", "ring"},
    "ring_consumer": {"_ring", "doorbell", "errors", "ring"},
}
#: Never imported by the ring's modules: the waiting layer and what sits above it.
ABOVE_THE_RING = {"asyncio", "shmclient.waiting", "shmclient.channel", "shmclient.client"}


def _imports(path: str) -> tuple[set[str], set[str]]:
    """(modules of the package, other top-level modules) that ``path`` imports."""
    ours, other = set(), set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from . import x, y / from .x import y
                if node.module:
                    ours.add(node.module.split(".")[0])
                else:
                    ours.update(a.name for a in node.names)
            elif node.module.split(".")[0] == "shmclient":
                rest = node.module.split(".")[1:]
                ours.update([rest[0]] if rest else [a.name for a in node.names])
            else:
                other.add(node.module)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "shmclient":
                    ours.add(a.name.split(".")[1] if "." in a.name else "shmclient")
                else:
                    other.add(a.name)
    return ours, other


def test_the_ring_layer_imports_nothing_above_it_and_no_circle():
    for name, allowed in RING_LAYER.items():
        ours, other = _imports(os.path.join(ROOT, "shmclient", f"{name}.py"))
        assert ours <= allowed, f"shmclient.{name} imports {sorted(ours - allowed)}"
        above = ({f"shmclient.{m}" for m in ours} | other) & ABOVE_THE_RING
        assert not above, f"shmclient.{name} imports {sorted(above)}"
    # the ends import the base; the base none of them (no lazy import either)
    assert not _imports(os.path.join(ROOT, "shmclient", "ring.py"))[0] & {"ring_producer", "ring_consumer"}


#: The transport under ``waiting``: segments, rings, codec, tensors, channels, and the
#: records and checks they share. A module added under one of these names is covered.
TRANSPORT = ("shm.py", "capacity.py", "ring*.py", "codec*.py", "dtypes.py", "tensors*.py",
             "gpus.py", "framing.py", "channel*.py", "stats.py")
#: What each codec module and the statistics records may import from the package: the
#: codec reaches tensors only through its protocols, never the transport's modules.
LEAF_LAYER = {
    "codec": {"codec_decoder", "codec_tensor", "dtypes", "errors"},
    "codec_decoder": {"codec_tensor", "dtypes", "errors"},
    "codec_tensor": {"errors"},
    "stats": set(),
    "capacity": {"errors"},
}


def _transport_modules() -> list[str]:
    return sorted({os.path.basename(p)[:-3] for pattern in TRANSPORT
                   for p in glob.glob(os.path.join(ROOT, "shmclient", pattern))})


def _above_the_transport(path: str) -> list[str]:
    """What ``path`` imports (anywhere in it) from above the transport: ``waiting``, a
    client module, asyncio or the engine."""
    ours, other = _imports(path)
    bad = {f"shmclient.{m}" for m in ours if m == "waiting" or m.startswith("client")}
    bad |= {m for m in other if m.split(".")[0] in ("asyncio", "shmclient_engine")}
    return sorted(bad)


def test_the_transport_imports_nothing_above_it(tmp_path):
    names = _transport_modules()
    assert {"shm", "capacity", "ring", "ring_resources", "ring_producer", "ring_consumer", "codec",
            "codec_decoder", "codec_tensor", "tensors", "tensors_handles", "tensors_sender",
            "tensors_receiver", "tensors_cuda", "framing", "channel", "channel_spec", "channel_zmq",
            "channel_handles", "stats", "dtypes", "gpus"} <= set(names), names
    for name in names:
        path = os.path.join(ROOT, "shmclient", f"{name}.py")
        assert _above_the_transport(path) == [], f"shmclient.{name} imports {_above_the_transport(path)}"
    for name, allowed in LEAF_LAYER.items():
        ours, _ = _imports(os.path.join(ROOT, "shmclient", f"{name}.py"))
        assert ours <= allowed, f"shmclient.{name} imports {sorted(ours - allowed)}"
    # The check sees an import wherever it is written, in every spelling.
    probe = tmp_path / "probe.py"
    probe.write_text("import os\nfrom . import errors\n"
                     "def f():\n    import asyncio.events\n    from . import waiting\n"
                     "    from .client_mp import SyncMPClient\n    import shmclient.client_async\n"
                     "    from shmclient_engine.core import EngineCore\n")
    assert _above_the_transport(str(probe)) == [
        "asyncio.events", "shmclient.client_async", "shmclient.client_mp", "shmclient.waiting",
        "shmclient_engine.core"]


#: The ring's modules: the vLLM plug-in reaches rings only through the channel (and waits
#: through ``waiting``), never through one of these.
RING_MODULES = {"_ring", "ring", "ring_resources", "ring_producer", "ring_consumer"}


def _package_imports(path: str, depth: int) -> set[str]:
    """The ``shmclient`` modules that ``path`` (a module ``depth`` packages below
    ``shmclient``) imports, anywhere in it: ``from .. import x`` at depth 1 names
    ``shmclient.x``; ``from . import y`` there names a sibling and is left out."""
    out = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.ImportFrom):
            if node.level == depth + 1:
                out.update([node.module.split(".")[0]] if node.module else [a.name for a in node.names])
            elif node.level == 0 and node.module.split(".")[0] == "shmclient":
                rest = node.module.split(".")[1:]
                out.update([rest[0]] if rest else [a.name for a in node.names])
        elif isinstance(node, ast.Import):
            out.update(a.name.split(".")[1] for a in node.names
                       if a.name.split(".")[0] == "shmclient" and "." in a.name)
    return out


def test_the_vllm_plugin_imports_no_ring_module(tmp_path):
    paths = sorted(glob.glob(os.path.join(ROOT, "shmclient", "vllm", "*.py")))
    assert len(paths) > 10, paths
    for path in paths:
        got = _package_imports(path, 1) & RING_MODULES
        assert got == set(), f"{os.path.relpath(path, ROOT)} imports {sorted(got)}"
    # The check sees every spelling, at the top or inside a function.
    probe = tmp_path / "probe.py"
    probe.write_text("from .. import waiting\nfrom ..channel import SPIN_GATE\nfrom . import wire\n"
                     "from .ring import x\ndef f():\n    from .. import _ring, shm\n"
                     "    from ..ring_consumer import RingConsumer\n    import shmclient.ring_producer\n"
                     "    from shmclient import ring\n")
    assert _package_imports(str(probe), 1) == {"waiting", "channel", "_ring", "shm", "ring_consumer",
                                               "ring_producer", "ring"}


USER_ENGINE = '''
"""A user's engine: the project's engine, with a KV cache of exactly 123 blocks."""
import shmclient_engine
from shmclient import serve

BLOCKS = 123


def make_core(config, *, supports_wait=False):
    return shmclient_engine.make_core(config.replace(num_gpu_blocks=BLOCKS),
                                      supports_wait=supports_wait)


if __name__ == "__main__":
    serve.main(make_core=make_core)
'''


#: A third-party engine: its own core (the EngineCore Protocol), served by shmclient alone.
THIRD_PARTY_ENGINE = '''
"""Answers each request with its prompt reversed, one token a step."""
import sys

from shmclient import serve
from shmclient.messages import EngineCoreOutput, EngineCoreOutputs, FinishReason


class Core:
    num_gpu_blocks, block_size, max_model_len = 7, 16, 112

    def __init__(self):
        self.left = {}

    def add_request(self, request):
        self.left[request.request_id] = (request.client_index, list(reversed(request.prompt_token_ids)))

    def abort_requests(self, request_ids):
        for rid in request_ids:
            del self.left[rid]  # strict: an id it does not have raises KeyError

    def has_work(self):
        return bool(self.left)

    def step(self):
        out = {}
        for rid, (client, toks) in list(self.left.items()):
            tok = toks.pop(0)
            done = not toks
            if done:
                del self.left[rid]
            out.setdefault(client, EngineCoreOutputs()).outputs.append(EngineCoreOutput(
                request_id=rid, new_token_ids=[tok], finish_reason=FinishReason.LENGTH if done else None))
        return out

    def call_utility(self, method, args):
        if method == "imported":
            return sorted(m for m in sys.modules if m.split(".")[0] == args[0])
        raise ValueError(f"no utility {method!r}")

    def shutdown(self):
        pass


def make_core(config, *, supports_wait=False):
    return Core()


if __name__ == "__main__":
    serve.main(make_core=make_core)
'''


@pytest.fixture
def user_path(tmp_path, monkeypatch):
    """A directory with a user's modules, on this process's path and the engine's."""
    (tmp_path / "user_engine.py").write_text(USER_ENGINE)
    (tmp_path / "third_party_engine.py").write_text(THIRD_PARTY_ENGINE)
    (tmp_path / "plain_module.py").write_text("print('not an engine')\n")
    (tmp_path / "bare_package").mkdir()
    (tmp_path / "bare_package" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    yield tmp_path
    for name in ("user_engine", "third_party_engine", "plain_module", "bare_package"):
        sys.modules.pop(name, None)


CFG = EngineConfig(model="mock", max_model_len=256, engine_module="user_engine")


async def first_tokens(drv: Driver, n: int) -> list[int]:
    """The tokens of the outputs read until ``n`` came (at most 50 output batches)."""
    tokens: list[int] = []
    for _ in range(50):
        out = await drv.get_output(timeout=30)
        tokens += [t for o in out.outputs for t in o.new_token_ids]
        if len(tokens) == n:
            break
    return tokens


@pytest.mark.parametrize("kind", ["inproc", "sync-shm", "async-zmq"])
async def test_a_user_engine_module_is_launched(kind, user_path):
    client = build(kind, CFG)
    drv = Driver(kind, client)
    try:
        # 123 blocks of 16 tokens: only the user's make_core says so.
        assert client.num_gpu_blocks == 123
        if kind != "inproc":
            cmd = psutil.Process(client.engine_pid).cmdline()
            assert cmd[1:3] == ["-m", "user_engine"], cmd
        await drv.add(req("r", max_tokens=3))
        tokens = await first_tokens(drv, 3)
        assert len(tokens) == 3
    finally:
        client.shutdown()


@pytest.mark.parametrize("kind", ["sync-shm", "async-zmq"])
async def test_a_third_party_engine_is_served_without_the_projects_engine(kind, user_path):
    client = build(kind, CFG.replace(engine_module="third_party_engine"))
    drv = Driver(kind, client)
    try:
        assert client.num_gpu_blocks == 7
        await drv.add(req("r", prompt=[5, 6, 7], max_tokens=8))
        tokens = await first_tokens(drv, 3)
        assert tokens == [7, 6, 5]
        assert await drv.call_utility("imported", "shmclient_engine") == []
        # Its abort_requests raises for an id it does not have: that abort is dropped
        # with a log line, the engine goes on serving.
        await drv.abort(["nobody"])
        await drv.add(req("r2", prompt=[1, 2], max_tokens=8))
        assert await first_tokens(drv, 2) == [2, 1]
    finally:
        client.shutdown()


@pytest.mark.parametrize("kind", ["inproc", "sync-shm"])
async def test_a_third_party_engine_is_refused_duplicates_and_spared_unknown_aborts(kind, user_path, caplog):
    """The third-party core neither refuses a live id (its add_request replaces the
    request) nor ignores an unknown abort (KeyError): every client keeps the live ids and
    refuses the duplicate itself, and drops the refused abort with a log line, so the
    live request's output is intact."""
    from shmclient import InvalidRequestError

    client = build(kind, CFG.replace(engine_module="third_party_engine"))
    drv = Driver(kind, client)
    try:
        await drv.add(req("a", prompt=[5, 6, 7], max_tokens=8))
        with pytest.raises(InvalidRequestError, match="request id 'a' is already live"):
            await drv.add(req("a", prompt=[9], max_tokens=8))
        await drv.abort(["unknown"])
        r = await drv.collect(["a"])
        assert r["a"]["tokens"] == [7, 6, 5] and r["a"]["n_finished"] == 1
        if kind == "inproc":  # the engine process logs in its own process
            assert "dropped an abort of 1 request(s) that the engine core refused" in caplog.text
        # Its final output returned, the id may be used again.
        await drv.add(req("a", prompt=[1, 2], max_tokens=8))
        assert (await drv.collect(["a"]))["a"]["tokens"] == [2, 1]
    finally:
        client.shutdown()


def test_the_projects_engine_in_process_refuses_a_live_id_as_a_duplicate():
    """In-process the client refuses the duplicate before the engine sees it, with the
    type the engine raised before (DuplicateRequestError, an InvalidRequestError as the
    multiprocess clients raise), also for an aborted id whose ABORT output is not out."""
    from shmclient import DuplicateRequestError, FinishReason, InprocClient

    client = InprocClient(EngineConfig(model="mock", max_model_len=64))
    try:
        client.add_request(req("a", max_tokens=2))
        client.abort_requests(["a"])
        with pytest.raises(DuplicateRequestError, match="already live"):
            client.add_request(req("a", max_tokens=2))
        assert [(o.request_id, o.finish_reason) for o in client.get_output().outputs] == [
            ("a", FinishReason.ABORT)]
        client.add_request(req("a", max_tokens=2))  # reported: the id is free again
    finally:
        client.shutdown()


def test_inproc_passes_supports_wait_to_a_make_core_without_its_default(user_path, monkeypatch):
    """Defect: InprocClient called make_core(config), so an engine whose keyword-only
    ``supports_wait`` has no default failed with a raw TypeError. InprocClient passes the
    keyword (False: nothing steps the engine in-process while a pause in mode "wait"
    drains), as the engine process's loop passes True."""
    from shmclient import InprocClient

    (user_path / "strict_engine.py").write_text(textwrap.dedent("""
        import third_party_engine
        SEEN = []

        def make_core(config, *, supports_wait):
            SEEN.append(supports_wait)
            return third_party_engine.Core()
        """))
    monkeypatch.delitem(sys.modules, "strict_engine", raising=False)
    try:
        client = InprocClient(CFG.replace(engine_module="strict_engine"))
        client.shutdown()
        assert client.num_gpu_blocks == 7 and sys.modules["strict_engine"].SEEN == [False]
    finally:
        sys.modules.pop("strict_engine", None)



def test_inproc_still_builds_an_engine_whose_make_core_takes_the_config_only(user_path, monkeypatch):
    """An in-process engine written as ``make_core(config)`` (what InprocClient called
    before it passed ``supports_wait``) is still built, not refused with a TypeError."""
    from shmclient import InprocClient

    (user_path / "plain_engine.py").write_text(textwrap.dedent("""
        import third_party_engine

        def make_core(config):
            return third_party_engine.Core()
        """))
    monkeypatch.delitem(sys.modules, "plain_engine", raising=False)
    try:
        client = InprocClient(CFG.replace(engine_module="plain_engine"))
        client.shutdown()
        assert client.num_gpu_blocks == 7
    finally:
        sys.modules.pop("plain_engine", None)

async def test_data_parallel_counts_a_third_party_engines_finished_requests(user_path):
    """The third-party core leaves ``finished_requests`` unset (vLLM's engines set it only
    under data parallelism): the DP client still sees its requests finish by their
    finish reason, so nothing stays counted in flight."""
    from shmclient import DPLBAsyncMPClient

    cfg = CFG.replace(engine_module="third_party_engine", data_parallel_size=2)
    async with await DPLBAsyncMPClient.create(cfg) as client:
        for i in range(4):
            await client.add_request_async(req(f"r{i}", prompt=[1, 2, 3], max_tokens=8))
        finished: set[str] = set()
        while len(finished) < 4:
            out = await client.get_output_async(timeout=30)
            finished |= {o.request_id for o in out.outputs if o.finish_reason is not None}
        assert client.reqs_in_flight == {} and not client.dp_engines_running()


@pytest.mark.parametrize("kind", ["inproc", "sync-shm", "async-zmq"])
def test_an_engine_module_that_does_not_exist_is_a_config_error(kind):
    with pytest.raises(ConfigError, match="EngineConfig.engine_module='no_such_engine_mod'"):
        build(kind, CFG.replace(engine_module="no_such_engine_mod"))
    with pytest.raises(ConfigError, match="engine_module='shmclient_engine.no_such'"):
        build(kind, CFG.replace(engine_module="shmclient_engine.no_such"))


@pytest.mark.parametrize("kind", ["inproc", "sync-shm"])
def test_an_engine_module_without_the_entry_point_is_a_config_error(kind, user_path):
    # In-process the entry point is make_core; for the engine process it is
    # "python -m <module>" speaking the handshake.
    for module, why in (("plain_module", "make_core" if kind == "inproc" else "handshake"),
                        ("bare_package", "make_core" if kind == "inproc" else "__main__")):
        with pytest.raises(ConfigError) as info:
            build(kind, CFG.replace(engine_module=module))
        text = str(info.value)
        assert f"EngineConfig.engine_module={module!r}" in text and why in text, text


def test_a_config_error_of_the_engine_itself_still_names_its_field(user_path):
    # The engine module is found and runs; what it refuses is reported as before.
    with pytest.raises(ConfigError, match="utility_modules"):
        build("sync-shm", CFG.replace(utility_modules=("tests.no_such_mod",)))


def test_engine_dead_error_is_not_a_config_error_once_the_handshake_began(monkeypatch):
    from . import fault_engine

    with pytest.raises(EngineDeadError) as info:
        build("sync-shm", EngineConfig(model="mock", engine_ready_timeout_s=60,
                                       **fault_engine.inject(monkeypatch, "exit_before_ready:3")))
    assert not isinstance(info.value, ConfigError)
    assert "exit code 3" in str(info.value) and "tests.fault_engine" in str(info.value)


def test_python_started_beside_a_folder_named_shmclient_imports_the_package(tmp_path):
    """Defect: run from the folder holding the clone (itself named shmclient), Python took
    the clone for an empty namespace package: "cannot import name 'EngineConfig' from
    'shmclient' (unknown location)". The README's install (editable_mode=compat, or a
    plain install) puts the real package first."""
    (tmp_path / "shmclient").mkdir()  # stands in for the clone's folder
    r = subprocess.run(
        [sys.executable, "-c", "from shmclient import EngineConfig; import shmclient; print(shmclient.__file__)"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith(os.path.join("shmclient", "__init__.py"))


def test_channels_and_ring_ends_have_the_interface_waiting_is_written_against():
    from shmclient import waiting
    from shmclient.channel import ShmChannel
    from shmclient.channel_zmq import ZmqChannel
    from shmclient.ring_consumer import RingConsumer
    from shmclient.ring_producer import RingProducer

    for cls in (ShmChannel, ZmqChannel):
        assert issubclass(cls, waiting.Channel), cls
    assert issubclass(RingProducer, waiting.Sender)
    assert issubclass(RingConsumer, waiting.RecordReceiver)
    assert not issubclass(RingProducer, waiting.Receiver)
    assert not issubclass(RingConsumer, waiting.Sender)

    class NoAbandon:
        def send_nowait(self, rtype, payload): ...

        def wait_send(self, timeout, *, spin=None, first=True): ...

    assert not issubclass(NoAbandon, waiting.Sender)


def test_optional_channel_capabilities_are_attributes_not_types():
    """Each optional capability is an attribute on every channel, None where the channel
    cannot do it; whoever sets a channel up asks for the attribute, not the type."""
    import ast
    import inspect

    from shmclient import client_async, client_mp, launcher, serve, waiting
    from shmclient.channel import ShmChannel
    from shmclient.channel_zmq import ZmqChannel

    assert set(waiting.CAPABILITIES) | set(waiting.FLAGS) == set(waiting.ChannelCapabilities.__annotations__)
    assert ZmqChannel.late_after_peer_death and not ShmChannel.late_after_peer_death
    assert ShmChannel.arm_after_read and not ZmqChannel.arm_after_read
    for name in waiting.CAPABILITIES:
        assert hasattr(ShmChannel, name) and hasattr(ZmqChannel, name), name
    assert [n for n in waiting.CAPABILITIES if getattr(ZmqChannel, n) is not None] == ["wait_registered"]
    assert [n for n in waiting.CAPABILITIES if getattr(ShmChannel, n) is None] == ["wait_registered"]
    for module in (launcher, client_mp, client_async, serve):
        tree = ast.parse(inspect.getsource(module))
        checks = [ast.unparse(n) for n in ast.walk(tree)
                  if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "isinstance"
                  and "Channel" in ast.unparse(n.args[1])]
        assert checks == [], (module.__name__, checks)
