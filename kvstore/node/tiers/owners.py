"""Which tenant each namespace belongs to: the unit of the per-tenant shares
(kvstore.node.tiers.shares) and of the cap on the namespaces one tenant may hold.

A namespace id is a hash salted with its tenant (kvstore.keys), so a tier cannot tell from a
block whose it is; the daemon can, at HELLO, when it salts the namespaces a tenant declares
(:meth:`NamespaceOwners.claim`). Every tier's :class:`~kvstore.node.tiers.namespace_ids.NamespaceIds`
sums its bytes per *owner*: the tenant of a claimed namespace, or the namespace itself while
no HELLO has claimed it (blocks found on disk at start, or copied in by another node's
repair): a tenant that writes one block per fresh namespace is still one tenant, holding the
sum of them all, never the "newcomer" that may take room from anyone.

A tenant holds at most ``max_per_tenant`` namespaces: those a live connection declared and
those a tier still holds blocks of. A HELLO that would take it past the cap is refused
(:class:`NamespaceCapError`, one line); a namespace no connection declares and no tier holds
is forgotten when the cap is reached, so the book is bounded by tenants x cap. Loop thread only.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable
from typing import Protocol


class NamespaceCapError(Exception):
    """A HELLO would take its tenant past ``limits.max_namespaces_per_tenant``."""


class _OwnedIds(Protocol):
    """What the book needs of a tier's namespace ids (kvstore.node.tiers.namespace_ids.NamespaceIds)."""

    def retag(self, ns: bytes, owner: Hashable) -> None: ...

    def holds(self, ns: bytes) -> bool: ...


class NamespaceOwners:
    """``max_per_tenant``: namespaces one tenant may hold (0: no cap)."""

    def __init__(self, max_per_tenant: int = 0) -> None:
        if max_per_tenant < 0:
            raise ValueError(f"max_per_tenant {max_per_tenant!r} is negative")
        self.max_per_tenant = max_per_tenant
        self._tenant: dict[bytes, str] = {}
        self._of: dict[str, set[bytes]] = {}
        self._declared: Counter[bytes] = Counter()  # live connections declaring each namespace
        self._tiers: list[_OwnedIds] = []
        self.refused = 0  # HELLOs refused for the cap

    def watch(self, ids: _OwnedIds) -> None:
        """Keep ``ids`` (one tier's) summing the bytes of a namespace under its tenant from
        the claim on (and of those claimed already)."""
        self._tiers.append(ids)
        for ns, tenant in self._tenant.items():
            ids.retag(ns, tenant)

    def owner(self, ns: bytes | None) -> Hashable:
        """What the shares count ``ns``'s bytes under: its tenant once claimed, else ``ns``."""
        if ns is None:
            return None
        return self._tenant.get(ns, ns)

    def tenant(self, ns: bytes) -> str | None:
        return self._tenant.get(ns)

    def claim(self, tenant: str, namespaces: Iterable[bytes], previous: Iterable[bytes] = ()) -> None:
        """A connection of ``tenant`` declares ``namespaces`` (in place of ``previous``, its
        earlier HELLO's). NamespaceCapError, and nothing changed, when the tenant would then
        hold more than ``max_per_tenant``. A namespace another tenant claimed stays that
        tenant's (salts make this a hash collision: the declaring session still sees only
        its own blocks, the daemon checks every block's namespace)."""
        wanted = set(namespaces)
        mine = self._of.setdefault(tenant, set())
        new = [ns for ns in wanted if ns not in self._tenant]
        if self.max_per_tenant and len(mine) + len(new) > self.max_per_tenant:
            self._forget_unused(mine)
            if len(mine) + len(new) > self.max_per_tenant:
                self.refused += 1
                raise NamespaceCapError(
                    f"tenant {tenant or '-'!s} would hold {len(mine) + len(new)} namespaces on this node; "
                    f"at most {self.max_per_tenant} namespaces (limits.max_namespaces_per_tenant)"
                )
        for ns in new:
            self._tenant[ns] = tenant
            mine.add(ns)
            for ids in self._tiers:
                ids.retag(ns, tenant)
        self._declared.update(wanted)
        self.release(previous)

    def release(self, namespaces: Iterable[bytes]) -> None:
        """A connection that declared ``namespaces`` is gone (or declared others)."""
        for ns in set(namespaces):
            left = self._declared[ns] - 1
            if left > 0:
                self._declared[ns] = left
            else:
                self._declared.pop(ns, None)

    def held(self, tenant: str) -> int:
        """How many namespaces ``tenant`` holds now (some may be unused until the cap sweeps)."""
        return len(self._of.get(tenant, ()))

    def _forget_unused(self, mine: set[bytes]) -> None:
        """Drop the namespaces of ``mine`` that no connection declares and no tier holds:
        work of the cap's size, only when a HELLO reaches the cap."""
        for ns in [ns for ns in mine if ns not in self._declared]:
            if not any(ids.holds(ns) for ids in self._tiers):
                mine.discard(ns)
                del self._tenant[ns]
