"""The frontend's end of the plug-in's channel to one engine core, and how the frontend
hands the channels to the engines it starts.

Imports ``shmclient.channel``, ``shmclient.shm`` and the plug-in's ``wire`` and ``oob``;
no vLLM module at import (torch only to ask which GPUs this process sees), no client,
no waiting. ``_Link`` owns one engine's ``ShmChannel`` (created here, the engine
attaches), the plug-in's settings read from the environment, and the one-byte "parked"
flag of the async clients' early wake-up; ``_start_with_links`` runs vLLM's client
construction with every engine's spec in the environment.
"""

from __future__ import annotations

import math
import os
import threading
from typing import Any

import msgspec

from ..channel import BadMessage, ShmChannel
from ..shm import Segment, open_handle
from . import oob
from . import wire

#: "0" switches off the engine's early wake-up of a parked async frontend.
PREWAKE_ENV = "SHMCLIENT_VLLM_PREWAKE"
#: Where the engine core writes its outputs (see shmclient.vllm.engine_outputs): "inline",
#: small batches from its busy loop, waking the frontend at once; "thread", every batch
#: from its output thread; "adaptive" (the default), as inline while the host has a CPU
#: free for the frontend it wakes, else the wake-up waits until the next step is on its way.
OUTPUT_MODE_ENV = "SHMCLIENT_VLLM_ENGINE_OUTPUT"
OUTPUT_MODES = ("adaptive", "inline", "thread")
#: Output modes "inline" and "adaptive": the engine's busy loop writes a batch of at most this many outputs
#: itself; bigger ones (a saturated engine) go through its output thread, off the busy
#: loop's path between two steps.
INLINE_MAX_ENV = "SHMCLIENT_VLLM_INLINE_MAX_OUTPUTS"
INLINE_MAX_OUTPUTS = 16
PAGE_BYTES = 4096
#: Tensor arena per direction (bytes; 0: tensors go as ring frames, as vLLM's own).
ARENA_ENV = "SHMCLIENT_VLLM_ARENA_BYTES"
ARENA_BYTES = 32 << 20
TENSOR_MIN_ENV = "SHMCLIENT_VLLM_TENSOR_MIN_BYTES"
CUDA_IPC_ENV = "SHMCLIENT_VLLM_CUDA_IPC"
_spawn_lock = threading.Lock()  # the spec travels in os.environ while an engine starts


def _env_float(name: str, default: float) -> float:
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {text!r}") from None


def _env_int(name: str, default: int, *, low: int = 0, high: int | None = None, multiple: int = 1) -> int:
    """A whole number in [low, high] and a multiple of ``multiple``; ValueError naming the
    variable otherwise ("inf" made int() raise OverflowError, "nan" a ValueError without
    the name, a fraction was cut and a ring size the ring refuses failed only later)."""
    value = _env_float(name, default)
    if not (math.isfinite(value) and value == int(value)):
        raise ValueError(f"{name} must be a whole number, got {os.environ.get(name)!r}")
    number = int(value)
    if high is not None and not low <= number <= high:
        raise ValueError(f"{name} must be between {low} and {high}, got {number}")
    if number < low:
        raise ValueError(f"{name} must be >= {low}, got {number}")
    if number % multiple:
        raise ValueError(f"{name} must be a multiple of {multiple}, got {number}")
    return number


#: The ring's bounds on SHMCLIENT_VLLM_RING_BYTES: ``shmclient.ring``'s MIN_CAPACITY and
#: MAX_CAPACITY, with its multiple of 8 (not imported: the plug-in reaches the ring only
#: through the channel; a test checks that they agree).
RING_BYTES_ENV = "SHMCLIENT_VLLM_RING_BYTES"
RING_MIN_BYTES = 64
RING_MAX_BYTES = 1 << 40


#: How long AsyncLLM's output task spins on the ring before it parks (µs).
ASYNC_SPIN_ENV = "SHMCLIENT_VLLM_ASYNC_SPIN_US"
ASYNC_SPIN_US = 50.0


def _env_spin(name: str, default: float = 50.0) -> float:
    """A spin in µs: finite and >= 0 (a negative or NaN one was taken as it was, an
    infinite one failed at the first wait)."""
    value = _env_float(name, default)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number of microseconds >= 0, got {value!r}")
    return value


