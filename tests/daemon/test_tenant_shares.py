"""Shares by tenant, not by namespace (issue 34, finding 1), against a real daemon: a tenant's
bytes are summed over all its namespaces, so writing one block per fresh namespace does not
make it the "newcomer" that may evict anyone; and the namespaces one tenant may hold are
capped (``limits.max_namespaces_per_tenant``), a HELLO past the cap refused with one line."""

from __future__ import annotations

import pytest
from daemonutil import RawPeer
from polling import until

from kvstore.client.config import ClientConfig
from kvstore.client.node import NodeClient
from kvstore.keys import Namespace
from kvstore.results import Status

TOK_A, TOK_B = "tok-tenant-a1", "tok-tenant-b1"
KiB = 1 << 10


@pytest.fixture
def tenants(authed_daemon):
    """Tenants alpha (TOK_A) and beta (TOK_B); salts are tenant names (no secret file)."""

    def start(use_disk: bool = True, **sections):
        return authed_daemon(
            {TOK_A: "alpha", TOK_B: "beta"}, use_disk, eviction={"tenant_share": 0.25}, **sections
        )

    return start


def client(d, token, namespaces) -> NodeClient:
    return NodeClient(
        d.addr, ClientConfig(token=token, namespaces=tuple(namespaces), op_timeout_s=30, probe_interval_s=60)
    )


def fresh(i: int) -> Namespace:
    return Namespace(f"attack-{i}", "uint8", 4)


# DRAM only (8 MiB of 1 MiB slabs) and disk only (16 MiB): alpha's 1 MiB is under its 25 %
# share of either; beta writes 90 blocks of 256 KiB (22.5 MiB), each in a namespace of its own
TIERS = {
    "dram": dict(use_disk=False, dram={"capacity": "8MiB", "slab_size": "1MiB"}),
    "disk": dict(dram={"capacity": 0}, disk={"capacity": "16MiB"}),
}


@pytest.mark.parametrize("tier", sorted(TIERS))
async def test_fresh_namespaces_do_not_evict_another_tenants_share(tenants, ns, blocks_of, tier):
    d = tenants(**TIERS[tier])
    a = client(d, TOK_A, [ns])
    mine = blocks_of(ns.with_tenant("alpha"), 4, 256 * KiB, seed=1)
    assert [r.status for r in await a.put(mine)] == [Status.STORED] * 4
    stored = 0
    for first in (0, 45):
        nss = [fresh(i) for i in range(first, first + 45)]
        b = client(d, TOK_B, nss)
        for i, n in enumerate(nss):
            [blk] = blocks_of(n.with_tenant("beta"), 1, 256 * KiB, seed=100 + first + i)
            stored += [r.status for r in await b.put([blk])] == [Status.STORED]
        await b.close()
    assert stored > 40, stored  # beta's writes went in, evicting its own blocks
    tiers = (await a.lookup([h.key for h, _ in mine])).names()
    assert tiers == [tier] * 4, tiers
    await a.close()


def hello_many(d, token, nss) -> dict:
    p = RawPeer(d.data_port)
    try:
        return p.hello_reply(token, nss)
    finally:
        p.close()


async def test_a_hello_past_the_tenants_namespace_cap_is_refused(tenants, ns, blocks_of):
    """A cap of 8: one HELLO of 9 is refused, naming the limit; 5 namespaces holding blocks
    plus 4 new ones are refused too, across connections; another tenant is not affected; a
    namespace whose blocks are gone and whose connections closed no longer counts."""
    d = tenants(use_disk=False, limits={"max_namespaces_per_tenant": 8})
    rep = hello_many(d, TOK_B, [fresh(i) for i in range(9)])
    assert not rep.get("ok") and "max_namespaces_per_tenant" in rep["err"], rep
    held = [fresh(i) for i in range(5)]
    b = client(d, TOK_B, held)
    blocks = [blocks_of(n.with_tenant("beta"), 1, 4 * KiB, seed=i)[0] for i, n in enumerate(held)]
    assert [r.status for r in await b.put(blocks)] == [Status.STORED] * 5
    await b.close()
    rep = hello_many(d, TOK_B, [fresh(i) for i in range(5, 9)])
    assert not rep.get("ok") and "8 namespaces" in rep["err"], rep
    assert hello_many(d, TOK_B, [fresh(i) for i in range(5, 8)]).get("ok")  # 8 in all: fits
    assert hello_many(d, TOK_A, [fresh(i) for i in range(8)]).get("ok")  # alpha has its own 8
    b = client(d, TOK_B, held)
    assert await b.delete([h.key for h, _ in blocks]) == [True] * 5
    await b.close()
    # once the daemon has seen the connections close, those five namespaces are free
    hello = lambda: hello_many(d, TOK_B, [fresh(i) for i in range(10, 18)])  # noqa: E731
    until(hello, 20, "a HELLO of 8 new namespaces", lambda r: r.get("ok"))
    assert "Traceback" not in d.logs()
