"""Per-tenant shares of a tier: what one namespace's writes may evict of another's.

A tenant's blocks carry its namespace (its salt is part of it, see kvstore.keys), and every
tier's index counts the bytes each namespace holds (kvstore.node.tiers.index). A write of
namespace W may evict a block of namespace V only when V is W, or V holds more than
``share`` of the tier's capacity, or V holds more than W: a scan by one tenant flushes its
own blocks (and what others hold beyond their share), never another tenant's last
``share`` of the tier; a newcomer still takes room from anyone richer than itself, so the
tier converges to equal shares when every namespace is under ``share``. See docs/security.md
"Per-tenant shares".
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
        """Whether a write of ``writer_ns`` may evict ``victim`` from ``tier`` (a tier with
        ``namespace``, ``namespace_usage`` and ``capacity_bytes``)."""
        if not self.share:
            return True
        ns = tier.namespace(victim)
        if ns == writer_ns:
            return True
        used = tier.namespace_usage(ns)
        if used > self.share * tier.capacity_bytes or used > tier.namespace_usage(writer_ns):
            return True
        self.refused += 1
        return False
