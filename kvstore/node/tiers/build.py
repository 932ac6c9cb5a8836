"""Build a node's tiers from its configuration: the memory tiers (hbm, dram), top first, and
the disk tier. The only place that knows which arena backs which tier.
"""

from __future__ import annotations

import asyncio

from kvstore.config import StoreConfig
from kvstore.node.tiers.arena import CudaArena, HostArena
from kvstore.node.tiers.base import BottomTier, SlotTier
from kvstore.node.tiers.count import CountArena, CountDiskTier
from kvstore.node.tiers.disk import DiskTier
from kvstore.node.tiers.memory import MemoryTier
from kvstore.node.tiers.order import EvictionOrder, make_order
from kvstore.node.tiers.shares import TenantShares
from kvstore.node.tiers.tasks import Finishing


def _order(cfg: StoreConfig, top: bool, in_memory: bool) -> EvictionOrder:
    """A new eviction order for one tier, as ``[eviction]`` configures it
    (EvictionSection.tier_policy: a memory tier above a write-through disk may keep
    recency: ``in_memory``); ``top``: the node's first tier, the only one whose own evictions tell a block's
    parent is gone from the node."""
    e = cfg.eviction
    over_disk = in_memory and cfg.disk.enabled and cfg.disk.write_mode == "write-through"
    return make_order(
        e.tier_policy(over_disk), e.probation, e.ghosts, marks_orphans=top, marginal_start=e.marginal_start
    )


def _shares(cfg: StoreConfig) -> TenantShares:
    return TenantShares(cfg.eviction.tenant_share)


async def build_tiers(cfg: StoreConfig, finishing: Finishing) -> tuple[list[SlotTier], BottomTier | None]:
    """The configured memory tiers (top first) and disk tier (None when disabled); the disk
    index is rebuilt here, and its writes left finishing are tracked by ``finishing``. Raises
    TierError naming the tier that cannot be opened."""
    memory: list[SlotTier] = []
    if cfg.hbm.capacity:
        arena = CudaArena(cfg.hbm.capacity, cfg.hbm.device)
        memory.append(MemoryTier("hbm", arena, cfg.hbm.slab_size, _order(cfg, True, True), _shares(cfg)))
    if cfg.dram.capacity:
        size = cfg.dram.capacity // cfg.dram.slab_size * cfg.dram.slab_size
        # in a thread: prefaulting or pinning a large arena takes seconds, and the daemon's
        # loop answers /readyz (503) meanwhile
        arena = await asyncio.to_thread(HostArena, size, cfg.dram.pin, cfg.dram.prefault)
        memory.append(
            MemoryTier("dram", arena, cfg.dram.slab_size, _order(cfg, not memory, True), _shares(cfg))
        )
    disk = None
    if cfg.disk.enabled:
        d = cfg.disk
        disk = DiskTier(
            d.path,
            d.capacity,
            map_size=d.map_size,
            sync=d.sync,
            writemap=d.writemap,
            finishing=finishing,
            order=_order(cfg, not memory, False),
            shares=_shares(cfg),
        )
    return memory, disk


def build_count_tiers(cfg: StoreConfig, finishing: Finishing) -> tuple[list[SlotTier], BottomTier | None]:
    """The tiers of :func:`build_tiers` with no bytes behind them (kvstore/node/tiers/count.py):
    DRAM over a :class:`CountArena`, the disk a :class:`CountDiskTier` (its empty LMDB at
    ``disk.path``); no HBM. For simulations (bench/trace_sim.py) of a node of this config."""
    memory: list[SlotTier] = []
    if cfg.dram.capacity:
        arena = CountArena(cfg.dram.capacity // cfg.dram.slab_size * cfg.dram.slab_size)
        memory.append(MemoryTier("dram", arena, cfg.dram.slab_size, _order(cfg, True, True), _shares(cfg)))
    disk = None
    if cfg.disk.enabled:
        order = _order(cfg, not memory, False)
        disk = CountDiskTier(
            cfg.disk.path, cfg.disk.capacity, finishing=finishing, order=order, shares=_shares(cfg)
        )
    return memory, disk
