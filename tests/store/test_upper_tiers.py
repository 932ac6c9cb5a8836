"""``[eviction] upper_tiers``: a memory tier above a write-through disk runs the policy
(default "policy") or keeps recency ("recency": every block it holds is on the disk too, so
its evictions lose nothing, and its reads count in the disk's order too;
docs/eviction-policy.md "DRAM over a write-through disk keeping recency"). Everywhere else a
tier runs ``[eviction] policy``. The simulation (bench/trace_sim.py) builds its DRAM order by
the same rule."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from storeutil import checked, make_blocks, tiers_of

from kvstore.config import ConfigError, EvictionSection
from kvstore.node.store import NodeStore
from kvstore.results import Status

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from trace_sim import SimNode  # noqa: E402


def _policies(node: NodeStore) -> list[str]:
    return [t.eviction_stats()["policy"] for t in node.tiers]


@pytest.mark.parametrize(
    ("policy", "upper", "write_mode", "expected"),
    [
        ("prefix-marginal", None, "write-through", ["prefix-marginal", "prefix-marginal"]),
        ("prefix-marginal", "recency", "write-through", ["prefix-lru", "prefix-marginal"]),
        ("prefix-arc", "recency", "write-through", ["prefix-lru", "prefix-arc"]),
        ("lru", "recency", "write-through", ["lru", "lru"]),
        # write-back: a block reaches the disk only when it leaves memory; memory decides
        ("prefix-marginal", "recency", "write-back", ["prefix-marginal", "prefix-marginal"]),
    ],
)
async def test_the_orders_of_dram_over_a_disk(policy, upper, write_mode, expected, cfg_factory):
    kw = {} if upper is None else {"eviction__upper_tiers": upper}
    cfg = cfg_factory(eviction__policy=policy, disk__write_mode=write_mode, **kw)
    async with checked(await NodeStore.open(cfg)) as node:
        assert _policies(node) == expected


async def test_dram_alone_runs_the_policy(cfg_factory):
    async with checked(
        await NodeStore.open(cfg_factory(disk__enabled=False, eviction__policy="prefix-marginal"))
    ) as node:
        assert _policies(node) == ["prefix-marginal"]


async def _scan_after_a_hot_prefix(cfg_factory, **kw) -> list[str | None]:
    """DRAM of 32 blocks over a disk of ~60: a prefix of 8 blocks read twice (from DRAM: its
    disk copies are never read from the disk), then a one-off scan of 96 blocks that
    overflows the disk. Where the prefix is afterwards, per block."""
    async with checked(
        await NodeStore.open(cfg_factory(eviction__policy="prefix-marginal", disk__capacity="16MiB", **kw))
    ) as node:
        hot = make_blocks(8, seed=1)
        keys = [h.key for h, _ in hot]
        assert all(r.status is Status.STORED for r in await node.writer.put(hot))
        for _ in range(2):  # read twice: hot
            got = await node.reader.read(keys, [bytearray(h.payload_len) for h, _ in hot])
            assert [r.status for r in got] == [Status.HIT] * 8
        scan = make_blocks(96, seed=2)
        for part in range(0, 96, 8):  # the scan, one PUT per 8 blocks
            assert all(r.status.ok for r in await node.writer.put(scan[part : part + 8]))
        assert node.inspector.stats()["tiers"]["disk"]["evictions"] > 0  # the scan overflowed the disk
        node.check()
        return tiers_of(node, keys)


async def test_by_default_a_scan_keeps_a_prefix_read_from_dram(cfg_factory):
    """By default DRAM runs the scan-resistant policy and keeps the prefix."""
    assert await _scan_after_a_hot_prefix(cfg_factory) == ["dram"] * 8


async def test_under_recency_a_scan_keeps_a_prefix_read_from_dram_on_the_disk(cfg_factory):
    """Under ``upper_tiers = "recency"`` the scan flushes the prefix from DRAM, but its DRAM
    reads touched the disk copies (TierStack.touch): the disk's scan-resistant order keeps
    them, so the node still holds the prefix. (Before DRAM hits touched the disk copy, the
    disk dropped it too: the node lost it.)"""
    assert await _scan_after_a_hot_prefix(cfg_factory, eviction__upper_tiers="recency") == ["disk"] * 8


def test_a_bad_value_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="eviction.upper_tiers"):
        EvictionSection(upper_tiers="newest")  # type: ignore[arg-type]


def test_the_simulation_builds_dram_by_the_same_rule():
    assert SimNode(10, 40, "prefix-marginal", 0.1).dram.order.policy == "prefix-marginal"
    recency = SimNode(10, 40, "prefix-marginal", 0.1, upper_tiers="recency")
    assert recency.dram.order.policy == "prefix-lru"
    assert recency.disk.order.policy == "prefix-marginal"
    assert (
        SimNode(10, 0, "prefix-marginal", 0.1, upper_tiers="recency").dram.order.policy == "prefix-marginal"
    )
    assert SimNode(10, 40, "lru", 0.1, upper_tiers="recency").dram.order.policy == "lru"
