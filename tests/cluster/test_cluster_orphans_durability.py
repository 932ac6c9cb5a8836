"""The orphan pass never takes a parent for absent on a node it could not reach (issue 33,
finding 1's cascade): a member that stalls (SIGSTOP) until its etcd lease expires leaves the
other members' views, and a pass then ranked the parents it held over the nodes left, asked
them, found nothing and evicted the children -- whole chains gone once the node came back.

Three members over etcd, one copy (replicas 1), no repair: block P (a chain's head) on node B,
its child C on node A, B among the nodes a lookup asks for P. B is stopped past its lease."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import urllib.request

from cluster.cluster_etcd import until_view
from cluster.static_cluster import held, put_to
from polling import until_async, until_grown_async
from scraping import scrape
from storeutil import make_blocks

from kvstore.client.config import ClientConfig
from kvstore.client.etcd_membership import EtcdMembership
from kvstore.client.placement import Node, rank
from kvstore.keys import Namespace

NS = Namespace("orphan-durability", "uint8", 4)
CFG = ClientConfig(namespaces=(NS,), op_timeout_s=5.0, connect_timeout_s=1.0)


def _counter(admin: str, name: str) -> float:
    return scrape(admin).value(f"tierkv_orphans_{name}_total")


async def _held(addr: str, keys) -> list[bool]:
    return await held(addr, keys, CFG)


async def _put(addr: str, blocks) -> None:
    await put_to(addr, blocks, CFG)


async def _passes(admin: str, k: int) -> None:
    await until_grown_async(lambda: _counter(admin, "passes"), k, 60.0, f"{k} orphan passes", interval_s=0.1)


@contextlib.asynccontextmanager
async def _three_members(etcd, start_daemon, name: str, orphans: dict):
    """Three members over etcd (one copy, no repair) and a watch of their view, once it holds
    all three: ``(daemons, view_of)``."""
    url = etcd.url(name)
    member = {
        "cluster": {"join": url, "lease_ttl_s": 2},
        "repair": {"enabled": False, "replicas": 1, "settle_s": 0.2},
        "orphans": orphans,
    }
    ds = [start_daemon(use_disk=False, **member) for _ in range(3)]
    view_of = EtcdMembership(url)
    await view_of.start(5.0)
    try:
        await until_view(view_of, "three members", [d.addr for d in ds])
        yield ds, view_of
    finally:
        await view_of.close()


async def test_a_parent_on_a_member_that_left_the_view_unreachable_keeps_its_child(etcd, start_daemon):
    async with _three_members(etcd, start_daemon, "orphans", {"interval_s": 0.1, "deadline_s": 1.0}) as (
        ds,
        view_of,
    ):
        view = [Node(d.addr) for d in ds]
        p, c = make_blocks(2, 1024, seed=11, ns=NS)
        a = ds[0]
        b = next(d for d in ds[1:] if d.addr in [n.id for n in rank(p[0].key.raw, view, 1)[:2]])
        await _put(b.addr, [p])
        await _put(a.addr, [c])
        await _passes(a.admin, 2)
        assert await _held(a.addr, [c[0].key]) == [True]  # the parent's node answers: kept

        b.signal(signal.SIGSTOP)  # a busy node, not a dead one: past its lease, out of the view
        try:
            await until_view(view_of, "the stalled member out of the view", ok=lambda got: b.addr not in got)
            await _passes(a.admin, 5)  # past repair.settle_s: passes over the view without B
        finally:
            b.signal(signal.SIGCONT)
        assert await _held(a.addr, [c[0].key]) == [True]
        assert await _held(b.addr, [p[0].key]) == [True]
        assert _counter(a.admin, "orphans_dropped") == 0


def _post(admin: str) -> dict:
    req = urllib.request.Request(admin + "/v1/orphans/pass", data=b"{}", method="POST")
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


async def test_a_pass_whose_view_changed_while_it_ran_drops_nothing(etcd, start_daemon):
    """A pass ranks parents over the view it began with; a member that leaves (or joins)
    while it runs may hold them: it drops nothing more (``passes_cut_short``). The pass is held
    in its EXISTS to a stopped member until that member's lease ends (a view change)."""
    orphans = {"interval_s": 3600.0, "deadline_s": 60.0}
    async with _three_members(etcd, start_daemon, "cut-short", orphans) as (ds, view_of):
        view = [Node(d.addr) for d in ds]
        n0, n2 = ds[0], ds[2]

        def asks(key) -> bool:  # n0's pass asks n2 about this parent
            return n2.addr in [n.id for n in rank(key.raw, view, 1)[:2]]

        kept = next(
            c for c in (make_blocks(2, 1024, seed=s, ns=NS) for s in range(100, 300)) if asks(c[0][0].key)
        )
        await _put(n2.addr, [kept[0]])
        await _put(n0.addr, [kept[1]])
        assert _post(n0.admin)["orphans_found"] == 0  # its connection to n2 stays open
        orphans = [make_blocks(2, 1024, seed=s, ns=NS)[1] for s in range(400, 464)]  # parents nowhere
        await _put(n0.addr, orphans)
        n2.signal(signal.SIGSTOP)
        try:
            post = asyncio.get_running_loop().run_in_executor(None, _post, n0.admin)
            await until_view(view_of, "n2 out of the view", ok=lambda got: n2.addr not in got)
        finally:
            n2.signal(signal.SIGCONT)
        got = await post
        assert got["orphans_found"] == 64 and got["orphans_dropped"] == 0 and got["passes_cut_short"] == 1, (
            got
        )
        assert await _held(n0.addr, [h.key for h, _ in orphans]) == [True] * 64
        # they are orphans: a pass over a settled view drops them
        await until_view(view_of, "n2 back", [d.addr for d in ds])
        await until_async(
            lambda: _post(n0.admin)["orphans_dropped"], 60.0, "the orphans dropped", ok=lambda n: n == 64
        )
