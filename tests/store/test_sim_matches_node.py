"""The trace simulation (bench/trace_sim.py) is the node: a real NodeStore (DRAM over an LMDB
disk, write-through, the default policy) and a simulated node fed the same requests -- EXISTS,
GET of the hit prefix, PUT of the rest, as bench/trace.py's replay does -- hold the same keys
in each tier and the same eviction-order state after every request. bench/trace.py checks the
daemons against the simulation within 1 pp; this is the exact, small version of that check.
Block counts only, no timing."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
from storeutil import tiers_of

from kvstore.block import make_header
from kvstore.keys import BlockKey
from kvstore.node.store import NodeStore
from kvstore.results import Status

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from trace_sim import ChainKeys, SimNode, trace_namespace  # noqa: E402

PAYLOAD = 4096
DRAM_BLOCKS, DISK_BLOCKS = 12, 48
_ORDER_STATS = (
    "probation_blocks",
    "probation_share",
    "ghost_hits",
    "near_misses_probation",
    "near_misses_main",
)


def _requests(n: int, seed: int) -> list[tuple[int, ...]]:
    """``n`` requests of hash ids: each a prefix (at least one block) of one of a few growing
    conversations, some extended by new blocks, some one-off prompts -- reuse at several
    distances, so blocks are evicted from DRAM, promoted back from disk and evicted from disk."""
    rnd = random.Random(seed)
    convs: list[list[int]] = []
    next_id = 0
    out = []
    for _ in range(n):
        if not convs or rnd.random() < 0.25:
            convs.append([])
            if len(convs) > 6:
                convs.pop(0)
        c = rnd.choice(convs)
        grow = rnd.randrange(1, 6)
        c.extend(range(next_id, next_id + grow))
        next_id += grow
        cut = len(c) if rnd.random() < 0.7 else rnd.randrange(1, len(c) + 1)
        out.append(tuple(c[:cut]))
    return out


def _header(ns, key: bytes, parent: bytes, hash_id: int, body: bytes):
    return make_header(
        key=BlockKey(key),
        parent=BlockKey(parent),
        namespace=ns.id,
        tokens=[hash_id],
        dtype="uint8",
        shape=[PAYLOAD],
        payload=body,
        created=0.0,
    )


def _order_stats(stats: dict) -> dict:
    """The order's policy and counters (prefix-lru, DRAM's over a disk, has no near misses)."""
    return {k: stats.get(k) for k in ("policy", *_ORDER_STATS)}


@pytest.mark.parametrize("upper_tiers", ["recency", "policy"])
async def test_the_simulated_node_holds_what_the_node_holds_after_every_request(cfg_factory, upper_tiers):
    """Promotions included: a disk hit moved into DRAM is read there and so touched (it joins
    DRAM's main segment); the simulation once left it on probation and drifted from the node
    at the first promotion (bench/trace.py: the one-node DRAM + disk daemon cell). An older
    request's blocks are written again now and then: a stored block's EXISTS touches it in its
    highest tier on both (three nodes' PUTs do that after a chain was cut). DRAM keeps recency
    above the disk (``upper_tiers``, the default) or runs the policy too, on both."""
    ns = trace_namespace()
    body = bytes(PAYLOAD)
    hlen = len(_header(ns, ns.id.raw, ns.id.raw, 0, body).encode())  # every header here: one length
    cfg = cfg_factory(
        dram__capacity=DRAM_BLOCKS * PAYLOAD,
        dram__slab_size=PAYLOAD,
        disk__capacity=DISK_BLOCKS * (PAYLOAD + hlen),
        eviction__policy="prefix-marginal",
        eviction__upper_tiers=upper_tiers,
    )
    node = await NodeStore.open(cfg)
    sim = SimNode(
        DRAM_BLOCKS, DISK_BLOCKS, "prefix-marginal", cfg.eviction.probation, upper_tiers=upper_tiers
    )
    chain = ChainKeys(ns)
    root = ns.id.raw
    promoted = rewritten = 0
    history: list[tuple[int, ...]] = []
    try:
        for n, hash_ids in enumerate(_requests(300, seed=19)):
            raws = chain.keys(hash_ids)
            keys = [BlockKey(k) for k in raws]
            tiers = tiers_of(node, keys)
            hit = next((i for i, t in enumerate(tiers) if t is None), len(tiers))
            sim_hit = next((i for i, k in enumerate(raws) if not sim.has(k)), len(raws))
            assert hit == sim_hit, f"request {n}: hit prefix {hit} on the node, {sim_hit} simulated"
            if hit:
                got = await node.reader.read(keys[:hit], [bytearray(PAYLOAD) for _ in range(hit)])
                assert [g.status for g in got] == [Status.HIT] * hit, got
            sim.get(raws[:hit])  # one GET, as the node's
            parents = [root, *raws[:-1]]
            blocks = [
                (_header(ns, raws[i], parents[i], hash_ids[i], body), body) for i in range(hit, len(raws))
            ]
            if blocks:
                # a block past the hit prefix may be stored still (its parent went first from
                # the disk while DRAM kept it): EXISTS, on the node as in the simulation
                was = [sim.has(k) for k in raws[hit:]]
                res = await node.writer.put(blocks)
                assert [r.status for r in res] == [Status.EXISTS if w else Status.STORED for w in was], res
            sim.put(list(zip(raws, parents))[hit:])
            if n % 7 == 6:  # an older request's blocks written again: EXISTS touches, as a read
                old_ids = history[-20] if len(history) >= 20 else history[0]
                old_raws = chain.keys(old_ids)
                old_parents = [root, *old_raws[:-1]]
                was = [sim.has(k) for k in old_raws]
                res = await node.writer.put(
                    [(_header(ns, k, p, i, body), body) for k, p, i in zip(old_raws, old_parents, old_ids)]
                )
                want = [Status.EXISTS if w else Status.STORED for w in was]
                assert [r.status for r in res] == want, f"request {n}: the second PUT"
                sim.put(list(zip(old_raws, old_parents)))
                rewritten += sum(was)
            history.append(hash_ids)
            dram, disk = node.stack.top, node.stack.disk
            assert set(dram.keys()) == sim.dram.keys, f"request {n}: DRAM holds other keys"
            assert set(disk.keys()) == sim.disk.keys, f"request {n}: disk holds other keys"
            st = node.inspector.stats()["tiers"]
            assert _order_stats(st["dram"]) == _order_stats(sim.dram.order.stats()), (
                f"request {n}: DRAM order"
            )
            assert _order_stats(st["disk"]) == _order_stats(sim.disk.order.stats()), (
                f"request {n}: disk order"
            )
        promoted = node.state.counters["promotions"]
        disk_evictions = node.inspector.stats()["tiers"]["disk"]["evictions"]
    finally:
        await node.close()
    # the sequence exercises what it is about: promotions, and a disk that evicts
    assert promoted > 10 and disk_evictions > 10 and rewritten > 20, (promoted, disk_evictions, rewritten)
