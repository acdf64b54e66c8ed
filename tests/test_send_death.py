"""A send that finds the engine gone before the client knows: the channel may notice
the death before the monitor does. The error raised says why, and the client is dead
(``is_dead``) by the time it is raised."""

from __future__ import annotations

import threading

import pytest

from shmclient import AsyncMPClient, EngineConfig, EngineDeadError, PeerDeadError, SyncMPClient

from .drivers import req

GONE = "the consumer closed the ring"


def _gone_on_send(monkeypatch, client, sent: threading.Event | None = None) -> None:
    """The channel says the engine is gone at the next send (its process lives on: the
    monitor reports nothing)."""

    def send_nowait(rtype, payload, *, wake=True):
        if sent is not None:
            sent.set()
        raise PeerDeadError(GONE)

    monkeypatch.setattr(client.channel, "send_nowait", send_nowait)


def test_a_send_that_finds_the_engine_gone_marks_the_client_dead_saying_why(monkeypatch):
    monkeypatch.setattr(SyncMPClient, "DEATH_NOTICE_S", 0.05, raising=False)
    client = SyncMPClient(EngineConfig())
    try:
        _gone_on_send(monkeypatch, client)
        with pytest.raises(EngineDeadError, match=GONE) as info:
            client.add_request(req("a"))
        assert client.is_dead
        assert str(info.value) == client.resources.dead_reason
        with pytest.raises(EngineDeadError, match=GONE):
            client.call_utility("echo", "x")
    finally:
        client.shutdown()


def test_a_utility_call_that_finds_the_engine_gone_says_why(monkeypatch):
    monkeypatch.setattr(SyncMPClient, "DEATH_NOTICE_S", 0.05, raising=False)
    client = SyncMPClient(EngineConfig())
    try:
        _gone_on_send(monkeypatch, client)
        with pytest.raises(EngineDeadError, match=GONE):
            client.call_utility("echo", "x")
        assert client.is_dead
        assert not client._futures
    finally:
        client.shutdown()


def test_a_send_that_finds_the_engine_gone_waits_for_the_monitor_s_reason(monkeypatch):
    """The monitor's report, arriving while the send waits, is the one raised."""
    client = SyncMPClient(EngineConfig())
    sent = threading.Event()
    reason = "Engine core process died unexpectedly (as the monitor says)"

    def monitor() -> None:
        if sent.wait(10.0):
            client.resources.mark_dead(reason)

    watcher = threading.Thread(target=monitor)
    watcher.start()
    try:
        _gone_on_send(monkeypatch, client, sent)
        with pytest.raises(EngineDeadError) as info:
            client.add_request(req("a"))
        assert str(info.value) == reason
        assert client.is_dead
    finally:
        sent.set()
        watcher.join(10.0)
        client.shutdown()


async def test_an_async_send_that_finds_the_engine_gone_marks_the_client_dead_saying_why(monkeypatch):
    monkeypatch.setattr(AsyncMPClient, "DEATH_NOTICE_S", 0.05, raising=False)
    client = await AsyncMPClient.create(EngineConfig())
    async with client:
        _gone_on_send(monkeypatch, client)
        with pytest.raises(EngineDeadError, match=GONE) as info:
            await client.add_request_async(req("a"))
        assert client.is_dead
        assert str(info.value) == client.resources.dead_reason
        with pytest.raises(EngineDeadError, match=GONE):
            await client.call_utility_async("echo", "x")
