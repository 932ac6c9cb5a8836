"""``prefix-marginal``'s probation share does not wind up past what probation holds.

While probation holds less than its share, the share does not decide anything: the order
evicts the older leaf of either segment. Near misses of probation then kept multiplying its
odds with no effect on evictions and nothing to bring it back, until the share sat at 0.99
(the disk's order over the conversation trace, bench/trace_sim.py: one returning 149-block
chain took it from 0.54 to 0.99 in one PUT, and the disk stayed a FIFO over the writes for the
rest of the replay; hit ratio 0.073 at 2,990 and 3,010 blocks, 0.087 at 3,000). A step now
starts from the smaller of the share and probation's occupancy. Block counts only."""

from __future__ import annotations

import random
import sys
from pathlib import Path

from kvstore.node.tiers.order_marginal import MarginalOrder

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from trace_sim import SimNode, load_trace, simulate  # noqa: E402

CAPACITY = 100


def _occupancy(order: MarginalOrder) -> float:
    s = order.stats()
    return s["probation_blocks"] / len(order)


def test_near_misses_of_a_probation_under_its_share_do_not_wind_the_share_up():
    """A tier of 100: 80 hot blocks read after every write (main, always younger than any
    new block), the rest for new blocks, each written again 20-40 writes later: probation
    holds a tenth of the tier and its oldest leaf goes by age, not by the share, and some
    rewrites are near misses. The share ends near what probation holds (before: 0.76 from a
    start of 0.5, 0.44 from the default start of 0.2)."""
    rng = random.Random(1)
    order = MarginalOrder()
    stored: set[bytes] = set()

    def write(key: bytes) -> None:
        while len(stored) >= CAPACITY:
            it = order.candidates()
            victim = next(it)
            it.close()
            stored.discard(victim)
            order.discard(victim)
        stored.add(key)
        order.add(key, None)

    hot = [f"hot{i}".encode() for i in range(80)]
    for key in hot:
        write(key)
        order.touch(key)
    due: dict[int, list[bytes]] = {}
    for i in range(3000):
        key = f"new{i}".encode()
        write(key)
        due.setdefault(i + rng.randrange(20, 40), []).append(key)
        for old in due.pop(i, []):
            if old not in stored:
                write(old)
        for key in hot:
            order.touch(key)
    s = order.stats()
    assert s["near_misses_probation"] >= 20 and s["near_misses_main"] == 0, s
    assert _occupancy(order) < 0.15, s
    assert order.probation < 0.2, s


def test_the_disks_share_does_not_lock_in_off_3000_blocks():
    """One node, DRAM a quarter over a write-through disk, the first 1,500 requests of the
    conversation trace (the node's own order classes): the hit ratio at 2,990, 3,000 and
    3,010 blocks is within 3 % (before: 0.0733 / 0.0873 / 0.0739, the disk's share at 0.99 off
    3,000 blocks), and the disk's share stays under one half. From a start of one half, where
    the lock-in showed: from the default start (0.2) the disk's share stayed at 0.01-0.06 over
    these requests without the fix too, so the test could not fail."""
    reqs = load_trace("conversation", 1500)
    made: list[SimNode] = []
    ratios, shares = [], []
    for capacity in (2990, 3000, 3010):
        init = SimNode.__init__

        def record(self, *a, _init=init, **k):
            _init(self, *a, **k)
            made.append(self)

        SimNode.__init__ = record
        try:
            r = simulate(reqs, 1, capacity, "dram+disk", "prefix-marginal", marginal_start=0.5)
        finally:
            SimNode.__init__ = init
        ratios.append(r.hit_token_ratio)
        shares.append(made[-1].disk.order.probation)
    assert len(made) == 3
    assert max(ratios) < 1.03 * min(ratios), ratios
    assert max(shares) < 0.5, shares
