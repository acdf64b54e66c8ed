"""The files of a results folder: results.json and samples.json.

``write_json`` writes any result (dicts, lists, numpy values, typed records) as strict
JSON; ``samples_file`` and ``read_samples`` write and read the round trips of
samples.json, in ns.
"""

from __future__ import annotations

import json
import math
from typing import Any, Sequence

import msgspec
import numpy as np


def _jsonable(o: Any) -> Any:
    if isinstance(o, msgspec.Struct):
        # A typed result: the fields it encodes to, as msgspec.json writes them.
        return _jsonable(msgspec.to_builtins(o, str_keys=True))
    if isinstance(o, dict):
        return {str(k): _jsonable(v) for k, v in o.items()}
    if isinstance(o, (list, tuple, set)):
        return [_jsonable(v) for v in o]
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, (str, int, float, bool)) or o is None:
        return o
    return repr(o)


#: What samples.json holds, written into it next to its unit.
SAMPLES_WHAT = ("round trip of each request, add_request -> its finished output "
                "(max_tokens=1), one list per configuration, in the order measured")


def samples_file(samples_ns: dict[str, Sequence[int]]) -> dict[str, Any]:
    """samples.json's content: ``unit`` ("ns") and ``what`` beside one list of round
    trips per configuration (the configurations stay top-level keys, as before)."""
    return {"unit": "ns", "what": SAMPLES_WHAT, **samples_ns}


def read_samples(path: str) -> dict[str, list[float]]:
    """The round trips of a samples.json, in ns, per configuration. Reads the files of
    older runs too (no ``unit``: they were ns already)."""
    with open(path) as f:
        data = json.load(f)
    scale = {"ns": 1.0, "us": 1e3, "ms": 1e6, "s": 1e9}[data.get("unit", "ns")]
    return {k: [x * scale for x in v] for k, v in data.items() if isinstance(v, list)}


def write_json(path: str, data: Any) -> str:
    """Write ``data`` as indented JSON (typed results as msgspec encodes them; numpy
    scalars, sets, inf/nan made JSON-safe)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(_jsonable(data), f, indent=1, sort_keys=False)
        f.write("\n")
    return path
