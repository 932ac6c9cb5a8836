"""Admission: how many connections the data port keeps, before and after HELLO.

A connection counts as *unauthenticated* from accept until its HELLO succeeds, then against
its tenant. Past ``limits.max_unauthenticated`` a new connection is closed at once (no reply:
nothing it sent has been read); past ``limits.max_conns_per_tenant`` its HELLO is refused
with ``busy``. So a flood of connections that never authenticate cannot take the file
descriptors that good clients and the admin port need, and one tenant cannot take another's
share. Loop thread only.
"""

from __future__ import annotations

from collections import Counter

from kvstore.config import LimitsSection


class Admission:
    def __init__(self, limits: LimitsSection) -> None:
        self.limits = limits
        self.unauthenticated = 0
        self.per_tenant: Counter[str] = Counter()

    def accept(self) -> bool:
        """A new connection: True when it may stay (it then counts as unauthenticated)."""
        if self.unauthenticated >= self.limits.max_unauthenticated:
            return False
        self.unauthenticated += 1
        return True

    def authenticate(self, previous: str | None, tenant: str) -> bool:
        """A HELLO for ``tenant`` on a connection that was ``previous`` (None: not yet
        authenticated). False, changing nothing, when the tenant is at its limit."""
        if previous == tenant:
            return True
        if self.per_tenant[tenant] >= self.limits.max_conns_per_tenant:
            return False
        self.leave(previous)
        self.per_tenant[tenant] += 1
        return True

    def leave(self, tenant: str | None) -> None:
        """A connection that was ``tenant`` (None: unauthenticated) ends or changes tenant."""
        if tenant is None:
            self.unauthenticated -= 1
            return
        self.per_tenant[tenant] -= 1
        if self.per_tenant[tenant] <= 0:
            del self.per_tenant[tenant]
