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
    # Every object is visited, whatever one of them raises: a KeyboardInterrupt (or a
    # SystemExit from a handler) landing here must not leave the rest unforgotten, whose
    # finalizers would then close the parent's rings and stop its engine at the child's
    # exit. An at-fork hook cannot raise into the child: CPython reports the first such
    # exception as unraisable and the child goes on (a Ctrl-C delivered again from here
    # would be raised inside this hook too).
    raised = None
    for obj in list(_owners):
        try:
            obj._forget_after_fork()
        except BaseException as e:  # noqa: BLE001
            if raised is None and not isinstance(e, Exception):
                raised = e
    _owners.clear()
    if raised is not None:
        raise raised


os.register_at_fork(after_in_child=_after_fork_in_child)
