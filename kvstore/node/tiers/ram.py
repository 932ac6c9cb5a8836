"""The RAM the tiers' indexes and in-memory headers take, charged against one budget per node
(``node.index_memory``): the memory a block costs beside its payload, accounted where it is
spent, so no tier -- a disk of a terabyte, a DRAM arena of 256-byte slots -- can hold more
blocks than the host has memory to index.

Each block a tier indexes is charged :data:`BLOCK_BYTES` (the index entry, its key, the probe
table's share, the eviction order's node: ~1,080 B measured per 4-byte block on disk, ~930 B
in DRAM with a 153-byte header) plus, in a memory tier, its header (kept in RAM beside the
arena). That is also the least any block is charged: a tenant writing tiny blocks fills the
budget as fast as their count grows, and a tier past the budget evicts (its own order, the
tenant shares applying) or refuses the block, as it does at capacity. The budget is
checked before a write and charged when the block is indexed; writes reserved meanwhile can
pass it by at most what is in flight. Loop thread only.
"""

from __future__ import annotations

BLOCK_BYTES = 1152  # the least a block costs in RAM beside its payload (see the module doc)


class IndexMemory:
    """``budget``: bytes (> 0)."""

    def __init__(self, budget: int) -> None:
        if budget <= 0:
            raise ValueError(f"index memory budget {budget!r} must be > 0")
        self.budget = budget
        self.used = 0

    @staticmethod
    def cost(header_bytes_in_ram: int) -> int:
        """What one block costs: :data:`BLOCK_BYTES` plus the header bytes a tier keeps in RAM."""
        return BLOCK_BYTES + header_bytes_in_ram

    def free(self) -> int:
        return self.budget - self.used

    def fits(self, nbytes: int) -> bool:
        return self.used + nbytes <= self.budget

    def charge(self, nbytes: int) -> None:
        self.used += nbytes

    def stats(self) -> dict[str, int]:
        return {"budget_bytes": self.budget, "used_bytes": self.used}
