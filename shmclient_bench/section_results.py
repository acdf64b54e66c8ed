"""What the typed results of several sections share: ``Skipped`` and ``SectionHost``.

A section that needs something this host lacks (vLLM, say) returns ``Skipped`` with the
reason instead of its figures; its result type is then the tagged union of its figures
and ``Skipped`` (``status``: "measured" or "skipped" in the JSON). ``SectionHost`` is
the host a section measured on, as the section saw it; ``typed`` reads a section's JSON
form into its type. Only ``msgspec`` here: the run
reads these types back without importing a section's measuring code.
"""

from __future__ import annotations

from typing import TypeVar

import msgspec

T = TypeVar("T")

#: The JSON field that tells a section's figures from ``Skipped``.
STATUS = "status"


class Skipped(msgspec.Struct, frozen=True, tag_field=STATUS, tag="skipped"):
    """A section that measured nothing, and why (vLLM is not installed, its child failed)."""

    reason: str


class SectionHost(msgspec.Struct, frozen=True, omit_defaults=True):
    """The host a section ran on: its CPUs, its 1-minute load average when the section
    read it, and (where the section records it) the Python version."""

    cpus: int | None
    load_1m: float
    python: str | None = None


def typed(value: object, cls: type[T]) -> T:
    """``value`` as the section result type ``cls``: itself when it is one already, else
    read from its JSON form (the section's entry of a results.json, say); raises
    ``msgspec.ValidationError`` when it does not fit."""
    return value if isinstance(value, cls) else msgspec.convert(value, cls, str_keys=True)  # type: ignore[return-value]
