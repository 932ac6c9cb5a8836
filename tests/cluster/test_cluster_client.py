"""The replicated cluster client against real daemons on loopback: replica placement, every
byte back, a killed node, and membership through etcd (registration by ``--join``)."""

from __future__ import annotations

import asyncio

import pytest
from cluster.cluster_etcd import until_view
from polling import until_async
from storeutil import make_blocks

from kvstore.client.cluster import ClusterClient, ClusterConfig
from kvstore.client.config import ClientConfig
from kvstore.client.etcd_membership import EtcdMembership
from kvstore.client.membership import Member, Membership
from kvstore.client.node import NodeClient
from kvstore.client.placement import owners
from kvstore.client.read import get_into
from kvstore.keys import Namespace
from kvstore.results import Status

NS = Namespace("cluster-test", "uint8", 4)
FAST = ClientConfig(namespaces=(NS,), op_timeout_s=1.0, connect_timeout_s=0.5, probe_interval_s=0.1)
CFG = ClusterConfig(replicas=2, probe_interval_s=0.1)
NBYTES = 32 * 1024


async def read_all(client, blocks, deadline_s=2.0):
    bufs = [bytearray(NBYTES) for _ in blocks]
    res = await get_into(client, [h.key for h, _ in blocks], bufs, None, deadline_s)
    ok = sum(r.status is Status.HIT and bytes(b) == p for r, b, (_, p) in zip(res, bufs, blocks))
    return ok, res


async def holders(addrs, key):
    out = []
    for a in addrs:
        n = NodeClient(a, FAST)
        if ((await n.lookup([key])).names())[0] is not None:
            out.append(a)
        await n.close()
    return out


async def test_cluster_replicas_land_on_their_owners_and_read_back(start_daemon):
    ds = [start_daemon(use_disk=False) for _ in range(3)]
    addrs = [d.addr for d in ds]
    c = ClusterClient.static(addrs, FAST, CFG)
    blocks = make_blocks(40, NBYTES, seed=11, ns=NS)
    res = await c.put(blocks, 5.0)
    assert [r.status for r in res] == [Status.STORED] * len(blocks)
    view = [c._weights[a] for a in sorted(addrs)]
    for h, _ in blocks[:10]:
        assert sorted(await holders(addrs, h.key)) == sorted(n.id for n in owners(h.key.raw, view, 2))
    ok, _ = await read_all(c, blocks)
    assert ok == len(blocks)
    keys = [h.key for h, _ in blocks]
    assert (await c.lookup(keys)).hit_blocks == 40
    other = make_blocks(3, NBYTES, seed=12, ns=NS)
    assert (await c.lookup(keys[:5] + [other[0][0].key] + keys[5:])).hit_blocks == 5
    assert await c.delete(keys[:4]) == [True] * 4
    assert (await c.lookup(keys[:4])).names() == [None] * 4
    await c.close()
    assert ((await c.lookup(keys[4:6])).names()) == [None, None]  # closed: misses, no exceptions


async def test_cluster_kill9_one_node_reads_and_writes_go_on(start_daemon):
    ds = [start_daemon(use_disk=False) for _ in range(3)]
    c = ClusterClient.static([d.addr for d in ds], FAST, CFG)
    blocks = make_blocks(60, NBYTES, seed=21, ns=NS)
    assert [r.status.ok for r in await c.put(blocks, 5.0)] == [True] * len(blocks)
    ds[0].kill9()
    ok, _ = await read_all(c, blocks)
    assert ok == len(blocks)  # every block had a second replica
    assert ds[0].addr not in c.live_addrs()
    new = make_blocks(30, NBYTES, seed=22, ns=NS)
    assert [r.status.ok for r in await c.put(new, 5.0)] == [True] * len(new)
    for h, _ in new[:8]:  # two copies on the two survivors
        assert len(await holders([d.addr for d in ds[1:]], h.key)) == 2
    assert (await read_all(c, new))[0] == len(new)
    assert c.counters["marked_down"] >= 1
    await c.close()


