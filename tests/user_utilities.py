"""User utilities for the tests: the engine imports this module at start-up when it is
named in ``EngineConfig.utility_modules`` (see ``shmclient_engine.core.register_utility``).

They also let a test look at engine-side state that a multiprocess client cannot reach
otherwise (the scheduler's pause state, the profiler, the block accounting).
"""

from __future__ import annotations

from typing import Any

from shmclient_engine.core import register_utility

MODULE = __name__


@register_utility
def engine_state(core: Any) -> dict[str, Any]:
    """What the engine-side tests of the utilities check, in one reply."""
    s = core.scheduler
    return {
        "paused": s.pause_state.name,
        "running": sorted(r.request_id for r in s.running),
        "waiting": sorted(r.request_id for r in s.waiting),
        "free_blocks": s.num_free_blocks,
        "num_gpu_blocks": s.num_gpu_blocks,
        "preemptions": s.num_preemptions,
        "profiling": core.profiling,
        "last_profile": core.last_profile,
        "pid": __import__("os").getpid(),
    }


@register_utility("scale")
def scale_values(core: Any, values: list[float], factor: float = 2.0) -> list[float]:
    return [v * factor for v in values]


@register_utility
def fail_with(core: Any, text: str) -> None:
    raise ValueError(text)


@register_utility
def fail_naming_a_file(core: Any) -> None:
    """Raise with a file name as os.listdir gives one that is not UTF-8 (a lone
    surrogate in the message)."""
    name = b"caf\xe9".decode("utf-8", "surrogateescape")
    raise FileNotFoundError(f"no model in {name}")


@register_utility
def over_message_limit(core: Any, limit: int) -> bytes:
    """A result longer than one message can carry, with that limit lowered to ``limit``
    bytes in this process (``restore_message_limit`` puts it back)."""
    import shmclient.ring_producer as producer

    producer.MAX_PAYLOAD = limit
    return bytes(2 * limit)


@register_utility
def restore_message_limit(core: Any) -> int:
    import shmclient.ring as ring
    import shmclient.ring_producer as producer

    producer.MAX_PAYLOAD = ring.MAX_PAYLOAD
    return producer.MAX_PAYLOAD


@register_utility
def unsendable(core: Any, later: bool = False) -> Any:
    """A result no codec carries (an object of no wire type), at once or as a Future's."""
    import concurrent.futures

    if not later:
        return object()
    fut: concurrent.futures.Future = concurrent.futures.Future()
    fut.set_result(object())
    return fut


@register_utility
def done_future(core: Any, value: Any) -> Any:
    """A Future that is already complete: answered with its result."""
    import concurrent.futures

    fut: concurrent.futures.Future = concurrent.futures.Future()
    fut.set_result(value)
    return fut


@register_utility
def never_done_future(core: Any) -> Any:
    """A Future nothing completes (only InprocClient may call it: it refuses to wait)."""
    import concurrent.futures

    return concurrent.futures.Future()


@register_utility
def torch_threads(core: Any) -> int | None:
    """torch's intra-op threads in the engine process, or None while it has not loaded
    torch."""
    import sys

    torch = sys.modules.get("torch")
    return None if torch is None else torch.get_num_threads()
