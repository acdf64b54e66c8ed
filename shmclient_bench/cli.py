"""The command line of ``python -m shmclient_bench``: its sections, defaults and options.

``build_parser`` is the argument parser (``--quick``, ``--only``, ``--configs``, ...);
``DEFAULTS`` what a quick and a full run measure unless told otherwise; ``SECTIONS`` and
``EXTERNAL`` the sections and those run in a child process of their own; ``_base_config``
reads ``--set FIELD=VALUE`` into an EngineConfig. Parsing only: it imports the client
configurations' names and the load threshold, never a section's measuring code, and
starts nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Sequence

from .client_configs import KINDS
from .load import THRESHOLD_CORES

SECTIONS = ("latency", "streaming", "idle", "tensors", "ring", "contention", "fairness", "dp", "vllm",
            "serving")
#: Sections that run in a child process of their own (``_external``).
EXTERNAL = ("tensors", "ring", "contention", "fairness", "dp", "vllm", "serving")

#: How long runs take on a 2-vCPU VM (2026-12-03; see the README).
QUICK_DURATION = "fewer samples, fewer vLLM engines and servers"
FULL_DURATION = ("about 28 minutes on a 2-vCPU VM with vLLM installed (2026-12-03: 22 for a full "
                 "run before the vllm section's data-parallel part, 6 for that part alone)")

#: Defaults per run kind; every one can be overridden on the command line.
DEFAULTS = {
    "quick": {
        "samples": 1000,
        "tiny_samples": 1000,
        "rounds": 2,
        "warmup": 50,
        "streams": "1,16",
        "tokens": 64,
        "idle_settle": 2.0,
        "idle_window": 1.5,
        "configs": "all",
        # The tiny model's realism check, shortened: no async clients.
        "tiny_configs": "inproc,sync-shm,sync-zmq",
        "section_timeout": 180.0,
        # vLLM's section starts ten engines (~40 s each), four of them beside busy processes
        "vllm_timeout": 900.0,
        # four vLLM servers one after another (~30-40 s to start each), two benchmark
        # runs against each
        "serving_timeout": 900.0,
    },
    "full": {
        "samples": 3000,
        "tiny_samples": 2100,
        "rounds": 3,
        "warmup": 200,
        "streams": "1,16,256",
        "tokens": 64,
        "idle_settle": 5.0,
        "idle_window": 5.0,
        "configs": "all",
        "tiny_configs": "all",
        "section_timeout": 900.0,
        "vllm_timeout": 2400.0,
        "serving_timeout": 1800.0,
    },
}


def _ints(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def _sections(text: str) -> tuple[str, ...]:
    vals = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [v for v in vals if v not in SECTIONS]
    if bad or not vals:
        raise argparse.ArgumentTypeError(
            f"unknown section(s) {', '.join(bad) or '(none)'}; expected some of {', '.join(SECTIONS)}"
        )
    return vals


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m shmclient_bench",
        description="shmclient benchmarks: client latency, streaming, idle CPU, tensor "
        f"transfer and raw ring, shm against the zmq baseline in one run. A full run "
        f"(the default) takes {FULL_DURATION}, --quick {QUICK_DURATION}; more on a busy "
        "host, whose figures the run marks noisy. Ctrl-C stops it cleanly (exit 130), "
        "keeping what finished.",
    )
    p.add_argument("--quick", action="store_true", help=f"a short run ({QUICK_DURATION})")
    p.add_argument(
        "--out",
        help="results folder, created by this run: it must not exist yet "
        "(default results/<timestamp>-<random>/)",
    )
    p.add_argument(
        "--configs",
        help="comma-separated configurations: "
        + ", ".join(KINDS)
        + "; 'kind@model' for one model only; 'all' for every kind (default: every kind "
        "for every model; in a quick run the tiny model only for inproc, sync-shm, sync-zmq)",
    )
    p.add_argument(
        "--models",
        default=None,
        help="models for plain kinds in --configs: mock, tiny, tiny-cuda (default mock,tiny; "
        "tiny-cuda added when a GPU is visible)",
    )
    p.add_argument("--only", type=_sections, default=SECTIONS, help="sections: " + ",".join(SECTIONS))
    p.add_argument("--samples", type=int, help="round trips per latency figure (quick 1000, full 3000)")
    p.add_argument(
        "--tiny-samples", type=int, help="round trips per tiny-model latency figure (quick 1000, full 2100)"
    )
    p.add_argument("--rounds", type=int, help="rounds in rotation (quick 2, full 3)")
    p.add_argument("--warmup", type=int, help="warm-up round trips per block, excluded (quick 50, full 200)")
    p.add_argument("--streams", type=_ints, help="concurrent requests N (quick 1,16; full 1,16,256)")
    p.add_argument("--tokens", type=int, help="tokens per streamed request M (64)")
    p.add_argument(
        "--stream-models", default="mock", help="models the streaming section runs for (mock)"
    )
    p.add_argument("--idle-settle", type=float, help="seconds idle before measuring (quick 2, full 5)")
    p.add_argument("--idle-window", type=float, help="seconds measured idle (quick 1.5, full 5)")
    p.add_argument(
        "--set",
        metavar="FIELD=VALUE",
        action="append",
        default=[],
        help="an EngineConfig field for every configuration, e.g. --set spin_us=100 "
        "(repeatable; transport, model and device are set per configuration)",
    )
    p.add_argument(
        "--section-timeout",
        type=float,
        help="seconds each section run in a child process may take (quick 180, full 900; "
        "the vllm section 900 / 2400, the serving section 900 / 1800)",
    )
    p.add_argument(
        "--noisy-above",
        type=float,
        default=THRESHOLD_CORES,
        metavar="CORES",
        help="mark a block noisy when other processes used more than this many cores on "
        f"average during it ({THRESHOLD_CORES:g})",
    )
    p.add_argument("--no-plots", action="store_true", help="write no PNG")
    # Internal: the child process that runs one external section.
    p.add_argument("--run-section", choices=EXTERNAL, help=argparse.SUPPRESS)
    p.add_argument("--section-json", help=argparse.SUPPRESS)
    return p


def _cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def _base_config(items: Sequence[str]) -> Any:
    """EngineConfig() with the ``--set FIELD=VALUE`` changes (values read as Python
    literals where they parse, else as strings); None without changes."""
    if not items:
        return None
    import ast

    from shmclient.config import EngineConfig, unknown_field_message

    changes: dict[str, Any] = {}
    for item in items:
        field, sep, text = item.partition("=")
        field = field.strip()
        if not sep:
            raise ValueError(f"expected FIELD=VALUE with an EngineConfig field, got {item!r}")
        if field not in EngineConfig.__struct_fields__:
            raise ValueError(unknown_field_message(
                "EngineConfig", field, EngineConfig.__struct_fields__))
        if field in ("transport", "model", "device"):
            raise ValueError(f"{field} is set per configuration (use --configs / --models)")
        try:
            changes[field] = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError):
            changes[field] = text.strip()
    return EngineConfig().replace(**changes)


def _prog() -> str:
    return "shmclient-bench" if os.path.basename(sys.argv[0] or "") == "shmclient-bench" else "python -m shmclient_bench"
