"""Tokens and tenants: the daemon's answer to "who is this connection?".

The token file has one ``token tenant`` pair per line; ``#`` starts a comment. The tenant
``*`` is the operator: it may use the admin API and is refused on the data port. Any other
tenant name is also the tenant's namespace salt, so tenants' block keys never coincide and
the daemon can check every block's namespace against the tenant's.

:class:`TokenTable` is immutable; the daemon swaps in a new one on SIGHUP (loop thread only).
"""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass

from kvstore.errors import ConfigError

OPERATOR = "*"


@dataclass(frozen=True)
class TokenTable:
    """``enabled`` is False when the daemon runs without a token file (loopback only)."""

    entries: tuple[tuple[str, str], ...] = ()
    enabled: bool = False
    path: str = ""

    @classmethod
    def load(cls, path: str) -> TokenTable:
        """Read ``path``; an empty path means auth off. Raises ConfigError naming the file and
        line for a malformed line, a duplicate token or an unreadable file."""
        if not path:
            return cls()
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
        return cls(tuple(entries), True, path)

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
