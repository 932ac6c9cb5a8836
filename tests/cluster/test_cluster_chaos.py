"""Chaos (issue 33, "What to build" 5): random kill -9, SIGSTOP, restart, partition and wipe
of one node at a time under a byte-verified load, then a census of every acknowledged block:
none lost unless every node that may have held it was wiped, no wrong bytes, every block back
to 2 copies once repair settles. Real daemons in network namespaces when root (partitions
included), on loopback otherwise. Bounded: ``TIERKV_CHAOS_S`` seconds of faults (default
75); bench/chaos.py runs the long version, one fault type at a time."""

from __future__ import annotations

import os

import pytest
from cluster.chaos_run import Chaos
from cluster.cluster_netns import cannot_make_namespaces

pytestmark = pytest.mark.heavy
SECONDS = float(os.environ.get("TIERKV_CHAOS_S", "75"))


@pytest.mark.timeout(SECONDS + 330)  # faults, then at most 60 s of settling, starts and the census
async def test_chaos_loses_no_acknowledged_block(tmp_path):
    chaos = Chaos(
        tmp_path, use_netns=not cannot_make_namespaces(), seed=int(os.environ.get("TIERKV_CHAOS_SEED", "1"))
    )
    try:
        chaos.start()
        r = await chaos.run(SECONDS, settle_s=60.0)
    finally:
        chaos.close()
    print(r.line())
    assert sum(r.faults.values()) >= 5 and r.acked > 100, r.line()  # the faults and the load ran
    assert r.wrong == 0, r.line()
    assert r.lost - r.lost_excused == 0, r.line()
    assert r.under_2_after_settle == 0, r.line()
