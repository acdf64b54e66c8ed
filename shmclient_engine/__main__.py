"""``python -m shmclient_engine <control address> <frontend pid>``: the engine process the
multiprocess clients launch (``EngineConfig.engine_module``'s default); see
``shmclient_engine.proc``. Engine layer, top: imports only ``proc``."""

from .proc import main

if __name__ == "__main__":
    main()
