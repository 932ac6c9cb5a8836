"""Per-tenant shares of a tier: what one tenant's writes may evict of another's.

A tenant's blocks carry its namespace (its salt is part of it, see kvstore.keys); the node
knows each namespace's tenant from the HELLO that declared it (kvstore.node.tiers.owners),
and every tier's index sums the bytes each tenant holds over all its namespaces
(kvstore.node.tiers.index; a namespace no HELLO claimed counts as its own owner). A write of
owner W may evict a block of owner V only when V is W, or V holds more than ``share`` of the
tier's capacity, or V holds more than W: a scan by one tenant flushes its own blocks (and
what others hold beyond their share), never another tenant's last ``share`` of the tier,
however many namespaces the scan spreads over; a newcomer still takes room from anyone
richer than itself, so the tier converges to equal shares when every tenant is under
``share``. See docs/security.md "Per-tenant shares".
"""

from __future__ import annotations


class TenantShares:
    """``share``: a fraction of a tier's capacity (0: no shares, any block may go)."""

    def __init__(self, share: float = 0.0) -> None:
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"tenant share {share!r} is not in [0, 1]")
        self.share = share
        self.refused = 0  # candidates kept for their namespace's share

    def allows(self, tier, victim: bytes, writer_ns: bytes | None) -> bool:
        """Whether a write of namespace ``writer_ns`` may evict ``victim`` from ``tier`` (a
        tier with ``owner``, ``owner_of_namespace``, ``owner_usage`` and ``capacity_bytes``,
        kvstore.node.tiers.index.LruIndex): two dict lookups, whatever the namespaces held."""
        if not self.share:
            return True
        victim_owner = tier.owner(victim)
        writer = tier.owner_of_namespace(writer_ns)
        if victim_owner == writer:
            return True
        used = tier.owner_usage(victim_owner)
        if used > self.share * tier.capacity_bytes or used > tier.owner_usage(writer):
            return True
        self.refused += 1
        return False
