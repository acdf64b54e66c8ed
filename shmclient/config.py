"""``EngineConfig``: every setting of one engine core, validated once, never mutated.

Lowest layer of shmclient, beside ``errors`` (its only import from the package, with msgspec
and the standard library): the settings of the engine a client starts and of the transport
between them. Both sides read it (it travels in the handshake), so it lives here and the
engine imports it; it must not import torch, the engine or any client module, so that a
frontend can build and send a config cheaply. The config is a
frozen msgspec struct so it travels as-is in the msgpack ready handshake; ``__post_init__``
validates it on construction, on ``replace()`` and on decoding (where msgspec wraps the
``ConfigError`` into a ``msgspec.ValidationError`` carrying the same message).
Capacity the engine derives at start-up (``num_gpu_blocks``, the fitted ``max_model_len``)
is reported by ``EngineCore`` attributes, never written back into the config.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from typing import Any

import msgspec

from shmclient.errors import ConfigError

MiB = 1 << 20

#: Model names accepted by ``EngineConfig.model``.
VALID_MODELS = ("mock", "tiny")
#: Transports accepted by ``EngineConfig.transport``.
VALID_TRANSPORTS = ("shm", "zmq")

_CUDA_DEVICE = re.compile(r"cuda(:(0|[1-9][0-9]*))?")
_HOST = re.compile(r"\*|[A-Za-z0-9][A-Za-z0-9.-]*")
_MODULE_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
#: The ring's bounds on ``ring_capacity_bytes`` (``shmclient.ring``'s MAX_CAPACITY and its
#: multiple of 8; not imported: this module must stay below the ring in the layers).
_RING_MAX_CAPACITY = 1 << 40

#: How long a frontend waits for an engine to be ready, and a remote engine for its
#: frontend's ``Start``, where nothing else says (``EngineConfig.engine_ready_timeout_s``,
#: ``--ready-timeout``).
READY_TIMEOUT_ENV = "SHMCLIENT_ENGINE_READY_TIMEOUT_S"
DEFAULT_READY_TIMEOUT_S = 600.0


def ready_timeout_env_s() -> float:
    """``SHMCLIENT_ENGINE_READY_TIMEOUT_S`` in seconds (600 when unset). Raises
    ``ConfigError`` for a value that is not a finite number of seconds > 0 (NaN never
    ran out, 0 or less gave up at once)."""
    raw = os.environ.get(READY_TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_READY_TIMEOUT_S
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise ConfigError(f"{READY_TIMEOUT_ENV} must be a finite number of seconds > 0, got {raw!r}")
    return seconds


class UnknownFieldError(ConfigError, TypeError):
    """A keyword that is no field of ``EngineConfig``: a ``TypeError``, as Python raises for
    an unknown keyword argument, and a ``ConfigError``. The message names the closest
    field."""


def unknown_field_message(cls_name: str, name: str, fields: tuple[str, ...]) -> str:
    """``<cls_name> has no field 'name'`` and the closest valid names (difflib), or all of
    them when none is close."""
    close = difflib.get_close_matches(name, fields, n=3, cutoff=0.6)
    if close:
        hint = "did you mean " + " or ".join(repr(c) for c in close) + "?"
    else:
        hint = "the fields are " + ", ".join(fields)
    return f"{cls_name} has no field {name!r}: {hint}"


def _config_meta() -> type:
    """The metaclass of ``EngineConfig``: msgspec's, with construction by an unknown keyword
    raising ``UnknownFieldError`` naming the closest field (msgspec's own TypeError names
    only the unknown keyword). msgspec before 0.20 cannot subclass its metaclass: there
    it is msgspec's own (``replace()`` still names the closest field)."""
    base = type(msgspec.Struct)

    def __call__(cls: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return base.__call__(cls, *args, **kwargs)
        except TypeError as e:
            unknown = [k for k in kwargs if k not in cls.__struct_fields__]
            if not unknown or isinstance(e, ConfigError):
                raise
            raise UnknownFieldError(
                unknown_field_message(cls.__name__, unknown[0], cls.__struct_fields__)) from None

    try:
        meta = type("_ConfigMeta", (base,), {"__call__": __call__, "__module__": __name__})
        type.__call__(meta, "_Probe", (msgspec.Struct,), {"__module__": __name__})
    except TypeError:  # pragma: no cover - msgspec < 0.20
        return base
    return meta


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True, metaclass=_config_meta()):
    """Settings of one engine core. Construction raises ``ConfigError`` naming the field
    (an unknown keyword: ``UnknownFieldError``, also a TypeError, naming the closest field).

    Nothing here blocks. Field meanings:

    * ``model``: ``"mock"`` (no compute, see ``shmclient_engine.model.MockModel``) or ``"tiny"``
      (a small seeded torch transformer).
    * ``device``: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
    * ``transport``: data plane between client and engine process, ``"shm"`` or ``"zmq"``.
    * ``max_model_len``: longest sequence (prompt + output); the engine lowers it to what
      the KV cache can hold.
    * ``block_size`` / ``num_gpu_blocks``: KV cache granularity and size in blocks;
      ``None`` derives the size from the memory budget below.
    * ``max_num_seqs`` / ``max_num_batched_tokens``: running-batch size and per-step
      token budget (chunked prefill splits longer prompts).
    * ``kv_cache_memory_bytes``: KV budget on cpu; ``gpu_memory_utilization``: fraction of
      the *free* GPU memory used for KV on cuda.
    * ``vocab_size`` ... ``eos_token_id``: model shape (the mock uses vocab/hidden/eos too).
    * ``ring_capacity_bytes``, ``tensor_arena_bytes``, ``spin_us``,
      ``engine_ready_timeout_s``, ``enable_cuda_ipc``: transport settings (used by the
      client and the engine process, not by the core).
    * ``engine_module``: the engine a multiprocess client launches (``python -m
      <engine_module>``, given the control address and the frontend's pid) and an
      in-process client builds (``<engine_module>.make_core(config, supports_wait=False)``, or
      ``make_core(config)`` where it takes no such keyword): an importable
      module path; the project's own engine ``shmclient_engine`` by default (the
      contract an engine module keeps is in that package's docstring). A module that
      cannot be found, or lacks the entry point, is a ``ConfigError`` naming this field
      when a client starts.
    * ``step_delay_s``: seconds the mock model sleeps in every step that has work,
      standing in for a GPU step in benchmarks and load tests (0, the default: none;
      the tiny model ignores it: it computes).
    * ``fault_injection``: the older spelling of the step delay: ``"step_delay:S"`` is
      ``step_delay_s=S`` (construction moves it there and leaves ``None`` here, so the
      two spellings give equal configs; both given with different delays is a
      ``ConfigError``). Nothing else is accepted: the test directives once read from
      this field (raise in a step, exit or hang before ready) live in a test-only engine
      module, launched through ``engine_module``.
    * ``data_parallel_size`` / ``data_parallel_rank`` / ``data_parallel_external_lb``:
      vLLM's data-parallel settings (engines behind one client; see ``client_dp``).
    * ``utility_modules``: import paths of modules that register user utilities
      (``shmclient_engine.core.register_utility``); every engine core imports them at start-up,
      in the engine process for the multiprocess clients. An import failure is a
      ``ConfigError`` at start-up.
    * ``data_parallel_address`` / ``data_parallel_rpc_port`` / ``data_parallel_size_local``:
      engines over tcp, as vLLM's settings of those names. ``data_parallel_address`` is
      the address of this host the frontend binds its tcp sockets on (an IPv4 address or
      interface, ``"0.0.0.0"`` or ``"*"`` for every interface); with it, an engine on the
      ``"zmq"`` transport is reached over tcp (its control and data sockets), else over
      abstract unix sockets. ``data_parallel_size_local`` is how many ranks are started
      on this host, ranks ``0..local-1`` (``None``: all of them; behind an external load
      balancer, where each client serves its own rank as vLLM's, 1 or ``None`` starts it
      here and 0 awaits it); the others are
      *remote*: not started here, but awaited (up to the ready timeout) until an engine
      started apart, ``python -m shmclient_engine --connect tcp://HOST:PORT``, connects
      to the control socket of its rank. A remote rank always uses the ``"zmq"``
      transport (tensors travel inline as frames). ``data_parallel_rpc_port`` is the
      control port of the first remote rank (rank ``r`` listens on ``port + r -
      local``); 0 (the default) picks free ports and logs each address at WARNING on
      the ``shmclient`` logger (with the attribute ``shmclient_control_address`` on the
      record). ``data_parallel_size=1, data_parallel_size_local=0`` is a plain client of
      one remote engine.
    * ``heartbeat_interval_s`` / ``heartbeat_misses``: liveness of a remote engine (no
      pid to watch across hosts): each side sends a heartbeat on the control socket
      every interval; a side that hears nothing from the other for ``misses`` intervals
      (0.2 s x 5 = 1 s by default) takes it for dead: the client fails with
      ``EngineDeadError``, the engine exits.
    * ``cpu_threads``: torch threads of the engine process when the device is cpu (1
      by default: the tiny model gains nothing from more, and on a small host a thread
      pool spinning against the frontend's process costs latency). An engine that has
      not loaded torch once its core is built (the mock model loads it with its first
      tensor) gets it as ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` in its environment,
      which torch caps at the host's cores.
    """

    model: str = "mock"
    device: str = "cpu"
    transport: str = "shm"
    max_model_len: int = 2048
    block_size: int = 16
    num_gpu_blocks: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    seed: int = 0
    kv_cache_memory_bytes: int = 256 * MiB
    gpu_memory_utilization: float = 0.5
    vocab_size: int = 1024
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    eos_token_id: int = 2
    ring_capacity_bytes: int = 4 * MiB
    tensor_arena_bytes: int = 64 * MiB
    spin_us: float = 50.0
    engine_ready_timeout_s: float | None = None
    enable_cuda_ipc: bool = True
    engine_module: str = "shmclient_engine"
    step_delay_s: float = 0.0
    fault_injection: str | None = None
    data_parallel_size: int = 1
    data_parallel_rank: int | None = None
    data_parallel_external_lb: bool = False
    data_parallel_address: str | None = None
    data_parallel_rpc_port: int = 0
    data_parallel_size_local: int | None = None
    heartbeat_interval_s: float = 0.2
    heartbeat_misses: int = 5
    cpu_threads: int = 1
    utility_modules: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check_choice("model", self.model, VALID_MODELS)
        if not isinstance(self.device, str) or not (
            self.device == "cpu" or _CUDA_DEVICE.fullmatch(self.device)
        ):
            _fail("device", self.device, "expected 'cpu', 'cuda' or 'cuda:N'")
        _check_choice("transport", self.transport, VALID_TRANSPORTS)
        for name in (
            "max_model_len",
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "kv_cache_memory_bytes",
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
        ):
            _check_int(name, getattr(self, name), low=1)
        if self.num_gpu_blocks is not None:
            _check_int("num_gpu_blocks", self.num_gpu_blocks, low=1)
        _check_int("seed", self.seed, low=0, high=2**63 - 1)
        _check_int("cpu_threads", self.cpu_threads, low=1)
        _check_int("eos_token_id", self.eos_token_id, low=0, high=self.vocab_size - 1)
        _check_int("ring_capacity_bytes", self.ring_capacity_bytes, low=4096,
                   high=_RING_MAX_CAPACITY)
        if self.ring_capacity_bytes % 8:
            _fail("ring_capacity_bytes", self.ring_capacity_bytes, "must be a multiple of 8")
        _check_int("tensor_arena_bytes", self.tensor_arena_bytes, low=0)
        if self.hidden_size % self.num_heads:
            _fail(
                "hidden_size",
                self.hidden_size,
                f"must be a multiple of num_heads={self.num_heads}",
            )
        g = _check_float("gpu_memory_utilization", self.gpu_memory_utilization)
        if not 0.0 < g <= 1.0:
            _fail("gpu_memory_utilization", g, "must be in (0, 1]")
        if _check_float("spin_us", self.spin_us) < 0:
            _fail("spin_us", self.spin_us, "must be >= 0")
        if self.engine_ready_timeout_s is not None:
            if _check_float("engine_ready_timeout_s", self.engine_ready_timeout_s) <= 0:
                _fail("engine_ready_timeout_s", self.engine_ready_timeout_s, "must be > 0 or None")
        if not isinstance(self.enable_cuda_ipc, bool):
            _fail("enable_cuda_ipc", self.enable_cuda_ipc, "must be a bool")
        if not isinstance(self.engine_module, str) or not _MODULE_PATH.fullmatch(self.engine_module):
            _fail("engine_module", self.engine_module, "must be a module import path such as 'pkg.engine'")
        if _check_float("step_delay_s", self.step_delay_s) < 0:
            _fail("step_delay_s", self.step_delay_s, "must be >= 0")
        if self.fault_injection is not None:
            delay = _legacy_step_delay(self.fault_injection)
            if self.step_delay_s and self.step_delay_s != delay:
                _fail("fault_injection", self.fault_injection,
                      f"says a step delay of {delay:g} s but step_delay_s={self.step_delay_s!r}: "
                      "give the delay once, as step_delay_s")
            msgspec.structs.force_setattr(self, "step_delay_s", delay)
            msgspec.structs.force_setattr(self, "fault_injection", None)
        _check_int("data_parallel_size", self.data_parallel_size, low=1)
        if self.data_parallel_rank is not None:
            _check_int("data_parallel_rank", self.data_parallel_rank, low=0,
                       high=self.data_parallel_size - 1)
        if not isinstance(self.data_parallel_external_lb, bool):
            _fail("data_parallel_external_lb", self.data_parallel_external_lb, "must be a bool")
        self._check_remote()
        if isinstance(self.utility_modules, list):
            msgspec.structs.force_setattr(self, "utility_modules", tuple(self.utility_modules))
        if not isinstance(self.utility_modules, tuple) or not all(
            isinstance(m, str) and _MODULE_PATH.fullmatch(m) for m in self.utility_modules
        ):
            _fail("utility_modules", self.utility_modules,
                  "must be a list or tuple of module import paths such as 'pkg.module'")

    def _check_remote(self) -> None:
        addr = self.data_parallel_address
        if addr is not None and (not isinstance(addr, str) or not _HOST.fullmatch(addr)):
            _fail("data_parallel_address", addr,
                  "must be an IPv4 address or interface of this host, '0.0.0.0' or '*' "
                  "(no scheme, no port: the port is data_parallel_rpc_port)")
        _check_int("data_parallel_rpc_port", self.data_parallel_rpc_port, low=0, high=65535)
        local = self.data_parallel_size_local
        if local is not None:
            _check_int("data_parallel_size_local", local, low=0, high=self.data_parallel_size)
            if self.data_parallel_external_lb:
                if local > 1:
                    _fail("data_parallel_size_local", local,
                          "behind an external load balancer each client serves one rank: "
                          "1 (or None) starts its engine here, 0 awaits it over tcp")
                if local == 0 and addr is None:
                    _fail("data_parallel_size_local", local,
                          "the rank is remote (awaited over tcp): give data_parallel_address, "
                          "the address to listen on")
            elif local < self.data_parallel_size and addr is None:
                _fail("data_parallel_size_local", local,
                      f"ranks {local}..{self.data_parallel_size - 1} are remote (awaited "
                      "over tcp): give data_parallel_address, the address to listen on")
        if _check_float("heartbeat_interval_s", self.heartbeat_interval_s) <= 0:
            _fail("heartbeat_interval_s", self.heartbeat_interval_s, "must be > 0")
        _check_int("heartbeat_misses", self.heartbeat_misses, low=1)
        if self.is_remote and (self.data_parallel_rank is not None or self.data_parallel_size == 1) \
                and self.transport != "zmq":
            _fail("transport", self.transport,
                  f"rank {self.data_parallel_rank or 0} is remote (data_parallel_size_local="
                  f"{local}): only 'zmq' reaches another host")

    @property
    def is_remote(self) -> bool:
        """True when this config's engine (rank ``data_parallel_rank``, 0 if None) is
        not started here but awaited over tcp (see ``data_parallel_size_local``)."""
        return self.rank_is_remote(self.data_parallel_rank or 0)

    def rank_is_remote(self, rank: int) -> bool:
        """Whether the engine of ``rank`` is awaited over tcp rather than started here:
        ranks from ``data_parallel_size_local`` on; behind an external load balancer
        (each client serves its own rank, as vLLM's: a local size of 1 or None), only
        with a local size of 0."""
        local = self.data_parallel_size_local
        if local is None:
            return False
        if self.data_parallel_external_lb:
            return local == 0
        return rank >= local

    @property
    def heartbeat_timeout_s(self) -> float:
        """Silence after which a remote peer is taken for dead."""
        return self.heartbeat_interval_s * self.heartbeat_misses

    def replace(self, **changes: Any) -> EngineConfig:
        """A copy with ``changes`` applied, validated again (raises ``ConfigError``; an
        unknown name: ``UnknownFieldError``, naming the closest field)."""
        unknown = [k for k in changes if k not in self.__struct_fields__]
        if unknown:
            raise UnknownFieldError(unknown_field_message(
                type(self).__name__, unknown[0], self.__struct_fields__))
        return msgspec.structs.replace(self, **changes)

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")