class _Settings:
    """The plug-in's channel settings, read from this process's environment (ValueError
    naming the variable for a bad value)."""

    def __init__(self) -> None:
        # The ring's own limits (a size it refuses failed only when the channel was made,
        # without the variable's name).
        self.capacity = _env_int(RING_BYTES_ENV, 4 << 20, low=RING_MIN_BYTES, high=RING_MAX_BYTES,
                                 multiple=8)
        self.spin_us = _env_spin("SHMCLIENT_VLLM_SPIN_US")
        #: Read here, before the engines start (the async output task reads it later).
        self.async_spin_us = _env_spin(ASYNC_SPIN_ENV)
        self.output_mode = os.environ.get(OUTPUT_MODE_ENV, "adaptive")
        if self.output_mode not in OUTPUT_MODES:
            raise ValueError(f"{OUTPUT_MODE_ENV} must be one of {', '.join(map(repr, OUTPUT_MODES))}, "
                             f"got {self.output_mode!r}")
        self.inline_max_outputs = _env_int(INLINE_MAX_ENV, INLINE_MAX_OUTPUTS)
        prewake = os.environ.get(PREWAKE_ENV, "1")
        if prewake not in ("0", "1"):
            raise ValueError(f"{PREWAKE_ENV} must be '0' or '1', got {prewake!r}")
        self.prewake = prewake == "1"
        self.arena = _env_int(ARENA_ENV, ARENA_BYTES)
        self.tensor_min_bytes = _env_int(TENSOR_MIN_ENV, oob.TENSOR_MIN_BYTES)
        cuda_ipc = os.environ.get(CUDA_IPC_ENV, "1")
        if cuda_ipc not in ("0", "1"):
            raise ValueError(f"{CUDA_IPC_ENV} must be '0' or '1', got {cuda_ipc!r}")
        self.cuda_ipc = cuda_ipc == "1"


def notify_attached(handle: str) -> None:
    """Tell the launcher that made a channel that this side has attached (one byte on
    its pipe), so that it can release the handles once both sides have. Never raises:
    a launcher that is gone has nothing to release."""
    if not handle:
        return
    try:
        fd = open_handle(handle, os.O_WRONLY | os.O_NONBLOCK)
    except (OSError, ValueError):
        return
    try:
        os.write(fd, b"\x01")
    except OSError:
        pass
    finally:
        os.close(fd)


class _Link:
    """The frontend's end of the channel to its engine (plus the "parked" flag of the
    async client). Owned by a finalizer, not by the client. Creates the channel, or, with
    ``frontend_spec``, attaches to one a launcher made (several API servers)."""

    def __init__(self, wake_fd: bool, engine_index: int = 0, frontend_spec: "wire.FrontendSpec | None" = None) -> None:
        self.engine_pid: int | None = None
        #: this engine's sends in call order (``waiting.OrderedSends`` or its async
        #: twin), set by the client that owns the link
        self.sends: Any = None
        #: called once the engine's pid is known from its HELLO (the async reader's watch)
        self.on_engine_pid: Any = None
        settings = _Settings()
        self.async_spin_s = settings.async_spin_us * 1e-6
        self.framing: wire.VllmFraming | None = None
        if frontend_spec is None:
            self.engine_index = engine_index
            self.output_mode = settings.output_mode
            self.inline_max_outputs = settings.inline_max_outputs
            self.tensor_min_bytes = settings.tensor_min_bytes
            self.arenas = settings.arena > 0
            cuda_ipc = settings.cuda_ipc
        else:
            self.engine_index = frontend_spec.engine_index
            self.output_mode = frontend_spec.output_mode
            self.inline_max_outputs = frontend_spec.inline_max_outputs
            self.tensor_min_bytes = frontend_spec.tensor_min_bytes
            self.arenas = frontend_spec.arenas
            cuda_ipc = frontend_spec.channel.enable_cuda_ipc

        def framing(tx, rx):
            self.framing = wire.VllmFraming(tx, rx, side="frontend", tensor_min_bytes=self.tensor_min_bytes,
                                            cuda_ipc=cuda_ipc, arenas=self.arenas)
            return self.framing

        self.parked: Segment | None = None
        if frontend_spec is None:
            self.channel, self.spec = ShmChannel.create(
                ring_capacity=settings.capacity, arena_bytes=settings.arena, spin_us=settings.spin_us,
                wake_fd=wake_fd, enable_cuda_ipc=cuda_ipc, framing=framing)
        else:
            self.channel = ShmChannel.attach(frontend_spec.channel, framing)
            self.spec = None
        # No peer GPUs until the engine's GPUS record says which it sees: host copies.
        self.channel.set_peer_gpus([])
        try:
            if frontend_spec is not None:
                if frontend_spec.parked:
                    self.parked = Segment.attach(frontend_spec.parked)
                notify_attached(frontend_spec.attached_pipe)
            elif wake_fd and settings.prewake:
                # One byte the engine reads: 1 while get_output_async is parked (reader._EarlyWake).
                self.parked = Segment.create(PAGE_BYTES, prefix="shmc-vllm-parked")
            # The engine learns which process this is from the first record.
            self.channel.send_nowait(wire.HELLO, msgspec.msgpack.encode(os.getpid()))
        except BaseException:
            self.close()
            raise
        self.parked_flag = self.parked.buf if self.parked is not None else bytearray(1)

    def engine_spec(self) -> wire.EngineSpec:
        gpus: list[str] = []
        try:
            import torch

            if torch.cuda.is_initialized():  # never create a CUDA context here for this
                from ..gpus import local_gpu_uuids

                gpus = local_gpu_uuids()
        except ImportError:
            pass
        return wire.EngineSpec(
            channel=self.spec, frontend_pid=os.getpid(), output_mode=self.output_mode,
            parked=self.parked.name if self.parked is not None else "", arenas=self.arenas,
            tensor_min_bytes=self.tensor_min_bytes, frontend_gpus=gpus,
            inline_max_outputs=self.inline_max_outputs, engine_index=self.engine_index)

    def attached(self, engine_pid: int | None) -> None:
        """The engine has attached: release the handles; its one-off tensor handles must
        name its own segments from now on."""
        self.channel.peer_attached()
        if engine_pid is not None:
            self.engine_pid = engine_pid
            self.channel.set_peer_pid(engine_pid)
        if self.parked is not None:
            self.parked.release_handle()

    def on_control(self, rtype: int, obj: Any) -> bool:
        """Handle a message that is not vLLM's outputs; False if it is one."""
        if rtype == wire.GPUS:
            if not isinstance(obj, BadMessage):
                self.channel.set_peer_gpus(list(obj))
            return True
        if rtype == wire.HELLO:
            if self.engine_pid is None:  # else vLLM's process list named it already
                try:
                    pid = wire.check_pid(obj)
                except ValueError as e:  # no pid to watch: vLLM's own monitor and the launcher's remain
                    from . import log

                    log.error("shmclient.vllm: engine %d: %s", self.engine_index, e)
                    return True
                self.engine_pid = pid
                self.channel.set_peer_pid(pid)
                if self.on_engine_pid is not None:
                    self.on_engine_pid()
            return True
        return False

    def close(self) -> None:
        self.channel.close()
        if self.parked is not None:
            self.parked_flag = bytearray(1)
            self.parked.release_handle()
            self.parked.close()


