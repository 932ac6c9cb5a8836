"""``prefix-marginal``'s probation share starts at ``[eviction] marginal_start`` (0.2 by
default, not one half: three nodes each see a third of the near misses, so a share stays near
its start longer; docs/eviction-policy.md "Three nodes after the wind-up fix: a lower start
share"). The simulation (bench/trace_sim.py) builds its orders with make_order's default, the
node with the config's: the two defaults are one number. Block counts only."""

from __future__ import annotations

import pytest
from storeutil import checked

from kvstore.config import ConfigError, EvictionSection
from kvstore.node.store import NodeStore
from kvstore.node.tiers.order import make_order
from kvstore.node.tiers.order_marginal import START_SHARE, MarginalOrder


def test_a_fresh_order_starts_at_the_default_share():
    assert START_SHARE == 0.2
    assert MarginalOrder().probation == 0.2
    assert make_order("prefix-marginal").probation == 0.2
    assert make_order("prefix-marginal", marginal_start=0.35).probation == 0.35
    assert make_order("prefix-arc", probation=0.1, marginal_start=0.35).probation == 0.1  # not its share


def test_the_config_default_is_the_orders_default():
    assert EvictionSection().marginal_start == START_SHARE


@pytest.mark.parametrize("start", [0.0, 0.005, 0.995, 1.0])
def test_a_start_outside_the_shares_range_is_refused(start, cfg_factory):
    with pytest.raises(ValueError, match="start share"):
        MarginalOrder(start=start)
    with pytest.raises(ConfigError, match="eviction.marginal_start"):
        cfg_factory(eviction__marginal_start=start)


@pytest.mark.parametrize("start", [None, 0.35])
async def test_every_tier_of_a_node_starts_at_the_configured_share(start, cfg_factory):
    """DRAM over a disk, both running the policy (``upper_tiers = "policy"``; by default DRAM
    above a write-through disk keeps recency, tests/store/test_upper_tiers.py): both tiers'
    orders start at ``eviction.marginal_start``."""
    kw = {} if start is None else {"eviction__marginal_start": start}
    async with checked(
        await NodeStore.open(
            cfg_factory(eviction__policy="prefix-marginal", eviction__upper_tiers="policy", **kw)
        )
    ) as node:
        shares = [t.eviction_stats()["probation_share"] for t in node.tiers]
        assert len(shares) == 2, shares
        assert shares == [0.2 if start is None else start] * 2, shares
