"""Tokens, tenants and tenant salts: the daemon's answer to "who is this connection, and in
which namespaces do its keys live?".

The token file has one ``token tenant`` pair per line; ``#`` starts a comment. The tenant
``*`` is the operator: it may use the admin API, and on the data port only as a peer
session (HELLO tenant ``"*"``: another node's repair), which may use EXISTS, PUT and STATS
only (kvstore/daemon/dataport.py ``PEER_OPS``); any other HELLO with its token is refused.

Each tenant's namespaces are salted (kvstore.keys.Namespace.tenant_salt), so tenants' keys
never coincide and the daemon checks every block's namespace against the session's. With
``auth.salt_secret_file`` the salt is ``HMAC-SHA256(secret, tenant)`` (hex, 32 characters):
a secret handed to the tenant at HELLO, so no one can compute another tenant's keys offline
(docs/security.md). Every node of a cluster must hold the same secret, or the same prompt
gets different keys on different nodes. Without it the salt is the tenant's name: isolation
of reads and writes still holds, but keys can be computed by anyone who knows the name.

:class:`TokenTable` is immutable; the daemon swaps in a new one on SIGHUP (loop thread only).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass

from kvstore.errors import ConfigError

OPERATOR = "*"
_SALT_CONTEXT = b"tierkv tenant salt v1\x00"
_MIN_SECRET = 16


@dataclass(frozen=True)
class TokenTable:
    """``enabled`` is False when the daemon runs without a token file (loopback only)."""

    entries: tuple[tuple[str, str], ...] = ()
    enabled: bool = False
    path: str = ""
    secret: bytes = b""  # the salt secret; empty: salts are tenant names

    @classmethod
    def load(cls, path: str, secret_path: str = "") -> TokenTable:
        """Read ``path`` (and the salt secret at ``secret_path``); an empty path means auth
        off. Raises ConfigError naming the file and line for a malformed line, a duplicate
        token, an unreadable file, or a secret shorter than 16 bytes."""
        secret = _read_secret(secret_path) if secret_path else b""
        if not path:
            return cls(secret=secret)
        try:
            with open(path, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except OSError as exc:
            raise ConfigError(f"auth.token_file: cannot read {path!r}: {exc.strerror}") from exc
        entries: list[tuple[str, str]] = []
        seen: set[str] = set()
        for n, line in enumerate(lines, 1):
            text = line.split("#", 1)[0].strip()
            if not text:
                continue
            parts = text.split()
            if len(parts) != 2:
                raise ConfigError(f"auth.token_file {os.path.basename(path)}:{n}: expected 'token tenant'")
            token, tenant = parts
            if len(token) < 8:
                raise ConfigError(
                    f"auth.token_file {os.path.basename(path)}:{n}: token shorter than 8 characters"
                )
            if token in seen:
                raise ConfigError(f"auth.token_file {os.path.basename(path)}:{n}: duplicate token")
            seen.add(token)
            entries.append((token, tenant))
        return cls(tuple(entries), True, path, secret)

    def tenant_of(self, token: str) -> str | None:
        """The tenant ``token`` authenticates, or None. Without auth every caller is tenant
        "". Compares every entry in constant time per entry (no early exit on a prefix)."""
        if not self.enabled:
            return ""
        found = None
        given = token.encode()
        for tok, tenant in self.entries:
            if hmac.compare_digest(tok.encode(), given):
                found = tenant
        return found

    def salt_of(self, tenant: str) -> str:
        """The namespace salt of ``tenant``: "" for the single tenant of a daemon without auth,
        the HMAC of the secret when there is one, else the tenant's name."""
        if not tenant:
            return ""
        if not self.secret:
            return tenant
        return secret_salt(self.secret, tenant)


def secret_salt(secret: bytes, tenant: str) -> str:
    """``tenant``'s namespace salt under the cluster secret (the same on every node)."""
    return hmac.new(secret, _SALT_CONTEXT + tenant.encode(), hashlib.sha256).hexdigest()[:32]


def read_salt_secret(path: str) -> bytes:
    """The secret in ``path`` (ConfigError naming ``auth.salt_secret_file`` when unusable)."""
    return _read_secret(path)


def _read_secret(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            secret = f.read().strip()
    except OSError as exc:
        raise ConfigError(f"auth.salt_secret_file: cannot read {path!r}: {exc.strerror}") from exc
    if len(secret) < _MIN_SECRET:
        raise ConfigError(
            f"auth.salt_secret_file: {os.path.basename(path)} holds {len(secret)} bytes; at least {_MIN_SECRET}"
        )
    return secret
