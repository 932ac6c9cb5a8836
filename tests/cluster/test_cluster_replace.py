"""A node replaced as an operator replaces one (issue 33, S5): kill -9, and a new daemon with
an empty disk takes its place, on the same address with the same node name or on a new address
with a new name, under a byte-verified load (tests/cluster/replace_run.py). The client's view
never falls under its floor (max(replicas, majority) = 2 of 3), no byte is wrong, every read of
a block that still has a copy hits, every write once the new node is in the view gets both
copies, and repair back-fills the new node until every block has 2 copies again. Real daemons
and etcd, in network namespaces where root, loopback otherwise. Deadlines are generous bounds
for a loaded host (each read 5 s, each write 10 s), never measurements: the hit rate per
second against the baseline is bench/replace.py's."""

from __future__ import annotations

import pytest
from cluster.cluster_etcd import etcd_missing
from cluster.cluster_netns import cannot_make_namespaces
from cluster.replace_run import Replace

pytestmark = pytest.mark.heavy


@pytest.mark.timeout(420)
@pytest.mark.parametrize("new_id", [False, True], ids=["same-id", "new-id"])
async def test_replaced_node_keeps_the_view_the_hits_and_both_copies(tmp_path, new_id):
    if etcd_missing():
        pytest.skip(etcd_missing())
    run = Replace(tmp_path, use_netns=not cannot_make_namespaces(), new_id=new_id, preload=512, nbytes=16384)
    try:
        run.start()
        r = await run.run(
            baseline_s=3.0, after_s=6.0, settle_s=120.0, read_deadline_s=5.0, write_deadline_s=10.0
        )
    finally:
        run.close()
    line = f"{r.line()}; counters {r.counters}"
    print(line)
    after_kill = sum(s.reads_held for s in r.seconds.values())
    # the load ran on both sides of the replacement, and the replacement joined the view
    assert r.baseline_reads > 0 and after_kill > 50 and r.writes_after_back > 50, line
    assert r.back_after_s is not None, line
    assert r.wrong == 0, line
    assert r.min_view >= 2, line  # the floor: the view never collapsed
    assert r.misses_held == 0, line  # every block with a surviving copy was found
    assert r.single_copy_after_back == 0, line
    assert r.under_2_after_settle == 0, line  # repair back-filled the new node
