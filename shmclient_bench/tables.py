"""Plain-text tables and the words that compare one figure with another.

``table`` lays out rows under headers; ``faster`` and ``compare`` say how a figure
stands against its baseline ('4.95x faster', '1.49x more').
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence


def _fmt(v: Any, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    if isinstance(v, float) and not math.isfinite(v):
        return "-"
    if isinstance(v, (int, float)):
        av = abs(v)
        if av >= 1e6:
            return f"{v:,.0f}"
        if av >= 100 or isinstance(v, int):
            return f"{v:,.0f}" if av >= 1000 else f"{v:.0f}"
        return f"{v:.{digits}f}"
    return str(v)


def compare(v: float | None, base: float | None, lower_is_better: bool, words: tuple[str, str]) -> str:
    """``v`` against ``base`` in words that say which way is better: '4.95x faster',
    '1.20x slower' (words = ('faster', 'slower'), for a time), '1.49x more' (for a rate).
    The better word comes first in ``words``."""
    if v is None or base is None or v <= 0 or base <= 0:
        return "-"
    if v == base:
        return "same"
    better = v < base if lower_is_better else v > base
    factor = max(v, base) / min(v, base)
    return f"{factor:.2f}x {words[0] if better else words[1]}"


def faster(t: float | None, base: float | None) -> str:
    """A time against the baseline's: '4.95x faster' or '1.20x slower'."""
    return compare(t, base, True, ("faster", "slower"))


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], align: str | None = None) -> str:
    """A plain-text table; ``align`` is one 'l' or 'r' per column (default: first left)."""
    rows = [[_fmt(c) for c in r] for r in rows]
    headers = list(headers)
    align = align or ("l" + "r" * (len(headers) - 1))
    widths = [len(h) for h in headers]
    for r in rows:
        for i, c in enumerate(r):
            widths[i] = max(widths[i], len(c))

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(cells, widths, align)
        ).rstrip()

    out = [line(headers), line(["-" * w for w in widths])]
    out += [line(r) for r in rows]
    return "\n".join(out)
