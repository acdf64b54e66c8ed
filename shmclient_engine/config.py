"""``EngineConfig`` lives in ``shmclient.config`` (the settings travel in the handshake and
both sides read them); this name stays for code that imported it from the engine."""

from shmclient.config import MiB, VALID_MODELS, VALID_TRANSPORTS, EngineConfig

__all__ = ["EngineConfig", "MiB", "VALID_MODELS", "VALID_TRANSPORTS"]