async def test_cluster_etcd_join_leave_and_ttl(etcd, start_daemon):
    url = etcd.url("t1")
    m = EtcdMembership(url)
    await m.start()
    assert m.members == ()
    # a's lease is short (it must run out after a kill -9); b's is far longer than any wait
    # below, so b gone within them can only be its revoke, however loaded the host
    a = start_daemon(use_disk=False, cluster={"join": url, "lease_ttl_s": 2}, node={"zone": "z1"})
    b = start_daemon(use_disk=False, cluster={"join": url, "lease_ttl_s": 60}, node={"zone": "z2"})

    await until_view(m, "a and b registered", [a.addr, b.addr], deadline_s=15.0)
    assert {x.zone for x in m.members} == {"z1", "z2"} and all(x.capacity > 0 for x in m.members)
    b.stop()  # SIGTERM revokes the lease: gone long before its 60 s run out
    await until_view(m, "b's record revoked", [a.addr], deadline_s=20.0)
    a.kill9()  # no revoke: gone when the 2 s lease runs out, long before b's would have
    await until_view(m, "a's lease run out", [], deadline_s=10.0)
    await m.close()


async def test_cluster_etcd_client_survives_etcd_restart(etcd, start_daemon):
    url = etcd.url("t2")
    ds = [start_daemon(use_disk=False, cluster={"join": url, "lease_ttl_s": 3}) for _ in range(3)]
    c = ClusterClient.etcd(url, FAST, CFG)

    async def started() -> list[str]:
        await c.start()
        return c.live_addrs()

    await until_async(started, 15.0, "three live members", ok=lambda live: len(live) == 3, interval_s=0.1)
    blocks = make_blocks(30, NBYTES, seed=31, ns=NS)
    assert [r.status.ok for r in await c.put(blocks, 5.0)] == [True] * len(blocks)
    etcd.stop()
    await asyncio.sleep(0.5)
    assert (await read_all(c, blocks))[0] == len(blocks)  # last known membership
    more = make_blocks(10, NBYTES, seed=32, ns=NS)
    assert [r.status.ok for r in await c.put(more, 5.0)] == [True] * len(more)
    etcd.start()
    # past the lease TTL the daemons kept (or renewed) their records; the client lists again
    await until_async(
        lambda: (len(c.live_addrs()), len(c.membership.members)),
        60.0,
        "three members again, all in the view",
        ok=lambda n: n == (3, 3),
    )
    assert (await read_all(c, blocks + more))[0] == len(blocks) + len(more)
    await c.close()
    for d in ds:
        assert d.proc.poll() is None, d.logs()


def test_cluster_join_flag_rejects_a_bad_url(tmp_path):
    import subprocess
    import sys

    cfg = tmp_path / "n.toml"
    cfg.write_text("[disk]\nenabled = false\n")
    r = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "serve", "--config", str(cfg), "--join", "etcd://nohost"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "cluster.join" in r.stderr


