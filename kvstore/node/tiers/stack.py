"""A node's tier stack: its memory tiers top first (hbm, dram), then its bottom tier (disk) or
none. Built once when the node opens; the list never changes while it is open.
"""

from __future__ import annotations

from kvstore.node.tiers.base import BottomTier, SlotTier, Tier


class TierStack:
    """``memory``: the slot tiers, top first; ``disk``: the bottom tier, or None."""

    def __init__(self, memory: list[SlotTier], disk: BottomTier | None) -> None:
        self.memory = memory
        self.disk = disk
        self.all: list[Tier] = [*memory, *([disk] if disk is not None else [])]
        self.by_name: dict[str, SlotTier] = {t.name: t for t in memory}

    @property
    def top(self) -> SlotTier | None:
        """The highest memory tier, where writes and promotions land; None without one."""
        return self.memory[0] if self.memory else None

    @property
    def dram(self) -> SlotTier | None:
        return self.by_name.get("dram")

    def below(self, tier: SlotTier) -> list[Tier]:
        """The tiers under a memory tier, next one first."""
        rest: list[Tier] = [*self.memory[self.memory.index(tier) + 1 :]]
        return rest if self.disk is None else [*rest, self.disk]

    def touch(self, tier: Tier, key: bytes) -> None:
        """``key`` was used (read, or written again) in ``tier``: touched there and, for a memory
        tier, in the disk's order too (a no-op where the disk has no copy). A block read from
        DRAM is a block in use on the node: were the disk's order not told, a one-off scan
        would flush a prefix read only from DRAM off the disk, and off the node with it once
        DRAM keeps recency (docs/eviction-policy.md, "A DRAM hit touches the disk copy")."""
        tier.touch(key)
        if tier is not self.disk and self.disk is not None:
            self.disk.touch(key)

    def in_memory(self, key: bytes) -> bool:
        return any(key in t for t in self.memory)
