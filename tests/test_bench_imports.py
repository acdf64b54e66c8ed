"""Every benchmark name the tests and the benchmark itself use still resolves: each
``from shmclient_bench... import X``, each ``module.attr`` on a name bound to a
shmclient_bench module, and each 'shmclient_bench.x.y' written in a string (a module to
run with ``-m``, a name in a docstring). Read statically with ``ast``, so that a module
split or a renamed name cannot break a test file that needs vLLM to run."""

from __future__ import annotations

import ast
import importlib
import os
import re
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = "shmclient_bench"
#: Names a test makes up for itself (a fake section put in sys.modules).
MADE_UP = {"shmclient_bench.fake"}


def _resolve(dotted: str) -> object | None:
    """The object a dotted name 'shmclient_bench.a.b' names, or None."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as e:
            if e.name is not None and e.name.split(".")[0] != PKG:
                raise  # a dependency missing here: say so, do not pass
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return None
            obj = getattr(obj, attr)
        return obj
    return None


def _files() -> list[str]:
    out = []
    for top in ("tests", PKG):
        for dirpath, _, names in os.walk(os.path.join(ROOT, top)):
            out += [os.path.join(dirpath, n) for n in names if n.endswith(".py")]
    return sorted(p for p in out if p != os.path.abspath(__file__))  # (its own examples are made up)


def _uses(path: str) -> list[tuple[int, str]]:
    """(line, dotted name) of every shmclient_bench name ``path`` uses."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    rel = os.path.relpath(path, ROOT)[:-3].split(os.sep)
    package = rel if rel[-1] == "__init__" else rel[:-1]
    package = [p for p in package if p != "__init__"]
    uses: list[tuple[int, str]] = []
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == PKG:
                    uses.append((node.lineno, a.name))
                    aliases[a.asname or PKG] = a.name if a.asname else PKG
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] == PKG:
                for a in node.names:
                    uses.append((node.lineno, f"{base}.{a.name}"))
                    aliases[a.asname or a.name] = f"{base}.{a.name}"
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            uses += [(node.lineno, m.group(0)) for m in re.finditer(rf"\b{PKG}(?:\.[A-Za-z_]\w*)+", node.value)]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            if isinstance(_resolve(aliases[node.value.id]), types.ModuleType):
                uses.append((node.lineno, f"{aliases[node.value.id]}.{node.attr}"))
    return uses


def test_every_benchmark_name_used_resolves():
    files = _files()
    missing = [f"{os.path.relpath(path, ROOT)}:{line}: {name}"
               for path in files for line, name in _uses(path)
               if name not in MADE_UP and _resolve(name) is None]
    assert not missing, "\n".join(missing)
    # the check reads the vLLM tests' uses too, and sees a name that is not there
    serving_users = [n for p in files if os.path.basename(p).startswith("test_vllm_serve")
                     for _, n in _uses(p)]
    assert "shmclient_bench.serving.start_server" in serving_users
    assert _resolve("shmclient_bench.serving.no_such_name") is None
