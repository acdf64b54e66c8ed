"""The waiting layer at its edges: a descriptor closed under a waiter."""

from __future__ import annotations

import asyncio
import os

import pytest

from shmclient import waiting


# ------------------------------------------------------------------ wait_fd


async def test_wait_fd_on_a_closed_descriptor_leaves_nothing_parked():
    """add_reader refuses a closed descriptor: no entry may stay behind, or a later wait
    on a new descriptor of the same number registers no reader and only times out."""
    loop = asyncio.get_running_loop()
    r, w = os.pipe()
    os.close(r)
    os.close(w)
    with pytest.raises(OSError):
        await waiting.wait_fd(r, 1.0)
    assert (id(loop), r) not in waiting._parked
    r2, w2 = os.pipe()  # (most likely the same number again)
    try:
        os.write(w2, b"x")
        assert await waiting.wait_fd(r2, 2.0) is True
    finally:
        os.close(r2)
        os.close(w2)
    assert not waiting._parked
