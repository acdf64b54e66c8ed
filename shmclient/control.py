"""The ZMQ control plane: ready handshake, ENGINE_CORE_DEAD and shutdown.

Middle layer: imports zmq, msgspec, messages and errors; never clients or the engine.
Control traffic is rare, so ZMQ's ~80 µs per message does not matter here; all data
(requests, outputs, utility calls) goes over the channel so that its order with respect
to adds and aborts is the ring's order.

One PAIR socket per engine, bound by the frontend on an abstract unix socket
(``ipc://@...``), so that nothing is left in the file system if either side is killed.
Every message is one multipart message whose first frame is its kind:

    engine → frontend   HELLO <pid>            the engine process is up
    frontend → engine   START <config> <transport> <channel spec> <frontend GPU UUIDs>
    engine → frontend   READY <ReadyInfo>      channel attached, core built
    engine → frontend   ENGINE_CORE_DEAD <error text>   (one frame kind, flushed before exit)
    frontend → engine   SHUTDOWN
"""

from __future__ import annotations

import os
import secrets

import msgspec
import zmq

HELLO = b"HELLO"
START = b"START"
READY = b"READY"
ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"
SHUTDOWN = b"SHUTDOWN"


class ReadyInfo(msgspec.Struct, frozen=True):
    """What the engine reports once it can serve: its real capacity and its pid."""

    pid: int
    num_gpu_blocks: int
    block_size: int
    max_model_len: int
    protocol_version: int
    #: GPUs the engine sees (UUIDs), so the frontend knows where CUDA IPC can go.
    gpu_uuids: list[str] = []


def make_address(tag: str = "ctl") -> str:
    """A fresh abstract-namespace ipc address (Linux): nothing to unlink afterwards."""
    return f"ipc://@shmc-{os.getpid()}-{secrets.token_hex(8)}-{tag}"


def frontend_socket(ctx: zmq.Context, address: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    return sock


def engine_socket(ctx: zmq.Context, address: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PAIR)
    # The dead signal must get out before the process exits.
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(address)
    return sock


def recv(sock: zmq.Socket, timeout_s: float) -> list[bytes] | None:
    """One control message, or None if none arrives within ``timeout_s``."""
    if sock.poll(max(0, int(timeout_s * 1000)), zmq.POLLIN):
        return sock.recv_multipart()
    return None
