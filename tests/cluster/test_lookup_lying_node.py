"""A cluster lookup with one member that lies in its EXISTS replies (a code byte short, or
codes out of range, each claiming every key present): its answer is refused and counted,
its keys read as misses from it, and the lookup answers exactly what the honest members
hold -- no exception to the caller, no hit that no honest node has. Two real daemons on
loopback and a stub peer that speaks just HELLO and EXISTS."""

from __future__ import annotations

import pytest
from storeutil import make_blocks
from stubpeer import frame, serve

from kvstore.client.cluster import ClusterClient, ClusterConfig
from kvstore.client.config import ClientConfig
from kvstore.client.node import NodeClient
from kvstore.keys import Namespace
from kvstore.results import Status

NS = Namespace("lookup-liar-test", "uint8", 4)
FAST = ClientConfig(namespaces=(NS,), op_timeout_s=2.0, connect_timeout_s=1.0, probe_interval_s=60.0)
CFG = ClusterConfig(replicas=2, lookahead=1, probe_interval_s=60.0, outlier_factor=1e6)


async def _liar(lie):
    """HELLO ok; every EXISTS answered ``lie(n)`` for its ``n`` keys. (server, port, asked)."""
    asked: list[int] = []

    def answer(h: dict):
        if h["op"] != "EXISTS":
            return None
        asked.append(len(h["keys"]) // 16)
        return frame({"rid": h["rid"], "ok": True, "tiers": lie(len(h["keys"]) // 16)}), False

    server, port = await serve(answer)
    return server, port, asked


@pytest.mark.parametrize(
    "lie",
    [lambda n: b"\x02" * (n - 1), lambda n: b"\x07" * n],
    ids=["one-code-short", "codes-out-of-range"],
)
async def test_a_lying_member_costs_only_its_own_answers(start_daemon, lie):
    ds = [start_daemon(use_disk=False) for _ in range(2)]
    server, port, asked = await _liar(lie)
    liar = f"127.0.0.1:{port}"
    blocks = make_blocks(40, 256, seed=181, ns=NS)
    stored = blocks[:24]
    for d in ds:  # every stored block on both honest members
        n = NodeClient(d.addr, FAST)
        assert [r.status for r in await n.put(stored)] == [Status.STORED] * len(stored)
        await n.close()
    c = ClusterClient.static([d.addr for d in ds] + [liar], FAST, CFG)
    try:
        await c.start(5.0)
        keys = [h.key for h, _ in blocks]
        got = (await c.lookup(keys, 5.0)).names()
        assert got == ["dram"] * len(stored) + [None] * (len(blocks) - len(stored))
        assert asked, "the liar was asked (it owns or follows some keys)"
        assert c.nodes[liar].counters["errors"] >= 1  # each refused reply counted
    finally:
        await c.close()
        server.close()
