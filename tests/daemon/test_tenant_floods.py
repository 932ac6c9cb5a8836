"""A namespace flood costs only its tenant (issue 34, finding 6), against a real daemon: one
tenant re-HELLOs on one connection and stores one block in each of thousands of fresh
namespaces. Another tenant's EXISTS does the same work as before (timing: the medians of many
tries before and after, in the same run), and /metrics and /v1/stats stay bounded in size
(per tenant, the top namespaces, the rest summed)."""

from __future__ import annotations

import statistics
import time
import urllib.request

import pytest
from daemonutil import RawPeer, frame

from kvstore import protocol as P
from kvstore.keys import Namespace

TOK_A, TOK_B, TOK_OP = "tok-tenant-a1", "tok-tenant-b1", "tok-operator1"
FLOOD = 6400  # namespaces, 64 per HELLO


@pytest.fixture
def flooded(authed_daemon, ns, blocks_of):
    d = authed_daemon(
        {TOK_A: "alpha", TOK_B: "beta", TOK_OP: "*"},
        use_disk=False,
        limits={"max_namespaces_per_tenant": FLOOD + 64},
        dram={"capacity": "64MiB", "slab_size": "1MiB"},
    )

    def flood() -> None:
        p = RawPeer(d.data_port, timeout=60)
        for first in range(0, FLOOD, 64):
            nss = [Namespace(f"flood-{i}", "uint8", 4) for i in range(first, first + 64)]
            p.send(frame({"op": "HELLO", "rid": 0, "v": P.PROTOCOL_VERSION, "token": TOK_B,
                          "ns": [P.namespace_to_wire(n) for n in nss]}))  # fmt: skip
            assert p.reply().get("ok")
            batch = [blocks_of(n.with_tenant("beta"), 1, 64, seed=i)[0] for i, n in enumerate(nss)]
            p.request(
                {"op": "PUT", "hdrs": [h.encode() for h, _ in batch]}, plen=sum(len(x) for _, x in batch)
            )
            p.send(b"".join(x for _, x in batch))
            rep = p.reply()
            assert rep.get("ok"), rep
        p.close()

    return d, flood


def exists_times(p: RawPeer, keys: bytes, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        p.request({"op": "EXISTS", "keys": keys})
        rep = p.reply()
        out.append(time.perf_counter() - t0)
        assert rep.get("ok"), rep
    return out


def scrape(d, path: str) -> bytes:
    req = urllib.request.Request(d.admin + path, headers={"Authorization": f"Bearer {TOK_OP}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.read()


def test_a_namespace_flood_does_not_slow_another_tenants_exists(flooded, ns, blocks_of):
    """Before: every EXISTS asked the session about each namespace the tier held (6,400 calls):
    alpha's median went up several times. Now: its own namespaces only."""
    d, flood = flooded
    a = RawPeer(d.data_port)
    a.hello(TOK_A, ns)
    mine = blocks_of(ns.with_tenant("alpha"), 8, 64, seed=1)
    a.request({"op": "PUT", "hdrs": [h.encode() for h, _ in mine]}, plen=sum(len(x) for _, x in mine))
    a.send(b"".join(x for _, x in mine))
    assert a.reply().get("ok")
    keys = b"".join(h.key.raw for h, _ in mine) + bytes(range(16))
    exists_times(a, keys, 50)  # warm
    before = exists_times(a, keys, 300)
    m0, s0 = len(scrape(d, "/metrics")), len(scrape(d, "/v1/stats"))
    flood()
    after = exists_times(a, keys, 300)
    again = exists_times(a, keys, 300)  # the load of the flood's own traffic gone
    ratio = min(statistics.median(after), statistics.median(again)) / statistics.median(before)
    assert ratio < 2.0, (ratio, statistics.median(before))
    m1, s1 = len(scrape(d, "/metrics")), len(scrape(d, "/v1/stats"))
    # bounded: top namespaces only (6,400 lines before), whatever the flood
    assert m1 - m0 < 32 << 10, (m0, m1)
    assert s1 - s0 < 32 << 10, (s0, s1)
    a.close()
