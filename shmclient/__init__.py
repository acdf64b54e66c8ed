"""shmclient: a same-host EngineCoreClient whose data travels through shared memory.

The public surface only (pinned by tests/test_public_api.py). The clients and
``EngineConfig`` load on first use, so ``import shmclient`` starts nothing and does not
import the engine.
"""

from __future__ import annotations

from typing import Any

from .client import EngineCoreClient, SyncEngineCoreClient, make_async_mp_client, make_client
from .errors import (
    ClientClosedError,
    ForkedError,
    ConfigError,
    DuplicateRequestError,
    EngineDeadError,
    InvalidRequestError,
    PeerDeadError,
    PeerNotConsumingError,
    PeerNotProducingError,
    PeerTimeoutError,
    ProtocolError,
    SerializationError,
    ShmCapacityError,
    AuthenticationError,
    ShmClientError,
    UsageError,
    UtilityCallError,
    WouldBlock,
)
from .messages import (
    PROTOCOL_VERSION,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    FinishReason,
    LoRARequest,
    PoolingParams,
    SamplingParams,
    SchedulerStats,
    UtilityOutput,
)

__version__ = "0.1.0"

_LAZY = {
    "EngineConfig": ("shmclient.config", "EngineConfig"),
    "InprocClient": ("shmclient.client_inproc", "InprocClient"),
    "MPClient": ("shmclient.client_mp", "MPClient"),
    "SyncMPClient": ("shmclient.client_mp", "SyncMPClient"),
    "AsyncMPClient": ("shmclient.client_async", "AsyncMPClient"),
    "DPAsyncMPClient": ("shmclient.client_dp", "DPAsyncMPClient"),
    "DPLBAsyncMPClient": ("shmclient.client_dp_lb", "DPLBAsyncMPClient"),
}

__all__ = [
    "AsyncMPClient",
    "ClientClosedError",
    "ForkedError",
    "ConfigError",
    "DPAsyncMPClient",
    "DPLBAsyncMPClient",
    "DuplicateRequestError",
    "EngineConfig",
    "EngineCoreClient",
    "EngineCoreOutput",
    "EngineCoreOutputs",
    "EngineCoreRequest",
    "EngineCoreRequestType",
    "EngineDeadError",
    "FinishReason",
    "InprocClient",
    "InvalidRequestError",
    "LoRARequest",
    "MPClient",
    "PROTOCOL_VERSION",
    "PeerDeadError",
    "PeerNotConsumingError",
    "PeerNotProducingError",
    "PeerTimeoutError",
    "PoolingParams",
    "ProtocolError",
    "SamplingParams",
    "SchedulerStats",
    "SerializationError",
    "ShmCapacityError",
    "AuthenticationError",
    "ShmClientError",
    "SyncEngineCoreClient",
    "SyncMPClient",
    "UsageError",
    "UtilityCallError",
    "UtilityOutput",
    "WouldBlock",
    "make_async_mp_client",
    "make_client",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'shmclient' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