def _legacy_step_delay(value: Any) -> float:
    """The delay of ``fault_injection="step_delay:S"``; ``ConfigError`` for anything else."""
    if not isinstance(value, str):
        _fail("fault_injection", value, "must be a str or None")
    head, sep, tail = value.partition(":")
    if head != "step_delay" or not sep:
        _fail("fault_injection", value,
              "only 'step_delay:S' is accepted (the same as step_delay_s=S); the test "
              "directives raise_in_step, exit_before_ready and hang_before_ready moved out "
              "of the production config into a test-only engine module (engine_module)")
    try:
        delay = float(tail)
    except ValueError:
        delay = math.nan
    if not math.isfinite(delay) or delay < 0:
        _fail("fault_injection", value, "the step delay S in 'step_delay:S' must be a "
                                        "finite number of seconds >= 0")
    return delay


def _fail(field: str, value: Any, why: str) -> None:
    try:
        shown = repr(value)
    except ValueError:  # an int too long for text (sys.set_int_max_str_digits)
        shown = f"<an int of {value.bit_length()} bits>"
    if len(shown) > 80:
        shown = shown[:77] + "..."
    raise ConfigError(f"EngineConfig.{field}={shown} is invalid: {why}")


def _check_choice(field: str, value: Any, valid: tuple[str, ...]) -> None:
    if value not in valid or not isinstance(value, str):
        _fail(field, value, f"expected one of {', '.join(map(repr, valid))}")


def _check_int(field: str, value: Any, *, low: int, high: int = 2**63 - 1) -> None:
    """``high`` by default the largest int the config's msgpack carries to the engine."""
    if type(value) is not int:  # bool is an int subclass: refuse it too
        _fail(field, value, "must be an int")
    if value < low:
        _fail(field, value, f"must be >= {low}")
    if value > high:
        _fail(field, value, f"must be <= {high}")


def _check_float(field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _fail(field, value, "must be a number")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an int past any float
        finite = False
    if not finite:
        _fail(field, value, "must be finite")
    return float(value)
