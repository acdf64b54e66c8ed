"""What a section run in a child process of its own hands back to the run: ``SectionOutput``.

The child (``run_child``) runs ``shmclient_bench.<name>.run(quick)``, renders the result
with the section's own table function (``RENDERERS``) and writes both, or the error, as
JSON with ``msgspec.json``. The run reads the file back (``read_output``) into the
section's result type (``RESULT_TYPES``: every section has one; a section that can be
skipped, the union of its figures and ``section_results.Skipped``). ``section_main`` is
the command line of a section module run on its own. Imports the result types only,
never a section's measuring code (the run's own process reads the outputs).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import shutil
import signal
import threading
import tempfile
import traceback
from typing import Any, Generic, Iterator, Sequence, TypeVar

import msgspec
import numpy as np

from .contention_results import Contention
from .dp_results import DpBench
from .fairness_results import Fairness
from .ring_results import RingBench
from .section_results import Skipped
from .serving_results import ServingResult
from .tensor_results import TensorSweep
from .vllm_results import VllmResult

T = TypeVar("T")

#: The function of each section's module that renders its result as text.
RENDERERS = {
    "tensors": "table",
    "ring": "report",
    "contention": "report",
    "fairness": "report",
    "dp": "report",
    "vllm": "format_table",
    "serving": "format_table",
}

#: The typed result of each section.
RESULT_TYPES: dict[str, Any] = {
    "tensors": TensorSweep,
    "ring": RingBench,
    "contention": Contention,
    "fairness": Fairness,
    "dp": DpBench,
    "vllm": VllmResult,
    "serving": ServingResult,
}


def _numpy(o: Any) -> Any:
    """numpy values in a section's result, as the Python values they hold."""
    if isinstance(o, (np.generic, np.ndarray)):
        return o.tolist()
    raise NotImplementedError(f"cannot encode {type(o).__name__} as JSON")


#: Encodes a section's output (numpy values as plain numbers; NaN and inf as null).
ENCODER = msgspec.json.Encoder(enc_hook=_numpy)


class SectionOutput(msgspec.Struct, Generic[T], frozen=True, omit_defaults=True):
    """A section's result and its table, or why there is none.

    ``note``: the section ran but its table failed (``table`` is None then);
    ``error`` and ``traceback``: the section itself failed (no ``result``)."""

    result: T | None = None
    table: str | None = None
    note: str | None = None
    error: str | None = None
    traceback: str | None = None

    @property
    def skipped(self) -> str | None:
        """Why the section measured nothing (vLLM missing, say), when it says so: the
        sections that need vLLM return a ``Skipped`` then."""
        return self.result.reason if isinstance(self.result, Skipped) else None


def result_type(name: str) -> Any:
    return RESULT_TYPES.get(name, Any)


def run_child(name: str, quick: bool, path: str) -> int:
    """In the child: run ``shmclient_bench.<name>.run(quick)``, write its
    ``SectionOutput`` to ``path``. SIGTERM (the run stopping the section) raises
    KeyboardInterrupt, so the section's own clean-up runs; nothing is written then."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        mod = importlib.import_module(f"shmclient_bench.{name}")
        result = mod.run(quick)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        out: SectionOutput[Any] = SectionOutput(
            error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        rc = 1
    else:
        try:
            out = SectionOutput(result=result, table=getattr(mod, RENDERERS[name])(result))
        except Exception as e:
            out = SectionOutput(
                result=result,
                note=f"{name}: shmclient_bench.{name}'s table failed: {type(e).__name__}: {e}")
        rc = 0
    with open(path, "wb") as f:
        f.write(ENCODER.encode(out))
    return rc


def read_output(name: str, path: str) -> SectionOutput[Any] | None:
    """The output a child wrote for section ``name``, its result decoded into the
    section's type; None when the file is missing or unreadable."""
    try:
        with open(path, "rb") as f:
            data = f.read()
        return msgspec.json.decode(data, type=SectionOutput[result_type(name)])
    except (OSError, msgspec.DecodeError):
        return None


@contextlib.contextmanager
def private_tmpdir(prefix: str = "bench-section-") -> Iterator[str]:
    """A temporary folder of its own for what a section and its children put in one
    (vLLM's ipc sockets, its compile and distributed files): ``TMPDIR`` and
    ``tempfile.tempdir`` point at it meanwhile, and it is removed afterwards, whatever
    happens, with both restored."""
    old_tempdir, old_env = tempfile.tempdir, os.environ.get("TMPDIR")
    path = tempfile.mkdtemp(prefix=prefix)
    tempfile.tempdir = path
    os.environ["TMPDIR"] = path
    try:
        yield path
    finally:
        tempfile.tempdir = old_tempdir
        if old_env is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = old_env
        shutil.rmtree(path, ignore_errors=True)


def section_main(argv: Sequence[str] | None, doc: str, run: Any, render: Any, quick_help: str) -> int:
    """The command line of a section module run on its own (``python -m
    shmclient_bench.<section> [--quick] [--json PATH]``): runs ``run(quick)``, prints
    ``render(result)``, writes the result as JSON when asked. Returns the exit status."""
    import argparse

    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--json", metavar="PATH", help="write the figures as JSON here")
    args = ap.parse_args(argv)
    # SIGTERM ends the section as Ctrl-C does: its clean-up runs (busy processes, a
    # quota's cgroup, the temporary folder).
    old = None
    if threading.current_thread() is threading.main_thread():
        old = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        with private_tmpdir():
            res = run(args.quick)
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)
    print(render(res))
    if args.json:
        with open(args.json, "wb") as f:
            f.write(msgspec.json.format(ENCODER.encode(res), indent=2))
    return 0
