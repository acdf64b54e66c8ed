"""``python -m shmclient_engine <control address> <frontend pid>``: the engine process the
multiprocess clients launch (``EngineConfig.engine_module``'s default); ``python -m
shmclient_engine --connect tcp://HOST:PORT [--ready-timeout S]``: a remote engine, started
apart for a rank the frontend awaits (``EngineConfig.data_parallel_size_local``); see
``shmclient_engine.proc``. Engine layer, top: imports only ``proc``."""

from .proc import main

if __name__ == "__main__":
    main()
