"""``kvstore.client.open``: the store client behind the connector, for each URL scheme.

``local://``: a real in-process node under tmp_path (DRAM + LMDB); the one read leases and
lends (``get_into``, a function over it, copies out before the release), writes reserve, copy,
commit, so no lease or reservation is left behind. ``kvstore://``: a real daemon. Every store
client has one read and one lookup. Bad URLs and options are ConfigErrors naming them."""

from __future__ import annotations

import pytest
from storeutil import make_blocks

import kvstore.client
from connector.backends import Backend
from kvstore.client import ConfigError, Expect, PutReport, Status, StoreClient, get_into
from kvstore.client.cluster import ClusterClient
from kvstore.client.local import LocalClient
from kvstore.client.node import NodeClient
from kvstore.keys import Namespace

NS = Namespace("facade-test", "uint8", 4)


def held(client) -> tuple[int, int]:
    """The node's live leases and reservations."""
    n = client.node.inspector.stats()["node"]
    return n["leases_active"], n["reservations_active"]


async def test_local_store_reads_and_writes_through_the_nodes_two_phase_sequences(tmp_path):
    c = kvstore.client.open(f"local://{tmp_path}/s", dram_capacity="64MiB", disk_capacity=1 << 26)
    assert isinstance(c, StoreClient) and c.in_process and c.node is None
    await c.start(5.0)
    assert c.node is not None
    blocks = make_blocks(6, 4096, seed=1, ns=NS)
    report = await c.put(blocks, 5.0)
    assert isinstance(report, PutReport) and len(report) == 6
    assert [r.status for r in report] == [Status.STORED] * 6
    assert (report.stored, report.dropped, report.under_replicated) == (6, 0, 0)
    assert [r.status for r in await c.put(blocks[:2])] == [Status.EXISTS] * 2
    assert held(c) == (0, 0)
    keys = [h.key for h, _ in blocks]
    assert (await c.lookup(keys)).names() == ["dram"] * 6
    bufs = [bytearray(4096) for _ in blocks]
    got = await get_into(c, keys, bufs, [Expect(h.parent, None) for h, _ in blocks])
    assert [g.status for g in got] == [Status.HIT] * 6 and [g.tier for g in got] == ["dram"] * 6
    assert bufs == [bytearray(p) for _, p in blocks]
    assert held(c) == (0, 0)  # every lease released
    # a wrong expectation, a short buffer and an absent key: per-key results, nothing held
    other = make_blocks(1, 4096, seed=2, ns=NS)[0][0].key
    res = await get_into(
        c,
        [keys[0], keys[1], other],
        [bytearray(4096), bytearray(100), bytearray(4096)],
        [Expect(other, None), None, None],
    )
    assert [r.status for r in res] == [Status.MISMATCH, Status.BUF_TOO_SMALL, Status.MISS]
    assert held(c) == (0, 0)
    assert c.counters["hits"] == 6 and c.counters["misses"] == 3 and c.counters["stored"] == 8
    # the one read lends the slots in place (zero copy) until it is released
    bufs = [bytearray(4096) for _ in range(2)]
    async with c.read(keys[:2], bufs, [Expect(None, None)] * 2, 5.0) as r:
        assert [x.status for x in r.results] == [Status.HIT] * 2 and bytes(r.views[0]) == blocks[0][1]
        assert r.lent == [True, True] and bufs == [bytearray(4096)] * 2  # lent: nothing copied
        assert held(c) == (2, 0)
    assert held(c) == (0, 0)
    r = await c.read(keys[:1], [bytearray(4096)])  # awaited: the caller releases
    assert held(c) == (1, 0)
    r.release()
    r.release()  # idempotent
    assert held(c) == (0, 0)
    with pytest.raises(ValueError, match="read: 2 keys but 1 buffers"):
        c.read(keys[:2], [bytearray(4096)])
    with pytest.raises(ValueError, match="read: 1 keys but 1 buffers and 2 expectations"):
        await get_into(c, keys[:1], [bytearray(4096)], [None, None])
    assert await c.delete(keys[:1]) == [True]
    assert (await c.lookup(keys[:1])).names() == [None]
    assert await c.tenant_namespace(NS) == NS
    assert (await c.stats())["local"]["node"]["name"] == "local"
    with pytest.raises(ValueError, match="payload is 3 bytes"):
        await c.put([(blocks[0][0], b"abc")])
    await c.close()


async def test_local_store_reopens_and_reads_from_disk(tmp_path):
    url = f"local://{tmp_path}/s"
    blocks = make_blocks(3, 4096, seed=3, ns=NS)
    a = kvstore.client.open(url, dram_capacity=1 << 26)
    assert (await a.put(blocks)).stored == 3
    await a.close()
    b = kvstore.client.open(url, dram_capacity=1 << 26)
    keys = [h.key for h, _ in blocks]
    assert (await b.lookup(keys)).names() == ["disk"] * 3
    bufs = [bytearray(4096) for _ in blocks]
    async with b.read(keys, bufs, [Expect()] * 3, 5.0) as r:  # disk: read into the caller's buffers
        assert [x.status for x in r.results] == [Status.HIT] * 3 and r.lent == [False] * 3
        assert [bytes(v) for v in r.views] == [p for _, p in blocks] == [bytes(x) for x in bufs]
    bufs = [bytearray(4096) for _ in blocks]
    assert [g.status for g in await get_into(b, keys, bufs)] == [Status.HIT] * 3
    assert bufs == [bytearray(p) for _, p in blocks] and held(b) == (0, 0)
    await b.close()


