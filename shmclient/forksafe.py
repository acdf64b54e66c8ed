"""Fork safety: a child made with ``os.fork()`` never touches its parent's rings or engine.

Lowest layer: imports only the standard library. Objects that own something shared with a
peer (a ring end, an engine process) register here; in a forked child each one is told to
forget it (``_forget_after_fork()``): its finalizer is detached and it counts as closed,
so that the child's exit (atexit, garbage collection) neither marks the parent's ring
closed nor shuts the parent's engine down. The child may build clients of its own.
"""

from __future__ import annotations

import os
import weakref

_owners: "weakref.WeakSet" = weakref.WeakSet()


def register(obj) -> None:
    """Have ``obj._forget_after_fork()`` called in every forked child while ``obj`` lives."""
    _owners.add(obj)


def _after_fork_in_child() -> None:
    for obj in list(_owners):
        try:
            obj._forget_after_fork()
        except Exception:  # pragma: no cover - never let a fork fail for this
            pass
    _owners.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
