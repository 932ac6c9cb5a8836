"""A memory tier above a write-through disk keeps recency (``[eviction] upper_tiers``,
default "recency"): every block it holds is on the disk too, so its evictions lose nothing and
the node's scan resistance lives in the disk's order (docs/eviction-policy.md "DRAM over a
write-through disk keeps recency"). Everywhere else a tier runs ``[eviction] policy``. The
simulation (bench/trace_sim.py) builds its DRAM order by the same rule."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from storeutil import make_blocks

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
        ("prefix-marginal", None, "write-through", ["prefix-lru", "prefix-marginal"]),
        ("prefix-arc", None, "write-through", ["prefix-lru", "prefix-arc"]),
        ("lru", None, "write-through", ["lru", "lru"]),
        ("prefix-marginal", "policy", "write-through", ["prefix-marginal", "prefix-marginal"]),
        # write-back: a block reaches the disk only when it leaves memory; memory decides
        ("prefix-marginal", None, "write-back", ["prefix-marginal", "prefix-marginal"]),
    ],
)
async def test_the_orders_of_dram_over_a_disk(policy, upper, write_mode, expected, cfg_factory):
    kw = {} if upper is None else {"eviction__upper_tiers": upper}
    cfg = cfg_factory(eviction__policy=policy, disk__write_mode=write_mode, **kw)
    node = await NodeStore.open(cfg)
    try:
        assert _policies(node) == expected
    finally:
        await node.close()


async def test_dram_alone_runs_the_policy(cfg_factory):
    node = await NodeStore.open(cfg_factory(disk__enabled=False, eviction__policy="prefix-marginal"))
    try:
        assert _policies(node) == ["prefix-marginal"]
    finally:
        await node.close()


async def test_a_scan_that_leaves_dram_is_still_on_disk(cfg_factory):
    """What the recency tier evicts is not lost: a hot prefix read back, then a one-off scan
    of three DRAMs' worth pushes it out of DRAM (32 blocks), and the disk's scan-resistant
    order still holds every block of it."""
    node = await NodeStore.open(cfg_factory(eviction__policy="prefix-marginal"))
    try:
        hot = make_blocks(8, seed=1)
        keys = [h.key for h, _ in hot]
        assert all(r.status is Status.STORED for r in await node.writer.put(hot))
        assert await node.contains(keys) == ["dram"] * 8
        for _ in range(2):  # read twice: hot
            got = await node.reader.get_into(keys, [bytearray(h.payload_len) for h, _ in hot])
            assert [r.status for r in got] == [Status.HIT] * 8
        for part in range(0, 96, 8):  # the scan, one PUT per 8 blocks
            scan = make_blocks(96, seed=2)[part : part + 8]
            assert all(r.status.ok for r in await node.writer.put(scan))
        where = await node.contains(keys)
        assert where == ["disk"] * 8, where
        node.check()
    finally:
        await node.close()


def test_a_bad_value_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="eviction.upper_tiers"):
        EvictionSection(upper_tiers="newest")  # type: ignore[arg-type]


def test_the_simulation_builds_dram_by_the_same_rule():
    assert SimNode(10, 40, "prefix-marginal", 0.1).dram.order.policy == "prefix-lru"
    assert SimNode(10, 40, "prefix-marginal", 0.1).disk.order.policy == "prefix-marginal"
    assert (
        SimNode(10, 40, "prefix-marginal", 0.1, upper_tiers="policy").dram.order.policy == "prefix-marginal"
    )
    assert SimNode(10, 0, "prefix-marginal", 0.1).dram.order.policy == "prefix-marginal"
    assert SimNode(10, 40, "lru", 0.1).dram.order.policy == "lru"
