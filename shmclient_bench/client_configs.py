"""The configurations the client sections measure and how much: ``ConfigSpec``, ``Options``.

A configuration is a client kind (``inproc``, ``sync-shm``, ``sync-zmq``, ``async-shm``,
``async-zmq``) with a model (``mock``, ``tiny``, ``tiny-cuda``; '@model' appended to the
name unless mock); ``parse_configs`` reads them from ``--configs`` and ``--models`` and
``ConfigSpec.engine_config`` gives each the same engine config but for its transport,
model and device; ``Progress`` is where a run's progress lines go. Plain data: it imports shmclient's config only (inside a method),
never a client, the engine or the measuring modules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

#: Client kinds, in the order they are reported.
KINDS = ("inproc", "sync-shm", "sync-zmq", "async-shm", "async-zmq")
#: Models a configuration can use; 'tiny-cuda' is the tiny model on the GPU.
MODELS = ("mock", "tiny", "tiny-cuda")
#: Sections this module measures.
SECTIONS = ("latency", "streaming", "idle")

#: Where a run's progress lines go.
Progress = Callable[[str], None]


def _quiet(msg: str) -> None:
    pass


# -- configurations -------------------------------------------------------------------


@dataclass(frozen=True)
class ConfigSpec:
    kind: str
    model: str = "mock"

    @property
    def name(self) -> str:
        return self.kind if self.model == "mock" else f"{self.kind}@{self.model}"

    @property
    def is_async(self) -> bool:
        return self.kind.startswith("async")

    @property
    def is_inproc(self) -> bool:
        return self.kind == "inproc"

    def engine_config(self, base: Any = None) -> Any:
        """The engine config of this configuration: ``base`` (default EngineConfig())
        with the model, device and transport of this configuration."""
        from shmclient.config import EngineConfig

        base = base if base is not None else EngineConfig()
        changes: dict[str, Any] = {"model": "tiny" if self.model.startswith("tiny") else "mock"}
        changes["device"] = "cuda" if self.model.endswith("cuda") else base.device
        if not self.is_inproc:
            changes["transport"] = self.kind.split("-")[1]
        return base.replace(**changes)


def parse_configs(configs: str | Sequence[str] | None, models: str | Sequence[str]) -> list[ConfigSpec]:
    """Configurations from ``--configs`` and ``--models``.

    ``configs``: comma-separated kinds ('sync-shm'), each run for every model in
    ``models``, or explicit 'kind@model' entries (run for that model only). None or
    'all' means every kind. Raises ValueError naming an unknown entry.
    """
    if isinstance(models, str):
        models = [m.strip() for m in models.split(",") if m.strip()]
    for m in models:
        if m not in MODELS:
            raise ValueError(f"unknown model {m!r}; expected one of {', '.join(MODELS)}")
    if configs is None or configs == "all":
        entries = list(KINDS)
    elif isinstance(configs, str):
        entries = [c.strip() for c in configs.split(",") if c.strip()]
    else:
        entries = list(configs)
    specs: list[ConfigSpec] = []
    for e in entries:
        kind, _, model = e.partition("@")
        if kind not in KINDS:
            raise ValueError(f"unknown configuration {e!r}; expected one of {', '.join(KINDS)}")
        if model:
            if model not in MODELS:
                raise ValueError(f"unknown model in {e!r}; expected one of {', '.join(MODELS)}")
            targets = [model]
        else:
            targets = list(models)
        for m in targets:
            s = ConfigSpec(kind, m)
            if s not in specs:
                specs.append(s)
    # Report order: by model as given, then by kind order.
    model_order = {m: i for i, m in enumerate(dict.fromkeys([*models, *MODELS]))}
    specs.sort(key=lambda s: (model_order[s.model], KINDS.index(s.kind)))
    return specs


@dataclass
class Options:
    """What to measure and how much (see ``shmclient_bench.__main__`` for the defaults)."""

    sections: tuple[str, ...] = SECTIONS
    samples: int = 1000
    #: Latency samples for the tiny model's configurations (None: same as ``samples``);
    #: a tiny round trip costs ~1 ms, fifty times a mock one.
    tiny_samples: int | None = None
    rounds: int = 2
    warmup: int = 100
    streams: tuple[int, ...] = (1, 16)
    tokens: int = 64
    stream_models: tuple[str, ...] = ("mock",)
    idle_settle_s: float = 2.0
    idle_window_s: float = 2.0
    base_config: Any = None
