"""Admission: which connections the data port keeps, before and after HELLO.

A connection counts as *unauthenticated* from accept until its HELLO succeeds, then against
its tenant. A new connection is always taken: when ``limits.max_unauthenticated`` are
already waiting for their HELLO, the oldest unauthenticated connection of the source
address with the most of them is dropped to make room (:meth:`Admission.accept` names it;
the port closes it, no reply). So a flood of connections that never authenticate costs the
flooder its own oldest connections: a client from another address is never dropped for it,
and one from the same address only when ``max_unauthenticated`` newer connections arrive
before its HELLO does. Past ``limits.max_conns_per_tenant`` a HELLO is refused with
``busy``, so one tenant cannot take another's share. Loop thread only.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from kvstore.config import LimitsSection


class SourceShares:
    """Connections by source address, oldest first: the one to drop for a newcomer is the
    oldest of the source holding the most (the data port's unauthenticated connections, the
    admin port's connections). Hashable items; loop thread only."""

    def __init__(self) -> None:
        self._of: dict[str, dict[Any, None]] = {}  # dicts keep insertion order: oldest first
        self._source: dict[Any, str] = {}

    def __len__(self) -> int:
        return len(self._source)

    def __contains__(self, item: Any) -> bool:
        return item in self._source

    def __iter__(self):
        return iter(list(self._source))

    def add(self, item: Any, source: str) -> None:
        self._of.setdefault(source, {})[item] = None
        self._source[item] = source

    def remove(self, item: Any) -> bool:
        """Forget ``item``; False when it was not here."""
        source = self._source.pop(item, None)
        if source is None:
            return False
        mine = self._of[source]
        del mine[item]
        if not mine:
            del self._of[source]
        return True

    def victim(self) -> Any:
        """The oldest item of the source with the most (O(sources)); there must be one."""
        return next(iter(max(self._of.values(), key=len)))


class Admission:
    """Tracks sessions (kvstore.daemon.session.Session: ``tenant`` None before HELLO,
    ``source`` the peer's address)."""

    def __init__(self, limits: LimitsSection) -> None:
        self.limits = limits
        self._waiting = SourceShares()  # the unauthenticated sessions
        self.per_tenant: Counter[str] = Counter()
        self._of_tenant: dict[str, dict[Any, None]] = {}

    def accept(self, sess: Any) -> Any | None:
        """Take ``sess`` (a new connection) as unauthenticated. Returns the session to drop
        for it (already forgotten here; the caller closes its connection), or None."""
        victim = None
        if len(self._waiting) >= self.limits.max_unauthenticated:
            victim = self._waiting.victim()
            self._waiting.remove(victim)
        self._waiting.add(sess, sess.source)
        return victim

    def authenticate(self, sess: Any, tenant: str) -> bool:
        """A HELLO for ``tenant`` on ``sess`` (whose ``tenant`` is still the previous one, None
        when not yet authenticated). False, changing nothing, when the tenant is at its limit
        or ``sess`` was dropped meanwhile."""
        if sess.tenant == tenant:
            return True
        if self.per_tenant[tenant] >= self.limits.max_conns_per_tenant or not self.admitted(sess):
            return False
        self.leave(sess)
        self.per_tenant[tenant] += 1
        self._of_tenant.setdefault(tenant, {})[sess] = None
        return True

    def admitted(self, sess: Any) -> bool:
        """Whether ``sess`` is counted here (not dropped, not left)."""
        if sess.tenant is None:
            return sess in self._waiting
        return sess in self._of_tenant.get(sess.tenant, ())

    def leave(self, sess: Any) -> None:
        """``sess`` ends, or changes tenant (then :meth:`authenticate` counts it anew).
        Idempotent: a dropped session leaves once."""
        if not self.admitted(sess):
            return
        if sess.tenant is None:
            self._waiting.remove(sess)
            return
        mine = self._of_tenant[sess.tenant]
        del mine[sess]
        if not mine:
            del self._of_tenant[sess.tenant]
        self.per_tenant[sess.tenant] -= 1
        if self.per_tenant[sess.tenant] <= 0:
            del self.per_tenant[sess.tenant]
