"""Mutual authentication of a remote (tcp) engine start-up: an HMAC-SHA256 challenge-response
on a shared secret, in both directions, before the frontend sends anything of its own
(``control``'s ``Hello`` / ``Auth`` carry the nonces and proofs; docs/design.md, "The
control plane", has the exchange). Lowest layer: imports ``errors`` and the standard
library, never ``control`` or anything above it. The secret comes from the file named by
``SHMCLIENT_SECRET_FILE`` (a regular file of at most ``MAX_SECRET_FILE_BYTES``: its
bytes, one trailing newline, ``\n`` or ``\r\n``, dropped), else from
``SHMCLIENT_SECRET``; never from a command line (which other users can read in
/proc/<pid>/cmdline). Without one, a remote start-up is refused with
``AuthenticationError``, unless ``SHMCLIENT_ALLOW_UNAUTHENTICATED=1`` (a warning is
logged; only for a network where every host that can reach the port is trusted). A
proof covers the role and both nonces, so neither side's answer can be replayed to the
other or in another session. Nothing here blocks.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat

from .errors import AuthenticationError

log = logging.getLogger("shmclient")

SECRET_ENV = "SHMCLIENT_SECRET"
SECRET_FILE_ENV = "SHMCLIENT_SECRET_FILE"
INSECURE_ENV = "SHMCLIENT_ALLOW_UNAUTHENTICATED"
NONCE_BYTES = 32
#: The length of a proof (an HMAC-SHA256 digest).
PROOF_BYTES = 32
_TAG = b"shmclient-auth-v1\0"
#: The longest secret file read (a secret is a line; anything longer is a wrong file).
MAX_SECRET_FILE_BYTES = 4096


def load_secret() -> bytes | None:
    """The shared secret (see the module docstring), or None when none is set. Raises
    ``AuthenticationError`` for a secret file that cannot be read or is empty."""
    path = os.environ.get(SECRET_FILE_ENV)
    if path:
        secret = _read_secret_file(path)
        # one line ending, as an editor or `echo` leaves it; any other byte is the secret's
        if secret.endswith(b"\r\n"):
            secret = secret[:-2]
        elif secret.endswith(b"\n"):
            secret = secret[:-1]
        if not secret:
            raise AuthenticationError(f"{SECRET_FILE_ENV}={path!r} is empty")
        return secret
    value = os.environ.get(SECRET_ENV)
    return os.fsencode(value) if value else None  # (bytes that are not UTF-8 included)


def _read_secret_file(path: str) -> bytes:
    """The bytes of the secret file ``path``. Raises ``AuthenticationError`` for one that
    cannot be read, is not a regular file (a FIFO would block the start-up until someone
    writes to it; a device may never end) or is longer than ``MAX_SECRET_FILE_BYTES``
    (read at call time). Never blocks: opened with ``O_NONBLOCK``, read at most that much."""
    limit = MAX_SECRET_FILE_BYTES
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise AuthenticationError(f"{SECRET_FILE_ENV}={path!r} cannot be read: {e.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise AuthenticationError(
                f"{SECRET_FILE_ENV}={path!r} is not a regular file: it must name a file that "
                "holds the secret")
        data = b""
        while len(data) <= limit:
            chunk = os.read(fd, limit + 1 - len(data))
            if not chunk:
                return data
            data += chunk
        raise AuthenticationError(
            f"{SECRET_FILE_ENV}={path!r} is longer than {limit} bytes: it must hold only the "
            "secret")
    except AuthenticationError:  # (a PermissionError, an OSError: not the one below)
        raise
    except OSError as e:
        raise AuthenticationError(f"{SECRET_FILE_ENV}={path!r} cannot be read: {e.strerror}") from None
    finally:
        os.close(fd)


def require_secret(side: str) -> bytes | None:
    """The secret for a remote start-up on ``side`` ("frontend" / "engine"); None only
    with the explicit opt-in (logged at WARNING); else ``AuthenticationError``."""
    secret = load_secret()
    if secret is not None:
        return secret
    if os.environ.get(INSECURE_ENV) == "1":
        log.warning(
            "remote engine start-up on the %s WITHOUT authentication (%s=1): anyone who "
            "can reach the port can read prompts, forge outputs or drive the engine", side,
            INSECURE_ENV)
        return None
    raise AuthenticationError(
        f"no shared secret for the remote engine connection ({side}): set {SECRET_FILE_ENV} "
        f"(a file only you can read) or {SECRET_ENV} on both the frontend and the engine, "
        f"or {INSECURE_ENV}=1 to run without authentication on a trusted network")


def nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def proof(secret: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    """HMAC-SHA256 of ``role`` ("frontend" / "engine") and both nonces."""
    return hmac.new(secret, _TAG + role + b"\0" + first + second, hashlib.sha256).digest()


def verify(secret: bytes, role: bytes, first: bytes, second: bytes, mac: bytes) -> bool:
    return hmac.compare_digest(proof(secret, role, first, second), mac)
