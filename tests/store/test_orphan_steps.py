"""The orphan pass works in bounded steps (kvstore/member/orphans.py): between two turns of
the event loop it handles at most ``orphans.batch_keys`` keys in any stage, however many
blocks the node holds, and it still drops the orphans with their chains. One in-process
node (real DRAM tier) in a static membership of two; the other member is never asked (every
orphan's parent is owned by this node, lookahead 0) or, asked, does not answer (its parents
count as present). Counts only, no timing."""

from __future__ import annotations

import asyncio

from storeutil import make_blocks

from kvstore.client.membership import StaticMembership
from kvstore.client.placement import Node, rank
from kvstore.config import OrphansSection
from kvstore.keys import Namespace
from kvstore.member.orphans import OrphanPass
from kvstore.node.store import NodeStore

ME, OTHER = "127.0.0.1:1", "127.0.0.1:2"  # OTHER: nothing listens there
NS = Namespace("orphan-steps", "uint8", 4)
BATCH = 16


async def test_a_pass_yields_every_batch_of_keys_in_every_stage(cfg_factory):
    node = await NodeStore.open(cfg_factory(disk__enabled=False))
    view = [Node(ME), Node(OTHER)]
    chains, mine = [], 0
    for seed in range(200):  # blocks 1 and 2 of a chain, never its block 0
        c = make_blocks(3, nbytes=64, seed=seed, ns=NS)
        chains.append(c)
        res = await node.writer.put(c[1:])
        assert len(res) == 2 and all(r.status.ok for r in res)
        mine += rank(c[0][0].key.raw, view)[0].id == ME
    assert 20 < mine < 180  # both kinds are there
    op = OrphanPass(
        node, ME, StaticMembership([ME, OTHER]), OrphansSection(batch_keys=BATCH, lookahead=0, deadline_s=0.5),
        replicas=1, settle_s=0.0,
    )  # fmt: skip
    samples: list[tuple[str, int]] = []
    stop = False

    async def watch() -> None:
        while not stop:
            samples.append(op.progress)
            await asyncio.sleep(0)

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        done = await op.sweep()
    finally:
        stop = True
        await watcher
        await op.peers.close()
    try:
        assert done["blocks_checked"] == 400
        assert done["orphans_dropped"] == 2 * mine, done  # block 1 and its child, block 2
        for c in chains:
            kept = rank(c[0][0].key.raw, view)[0].id == OTHER  # its parent's owner did not answer
            assert [h.key.raw in node.tiers[0] for h, _ in c[1:]] == [kept, kept]
        stages = [s for s, _ in samples]
        for stage in ("parents", "remote", "rank", "lost", "chains", "drop"):
            assert stage in stages, (stage, sorted(set(stages)))
        steps = [(a, b) for a, b in zip(samples, samples[1:]) if a[0] == b[0] != "idle"]
        assert len(steps) > 40, len(steps)
        assert max(b[1] - a[1] for a, b in steps) <= BATCH, "a stage ran past a batch between two yields"
        assert op.progress == ("idle", 0)
    finally:
        await node.close()
