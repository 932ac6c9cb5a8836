"""EXISTS and DELETE answer another tenant's key exactly as an absent one, in content and in
time (issue 34, finding 3), against a real daemon: beta asks about alpha's keys (in DRAM and
on disk) and absent ones, interleaved, many times; the two latency distributions cannot be
told apart (AUC near 0.5). Before: a foreign DRAM key stopped at the DRAM tier while an
absent one probed the disk too (AUC 0.18-0.38)."""

from __future__ import annotations

import bisect
import time

import pytest
from daemonutil import RawPeer

from kvstore.client.config import ClientConfig
from kvstore.client.node import NodeClient
from kvstore.results import Status

TOK_A, TOK_B = "tok-tenant-a1", "tok-tenant-b1"
TRIES = 600


def auc(xs: list[float], ys: list[float]) -> float:
    """P(x > y) over all pairs (ties half): 0.5 when the two cannot be told apart."""
    ys = sorted(ys)
    n = 0.0
    for x in xs:
        lo, hi = bisect.bisect_left(ys, x), bisect.bisect_right(ys, x)
        n += lo + 0.5 * (hi - lo)
    return n / (len(xs) * len(ys))


@pytest.mark.parametrize("op", ["EXISTS", "DELETE"])
async def test_a_foreign_key_answers_as_an_absent_one_in_time(authed_daemon, ns, blocks_of, op):
    d = authed_daemon({TOK_A: "alpha", TOK_B: "beta"})
    a = NodeClient(d.addr, ClientConfig(token=TOK_A, namespaces=(ns,), op_timeout_s=30, probe_interval_s=60))
    blocks = blocks_of(ns.with_tenant("alpha"), 64, 1024, seed=3)
    assert [r.status for r in await a.put(blocks)] == [Status.STORED] * 64
    assert (await a.lookup([h.key for h, _ in blocks])).names() == ["dram"] * 64
    b = RawPeer(d.data_port)
    b.hello(TOK_B, ns)
    foreign, absent = [], []
    for i in range(TRIES):
        h, _ = blocks[i % 64]
        pair = ((h.key.raw, foreign), (bytes([i % 251, 9]) * 8, absent))
        for key, out in pair if i % 2 else pair[::-1]:  # either first: no order effect
            t0 = time.perf_counter()
            b.request({"op": op, "keys": key})
            rep = b.reply()
            out.append(time.perf_counter() - t0)
            assert rep.get("ok") and rep["tiers" if op == "EXISTS" else "res"] == b"\x00", rep
    b.close()
    got = auc(foreign[50:], absent[50:])  # past the warm-up
    # 0.5 when they cannot be told apart; measured 0.50-0.57 now, 0.03-0.21 before (loaded host)
    assert 0.35 < got < 0.65, got
    assert (await a.lookup([h.key for h, _ in blocks])).names() == ["dram"] * 64  # nothing of alpha's touched
    await a.close()