@pytest.mark.parametrize("bad", [{"replicas": 0}, {"hedge": 0}, {"lookahead": -1}])
def test_cluster_config_names_bad_values(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        ClusterConfig(**bad)


class Settable(Membership):
    """A membership the test changes by hand (what etcd's watch does in production)."""

    def set(self, addrs) -> None:
        self._set([Member(a) for a in addrs])


async def test_cluster_read_repair_keeps_hits_across_two_joins(start_daemon):
    ds = [start_daemon(use_disk=False) for _ in range(4)]
    m = Settable()
    m.set([d.addr for d in ds[:2]])
    c = ClusterClient(m, FAST, ClusterConfig(replicas=1, lookahead=1, probe_interval_s=0.1))
    blocks = make_blocks(120, NBYTES, seed=41, ns=NS)
    assert [r.status.ok for r in await c.put(blocks, 5.0)] == [True] * len(blocks)
    m.set([d.addr for d in ds[:3]])  # about 1/3 of the blocks now belong to node 3
    assert (await read_all(c, blocks))[0] == len(blocks)  # found one rank further
    await until_async(lambda: c.repairer.in_flight, 15.0, "the read repairs done", ok=lambda n: not n)
    assert 20 < c.counters["repaired"] < 70, c.counters
    m.set([d.addr for d in ds])  # a second join: without the repair some blocks would be two ranks away
    assert (await read_all(c, blocks))[0] == len(blocks)
    await c.close()


async def test_cluster_nodes_reregister_when_etcd_loses_its_data(etcd, start_daemon):
    url = etcd.url("t3")
    d = start_daemon(use_disk=False, cluster={"join": url, "lease_ttl_s": 2})
    m = EtcdMembership(url)
    await m.start()
    await until_view(m, "the node registered", [d.addr], deadline_s=15.0)
    etcd.stop()
    import shutil

    shutil.rmtree(etcd.workdir / "etcd-data")  # a new, empty etcd: the lease is gone
    etcd.start()
    assert [x.addr for x in m.members] == [d.addr]  # the last known view held meanwhile

    async def registered() -> tuple[bool, list[str]]:
        kvs, _ = await m.client.range_prefix(m.target.prefix)
        return bool(kvs), [x.addr for x in m.members]

    # the watcher re-lists the empty store, the node's keepalive finds no lease and re-registers
    await until_async(
        registered, 15.0, "the node registered again", ok=lambda got: got == (True, [d.addr]), interval_s=0.2
    )
    await m.close()


async def test_cluster_idle_watch_is_renewed_and_still_sees_joins(etcd, start_daemon):
    url = etcd.url("t4")
    m = EtcdMembership(url, watch_idle_s=0.3)
    await m.start()
    # nothing happens: the watch is reopened after a fresh list, again and again
    await until_async(lambda: m.counters["watch_renewals"], 30.0, "two watch renewals", ok=lambda n: n >= 2)
    assert m.counters["etcd_errors"] == 0
    d = start_daemon(use_disk=False, cluster={"join": url, "lease_ttl_s": 2})
    await until_view(m, "the node registered", [d.addr], deadline_s=15.0)
    await m.close()


# ---------------------------------------------------------------- lookups ask owners only


async def test_cluster_lookup_asks_each_node_only_about_the_keys_it_owns(start_daemon):
    """3 nodes, 2 replicas, 1 lookahead: a lookup whose blocks are all on their owners asks
    each node only about its own keys (2 of 3 nodes per key, not all 3); a key no owner holds
    goes on to its third node, which finds a copy placed there alone; the answers are the same."""
    ds = [start_daemon(use_disk=False) for _ in range(3)]
    addrs = [d.addr for d in ds]
    # no latency ejections: the view (and so each key's owners) stays the same on a busy host
    cc = ClusterConfig(replicas=2, lookahead=1, probe_interval_s=0.1, outlier_factor=1e6)
    c = ClusterClient.static(addrs, FAST, cc)
    await c.start(5.0)
    blocks = make_blocks(30, NBYTES, seed=51, ns=NS)
    assert [r.status.ok for r in await c.put(blocks, 5.0)] == [True] * len(blocks)
    keys = [h.key for h, _ in blocks]
    view = [c._weights[a] for a in sorted(addrs)]
    before = {a: c.nodes[a].counters["exists_keys"] for a in addrs}
    assert (await c.lookup(keys, 5.0)).names() == ["dram"] * len(keys)
    asked = {a: c.nodes[a].counters["exists_keys"] - before[a] for a in addrs}
    owned = {a: sum(a in {n.id for n in owners(k.raw, view, 2)} for k in keys) for a in addrs}
    assert asked == owned and sum(asked.values()) == 2 * len(keys)
    assert c.counters["lookup_keys_asked"] == 2 * len(keys)

    # a block stored on its third-ranked node only (its owners changed): found one round later
    (h, p) = make_blocks(1, NBYTES, seed=52, ns=NS)[0]
    third = rank_of(h.key, view)[2]
    n = NodeClient(third, FAST)
    assert (await n.put([(h, p)]))[0].status is Status.STORED
    await n.close()
    missing = make_blocks(1, NBYTES, seed=53, ns=NS)[0][0].key
    before = {a: c.nodes[a].counters["exists_keys"] for a in addrs}
    assert (await c.lookup([keys[0], h.key, missing], 5.0)).names() == ["dram", "dram", None]
    asked = {a: c.nodes[a].counters["exists_keys"] - before[a] for a in addrs}
    assert sum(asked.values()) == 2 * 3 + 2  # owners of all three, then the third node of two
    assert (await c.lookup([keys[0], h.key, missing, keys[1]], 5.0)).hit_blocks == 2
    await c.close()


def rank_of(key, view) -> list[str]:
    from kvstore.client.placement import rank

    return [n.id for n in rank(key.raw, view, 2)]


# ---------------------------------------------------------------- one read path, one write path


async def test_cluster_node_clients_share_one_rdma_state_and_no_device_is_probed_per_node(start_daemon):
    from rdma.verbs import device_available

    ds = [start_daemon(use_disk=False) for _ in range(3)]
    c = ClusterClient.static([d.addr for d in ds], FAST, CFG)
    await c.start(5.0)
    assert len(c.nodes) == 3 and all(n.rdma is c.rdma for n in c.nodes.values())
    if not device_available():  # auto without a device: no device, no queue pair offered
        assert c.rdma.device is None and c.rdma.offer() is None
        assert not any(n.one_sided for n in c.nodes.values())
    await c.close()


async def ops(d, op: str) -> float:
    """The daemon's count of successful ``op`` requests (its /metrics)."""
    import re

    import aiohttp

    async with aiohttp.ClientSession() as s, s.get(f"{d.admin}/metrics") as r:
        text = await r.text()
    m = re.search(rf'^tierkv_ops_total{{op="{op}",result="ok"}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


async def test_node_client_get_into_and_put_take_the_descriptor_path_when_configured(start_daemon):
    """Moved from tests/daemon/test_rdma_wiring.py (it called put_reserved/get_into_leased):
    registered staging buffers, ``descriptors = "always"`` without a device, so RESERVE/COMMIT
    and LEASE/RELEASE run with the bytes over TCP; every byte back, nothing counted failed."""
    import numpy as np

    d = start_daemon(use_disk=False)
    c = NodeClient(d.addr, ClientConfig(namespaces=(NS,), descriptors="always"))
    staging = np.zeros((4, 5000), np.uint8)
    c.register(staging)
    blocks = make_blocks(4, 5000, seed=3, ns=NS)
    for i, (_, p) in enumerate(blocks):
        staging[i] = np.frombuffer(p, np.uint8)
    res = await c.put([(h, staging[i]) for i, (h, _) in enumerate(blocks)])
    assert [r.status for r in res] == [Status.STORED] * 4
    out = np.zeros((4, 5000), np.uint8)
    got = await get_into(c, [h.key for h, _ in blocks], list(out))
    assert [g.status for g in got] == [Status.HIT] * 4
    assert all(out[i].tobytes() == p for i, (_, p) in enumerate(blocks))
    assert c.counters["rdma_failures"] == 0 and c.counters["hits"] == 4 and c.counters["stored"] == 4
    assert await ops(d, "RESERVE") == 1 and await ops(d, "COMMIT") == 1
    assert await ops(d, "LEASE") == 1 and await ops(d, "RELEASE") == 1
    assert await ops(d, "GET") == 0 and await ops(d, "PUT") == 0
    await c.close()
    # the default (auto) without RDMA: the inline GET and PUT, the same results
    inline = NodeClient(d.addr, ClientConfig(namespaces=(NS,)))
    more = make_blocks(2, 5000, seed=4, ns=NS)
    assert [r.status for r in await inline.put(more)] == [Status.STORED] * 2
    bufs = [bytearray(5000) for _ in more]
    assert [g.status for g in await get_into(inline, [h.key for h, _ in more], bufs)] == [Status.HIT] * 2
    assert bufs == [bytearray(p) for _, p in more]
    assert await ops(d, "GET") == 1 and await ops(d, "PUT") == 1 and await ops(d, "LEASE") == 1
    await inline.close()


async def test_cluster_reads_and_writes_go_through_the_node_clients_one_path(start_daemon):
    """The cluster client's get_into and put are the node clients': with descriptors on, its
    blocks are RESERVEd/COMMITted and LEASEd/RELEASEd, every byte back."""
    ds = [start_daemon(use_disk=False) for _ in range(2)]
    cfg = ClientConfig(namespaces=(NS,), op_timeout_s=5.0, descriptors="always")
    c = ClusterClient.static([d.addr for d in ds], cfg, CFG)
    blocks = make_blocks(12, NBYTES, seed=61, ns=NS)
    report = await c.put(blocks, 5.0)
    assert report.dropped == 0 and report.copies == [2] * 12 and len(report) == 12
    assert (await read_all(c, blocks))[0] == 12
    for d in ds:
        assert await ops(d, "COMMIT") >= 1 and await ops(d, "PUT") == 0
    assert sum([await ops(d, "LEASE") for d in ds]) >= 1 and sum([await ops(d, "GET") for d in ds]) == 0
    await c.close()