async def test_daemons_through_the_facade_with_options_in_the_query(start_daemon, tmp_path):
    d = start_daemon(use_disk=False)
    token = tmp_path / "token"
    token.write_text("\n")  # an empty token file is refused, naming it
    with pytest.raises(ConfigError, match="token_file .* is empty"):
        kvstore.client.open(f"kvstore://{d.addr}", token_file=str(token))
    c = kvstore.client.open(
        f"kvstore://{d.addr}?replicas=1&transport=tcp&op_timeout_s=3", namespaces=(NS,), pool_size=2
    )
    assert isinstance(c, StoreClient) and not c.in_process
    assert (c.cfg.replicas, c.client_cfg.transport, c.client_cfg.op_timeout_s) == (1, "tcp", 3.0)
    await c.start(5.0)
    blocks = make_blocks(4, 4096, seed=5, ns=NS)
    report = await c.put(blocks, 5.0)
    assert (report.stored, report.copies, report.wanted) == (4, [1] * 4, 1)
    keys = [h.key for h, _ in blocks]
    assert (await c.lookup(keys, 5.0)).names() == ["dram"] * 4
    absent = [h.key for h, _ in make_blocks(2, 4096, seed=6, ns=NS)]
    found = await c.lookup(keys + absent[:1] + keys[:1], 5.0)  # codes: 2 dram, 0 absent
    assert (found.tiers, found.hit_blocks, len(found.keys)) == (bytes([2, 2, 2, 2, 0, 2]), 4, 6)
    bufs = [bytearray(4096) for _ in blocks]
    assert [g.status for g in await get_into(c, keys, bufs, None, 5.0)] == [Status.HIT] * 4
    assert bufs == [bytearray(p) for _, p in blocks]
    # the one read fills the caller's buffers: the views are theirs, nothing is lent
    bufs = [bytearray(4096) for _ in range(6)]
    async with c.read(keys + absent, bufs, None, 5.0) as r:
        assert [x.status for x in r.results] == [Status.HIT] * 4 + [Status.MISS] * 2
        assert r.lent == [False] * 6 and r.views[4:] == [None, None]
        assert [bytes(v) for v in r.views[:4]] == [p for _, p in blocks[:4]] == [bytes(x) for x in bufs[:4]]
    with pytest.raises(ValueError, match="read: 4 keys but 5 buffers and no expectations"):
        c.read(keys, bufs[:5])
    assert await c.tenant_namespace(NS, 5.0) == NS  # no auth: unsalted
    stats = await c.stats(5.0)
    assert list(stats) == [d.addr] and stats[d.addr]["node"]["puts"] == 4
    await c.close()


def test_every_store_client_has_one_read_and_one_lookup():
    """``read`` and ``lookup`` on the protocol and on every client; no second read, lookup or
    delete (``get_into`` is a function over ``read``; tier names come from the lookup's result)."""
    for cls in (StoreClient, LocalClient, ClusterClient, NodeClient, Backend):
        verbs = {n for n in dir(cls) if not n.startswith("_")}
        assert {"read", "lookup"} <= verbs, cls
        assert not verbs & {
            "get_into",
            "exists",
            "exists_codes",
            "lookup_prefix",
            "put_report",
            "delete_packed",
        }, cls


async def test_the_store_that_holds_nothing_misses_through_the_same_read_and_lookup():
    b = Backend()
    keys = [h.key for h, _ in make_blocks(3, 64, seed=7, ns=NS)]
    found = await b.lookup(keys)
    assert (found.tiers, found.hit_blocks, found.names()) == (bytes(3), 0, [None] * 3)
    assert [g.status for g in await get_into(b, keys, [bytearray(64)] * 3)] == [Status.MISS] * 3
    with pytest.raises(ValueError, match="read: 2 keys but 1 buffers"):
        b.read(keys[:2], [bytearray(64)])


@pytest.mark.parametrize(
    "url, options, says",
    [
        ("redis://h:1", {}, "scheme must be one of local, kvstore, etcd"),
        ("kvstore://", {}, "missing host:port"),
        ("local://", {}, "missing PATH"),
        ("kvstore://127.0.0.1:0", {}, "port"),
        ("kvstore://127.0.0.1:7000?replica=2", {}, "unknown option 'replica'"),
        ("kvstore://127.0.0.1:7000", {"replicas": "two"}, "replicas: expected an integer, got 'two'"),
        ("kvstore://127.0.0.1:7000", {"replicas": 0}, "replicas must be >= 1"),
        ("kvstore://127.0.0.1:7000", {"descriptors": "sometimes"}, "descriptors: expected auto or always"),
        ("local:///tmp/x", {"replicas": 2}, "unknown option 'replicas' for local://"),
        ("local:///tmp/x?disk_sync=maybe", {}, "disk_sync: expected true or false, got 'maybe'"),
        ("local:///tmp/x?dram_capacity=lots", {}, "dram_capacity"),
        ("etcd://127.0.0.1:2379", {}, "CLUSTER"),
        ("local:///tmp/x", {"dram_capacity": "1MiB"}, "dram.capacity"),
    ],
)
def test_bad_urls_and_options_are_config_errors_naming_them(url, options, says):
    with pytest.raises(ConfigError, match=says) as info:
        kvstore.client.open(url, **options)
    assert repr(url) in str(info.value) or url in str(info.value)