def _start_with_links(links: "list[_Link]", make, construct) -> None:
    """Make the links (``make()`` appends them to ``links``), then run vLLM's client
    construction with their specs in the environment while it starts the engine core
    processes (each takes the one naming its engine index). One client of this process
    at a time: another client's engines, forked meanwhile, would inherit the new links'
    fds, and its environment would name the wrong specs."""
    with _spawn_lock:
        make()
        value = wire.encode_specs([link.engine_spec() for link in links])
        reason = wire.too_long(wire.ENV_SPEC, value)
        if reason is not None:  # some 115 engine cores on this node
            raise RuntimeError(f"shmclient.vllm: {reason}: start this frontend without SHMCLIENT_VLLM=1")
        os.environ[wire.ENV_SPEC] = value
        try:
            construct()
        finally:
            os.environ.pop(wire.ENV_SPEC, None)


#: The name of vLLM's engine monitor thread (``MPClient.start_engine_core_monitor``).
VLLM_MONITOR = "MPClientEngineMonitor"


def new_monitors(construct) -> "list[threading.Thread]":
    """Run ``construct`` (vLLM's client construction); the threads named as vLLM's engine
    monitor that were started meanwhile (another client's construction, in another
    thread, may have started one too: ``own_monitor``)."""
    before = set(threading.enumerate())
    construct()
    return [t for t in threading.enumerate() if t not in before and t.name == VLLM_MONITOR]


def own_monitor(monitors: "list[threading.Thread]", engine_manager: Any) -> "threading.Thread | None":
    """Of ``monitors``, the one that watches ``engine_manager``'s engines (vLLM's monitor
    function holds its client's engine manager; read while the thread runs), else the
    only one if what it holds cannot be read; None where vLLM started none for this
    client (no engine manager: engines it did not launch) or it cannot be told."""
    if engine_manager is None:
        return None
    unreadable = []
    for t in monitors:
        cells = getattr(getattr(t, "_target", None), "__closure__", None)
        if not cells:  # (the thread has ended, or a vLLM whose monitor holds nothing)
            unreadable.append(t)
            continue
        for cell in cells:
            try:
                held = cell.cell_contents
            except ValueError:  # (an empty cell)
                continue
            if held is engine_manager:
                return t
    return unreadable[0] if len(monitors) == 1 and unreadable else None


def _engine_pids(client) -> dict[int, int]:
    """Engine index -> pid of the engine core processes vLLM started here (named
    ``EngineCore`` alone, ``EngineCore_DP<index>`` with data parallelism)."""
    pids: dict[int, int] = {}
    try:
        processes = list(client.resources.engine_manager.processes)
    except (AttributeError, TypeError):
        return pids
    for proc in processes:
        name = getattr(proc, "name", "")
        if name == "EngineCore":
            pids[0] = proc.pid
        elif name.startswith("EngineCore_DP") and name[len("EngineCore_DP"):].isdigit():
            pids[int(name[len("EngineCore_DP"):])] = proc.pid
    return pids


def _close_links(links: "list[_Link]") -> None:
    for link in links:
        link.close()
