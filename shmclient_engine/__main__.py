"""``python -m shmclient_engine <control address> <frontend pid>``: the engine process the
multiprocess clients launch (``EngineConfig.engine_module``'s default); ``python -m
shmclient_engine --connect tcp://HOST:PORT [--ready-timeout S]``: a remote engine, started
apart for a rank the frontend awaits (``EngineConfig.data_parallel_size_local``). Engine
layer, top: shmclient's protocol end (``shmclient.serve``) serving this engine's core."""

from shmclient.serve import main

from . import make_core

if __name__ == "__main__":
    main(make_core=make_core)
