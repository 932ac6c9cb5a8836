"""Deepest first (kvstore/node/depth_order.py): a node indexes the blocks of one PUT last run of
consecutive blocks first, so among a request's blocks the deepest run goes first on every node
(with ``lru`` its head, with a prefix-aware order its tail), not the run nearest the chain's
head, which would cut the chain there. Against a real daemon."""

from __future__ import annotations

import pytest
from storeutil import make_blocks

from kvstore.client.config import ClientConfig
from kvstore.client.node import NodeClient
from kvstore.keys import Namespace

NS = Namespace("depth-test", "uint8", 4)
PAYLOAD = 4096


@pytest.mark.parametrize("policy, first_to_go", [("lru", 5), ("prefix-lru", 6)])
async def test_daemon_a_put_of_two_runs_loses_its_deepest_run_first(start_daemon, policy, first_to_go):
    d = start_daemon(
        use_disk=False, dram={"capacity": 16 * PAYLOAD, "slab_size": PAYLOAD}, eviction={"policy": policy}
    )
    chain = make_blocks(7, PAYLOAD, seed=11, ns=NS)
    # one PUT of blocks 2, 3 and 5, 6: two runs, each below a block stored elsewhere (1 and 4)
    batch = [chain[i] for i in (2, 3, 5, 6)]
    keys = {i: chain[i][0].key for i in (2, 3, 5, 6)}
    fillers = make_blocks(32, PAYLOAD, seed=12, ns=NS)
    n = NodeClient(d.addr, ClientConfig(namespaces=(NS,), op_timeout_s=10.0))
    try:
        assert [r.status.ok for r in await n.put(batch, 10.0)] == [True] * 4
        gone: list[int] = []
        for f in fillers:  # one block at a time until the first of the batch is evicted
            assert [r.status.ok for r in await n.put([f], 10.0)] == [True]
            held = (await n.lookup(list(keys.values()), 10.0)).names()
            gone = [i for i, t in zip(keys, held) if t is None]
            if gone:
                break
        assert gone == [first_to_go], (policy, gone)
    finally:
        await n.close()
