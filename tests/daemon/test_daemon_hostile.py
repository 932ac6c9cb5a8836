"""Hostile and stalled clients against a real daemon with two tenants (issue 12): a transfer
owns its slot until its bytes have moved, and a stalled peer costs only its own connection.

The races use a short ``lease_ttl_s`` and a DRAM tier of a few 16 MiB slots, so a slot freed
too early is the very slot the other tenant's block lands in."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from daemonutil import RawPeer
from storeutil import remade

from kvstore.client.config import ClientConfig
from kvstore.client.node import NodeClient
from kvstore.client.read import get_into
from kvstore.results import Status

TOK_A, TOK_B = "tok-tenant-a1", "tok-tenant-b1"
BIG = 16 << 20
TTL = 1.0


def client(d, ns, token, **kw) -> NodeClient:
    cfg = dict(token=token, namespaces=(ns,), op_timeout_s=10, probe_interval_s=60)
    cfg.update(kw)
    return NodeClient(d.addr, ClientConfig(**cfg))


def tenant_ns(d, ns, token):
    """The namespace a tenant's keys live in: the base one salted with what HELLO hands out."""
    p = RawPeer(d.data_port)
    try:
        return ns.with_tenant(p.hello(token, ns)["salt"])
    finally:
        p.close()


async def anchor(a: NodeClient, d, ns, blocks_of) -> None:
    """A small block whose payload shares the header slab: that slab then stays in use, so the
    16 MiB slot freed next is the one the following 16 MiB block is given."""
    [(h, p)] = blocks_of(tenant_ns(d, ns, TOK_A), 1, 200, seed=99)
    assert [r.status for r in await a.put([(h, p)])] == [Status.STORED]


@pytest.fixture
def two_tenants(authed_daemon):
    """Three 16 MiB slots of DRAM (one for headers), no disk, leases of one second."""

    def start(**sections):
        cfg = {"dram": {"capacity": "48MiB", "slab_size": "16MiB"}, "node": {"lease_ttl_s": TTL}}
        for sec, vals in sections.items():
            cfg.setdefault(sec, {}).update(vals)
        return authed_daemon({TOK_A: "alpha", TOK_B: "beta"}, use_disk=False, **cfg)

    return start


async def test_slow_reader_never_reads_another_tenants_bytes(two_tenants, ns, blocks_of):
    d = two_tenants()
    a, b = client(d, ns, TOK_A), client(d, ns, TOK_B)
    [(ha, pa)] = blocks_of(tenant_ns(d, ns, TOK_A), 1, BIG, seed=1)
    [(hb, pb)] = blocks_of(tenant_ns(d, ns, TOK_B), 1, BIG, seed=2)
    await anchor(a, d, ns, blocks_of)
    assert [r.status for r in await a.put([(ha, pa)])] == [Status.STORED]

    reader = RawPeer(d.data_port, rcvbuf=64 << 10)
    reader.hello(TOK_A, ns)
    reader.request({"op": "GET", "keys": ha.key.raw})
    rep = reader.reply()
    assert rep["st"][0] == int(Status.HIT)
    first = reader.exact(64 << 10)  # then A stops reading, well past the lease TTL
    await asyncio.sleep(2.5 * TTL)
    assert await a.delete([ha.key]) == [True]
    await b.put([(hb, pb)])  # may land in the slot A's lease had pinned, if it was freed
    rest = reader.exact(BIG - len(first))
    got = first + rest
    assert got == pa, f"the slow reader got {sum(x != y for x, y in zip(got[::4096], pb[::4096]))} pages of B"
    reader.close()
    await a.close()
    await b.close()


async def test_slow_writer_never_overwrites_another_tenants_block(two_tenants, ns, blocks_of):
    d = two_tenants()
    a, b = client(d, ns, TOK_A), client(d, ns, TOK_B)
    await anchor(a, d, ns, blocks_of)
    [(hw, pw)] = blocks_of(tenant_ns(d, ns, TOK_A), 1, BIG, seed=3)
    [(hb, pb)] = blocks_of(tenant_ns(d, ns, TOK_B), 1, BIG, seed=4)

    writer = RawPeer(d.data_port)
    writer.hello(TOK_A, ns)
    writer.request({"op": "PUT", "hdrs": [hw.encode()]}, plen=BIG)
    writer.send(pw[: 1 << 20])  # then A stops sending, well past the reservation's TTL
    await asyncio.sleep(2.5 * TTL)
    assert [r.status for r in await b.put([(hb, pb)])] == [Status.STORED]
    writer.send(b"\xee" * (BIG - (1 << 20)))  # A resumes with other bytes
    writer.reply()
    buf = bytearray(BIG)
    [got] = await get_into(b, [hb.key], [buf])
    assert got.status is Status.HIT and buf == pb
    writer.close()
    await a.close()
    await b.close()


async def test_stalled_puts_cost_only_their_own_connections(two_tenants, ns, blocks_of):
    """More stalled transfers than any shared copy pool has workers (16 at most): another
    tenant's PUT and GET are still served (within its client's 5 s deadline)."""
    d = two_tenants(dram={"capacity": "256MiB", "slab_size": "4MiB"}, node={"lease_ttl_s": 30.0})
    a_ns = tenant_ns(d, ns, TOK_A)
    stalled = []
    for i in range(17):
        [(h, p)] = blocks_of(a_ns, 1, 2 << 20, seed=100 + i)
        s = RawPeer(d.data_port)
        s.hello(TOK_A, ns)
        s.request({"op": "PUT", "hdrs": [h.encode()]}, plen=len(p))
        s.send(p[: 1 << 20])
        stalled.append(s)
    await asyncio.sleep(0.5)
    b = client(d, ns, TOK_B, op_timeout_s=5)
    [(hb, pb)] = blocks_of(tenant_ns(d, ns, TOK_B), 1, 1 << 20, seed=5)
    assert [r.status for r in await b.put([(hb, pb)])] == [Status.STORED]
    buf = np.zeros(1 << 20, dtype=np.uint8)
    [got] = await get_into(b, [hb.key], [buf])
    assert got.status is Status.HIT and buf.tobytes() == pb
    for s in stalled:
        s.close()
    await b.close()


async def test_a_tenant_cannot_store_under_a_key_it_cannot_derive(two_tenants, ns, blocks_of):
    """With auth, a block's key must follow from its parent and tokens in the writer's own
    namespace: B cannot plant a block of its own under A's key (any 16 bytes it has seen)."""
    d = two_tenants()
    a, b = client(d, ns, TOK_A), client(d, ns, TOK_B)
    [(ha, pa)] = blocks_of(tenant_ns(d, ns, TOK_A), 1, 1000, seed=6)
    [(hb, pb)] = blocks_of(tenant_ns(d, ns, TOK_B), 1, 1000, seed=7)
    planted = remade(hb, pb, key=ha.key)
    assert [r.status for r in await b.put([(planted, pb)])] == [Status.INVALID]
    assert [r.status for r in await b.put([(hb, pb)])] == [Status.STORED]  # its own, derived
    assert [r.status for r in await a.put([(ha, pa)])] == [Status.STORED]  # A's key is still A's
    await a.close()
    await b.close()
