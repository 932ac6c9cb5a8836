"""Repair never infers a delete from silence (issue 33, finding 1): a node pushing its copies to
an owner that dies (kill -9) or stalls (SIGSTOP past the repair's deadline) mid-pass keeps
every copy, and the owner gets them all once it is back.

Before the fix a peer client marked down answered every call MISS, the answer a tombstoned
owner gave, and the repair took it for "deleted there": it deleted its own copy and wrote a
tombstone (256 blocks, the target killed after 16: 144 lost). Two static members, replicas 2:
both own every block. The 256 blocks are single-block chains (no orphan pass can take one),
written to the first node only; its repair pushes them to the second, paced so the pass is
still running when the fault comes."""

from __future__ import annotations

import signal

from cluster.cluster_etcd import free_port
from cluster.static_cluster import held
from polling import until_async, until_grown_async
from scraping import scrape
from storeutil import make_blocks

from kvstore.client.config import ClientConfig
from kvstore.client.node import NodeClient
from kvstore.keys import Namespace
from kvstore.member.peer_sessions import PEER_TENANT
from kvstore.results import Status

NS = Namespace("repair-durability", "uint8", 4)
CFG = ClientConfig(namespaces=(NS,), op_timeout_s=5.0, connect_timeout_s=1.0, probe_interval_s=0.1)
NBYTES = 8 * 1024
N = 256
# 16 blocks (one push) every half second: a pass over 256 takes about 8 s
PACE = {"max_bytes_per_s": 16 * NBYTES * 2, "deadline_s": 1.0, "interval_s": 0.5, "settle_s": 0.0}


def _metric(admin: str, name: str) -> float:
    return scrape(admin).value(name)


async def _held(addr: str, keys) -> int:
    return sum(await held(addr, keys, CFG))


def _blocks():
    return [make_blocks(1, NBYTES, seed=1000 + i, ns=NS)[0] for i in range(N)]


async def _scene(start_daemon, tmp_path):
    """n0 holding the blocks, n1 being pushed to (at least 16 there, far from all)."""
    ports = [free_port() for _ in range(2)]
    addrs = [f"127.0.0.1:{p}" for p in ports]
    member = {"cluster": {"peers": addrs}, "repair": {"replicas": 2, **PACE}}

    def node(i: int):
        return start_daemon(workdir=tmp_path / f"n{i}", server={"data_port": ports[i]}, **member)

    n0 = node(0)  # alone: its peer is not up, its repair pushes nothing yet
    blocks = _blocks()
    c = NodeClient(addrs[0], CFG)
    assert [r.status.ok for r in await c.put(blocks, 30.0)] == [True] * N
    await c.close()
    keys = [h.key for h, _ in blocks]
    n1 = node(1)
    got = await until_async(
        lambda: _held(addrs[1], keys), 60.0, "16 pushed to n1", ok=lambda k: k >= 16, interval_s=0.05
    )
    assert got < N, "the pass ended before the fault: pace it slower"
    return n0, n1, node, addrs, keys


async def _passes_after_now(admin: str, k: int) -> None:
    """Wait until ``k`` more repair passes ended on ``admin``'s node."""
    await until_grown_async(
        lambda: _metric(admin, "tierkv_repair_passes_total"), k, 60.0, f"{k} repair passes", interval_s=0.2
    )


async def test_a_push_target_killed_mid_repair_costs_the_pushing_node_no_copy(start_daemon, tmp_path):
    n0, n1, node, addrs, keys = await _scene(start_daemon, tmp_path)
    n1.kill9()
    await _passes_after_now(n0.admin, 2)  # the pass under way and one more, against a dead owner
    assert await _held(addrs[0], keys) == N
    assert _metric(n0.admin, "tierkv_repair_copies_dropped_deleted_elsewhere_total") == 0
    node(1)  # back with its disk: the repair completes the copies
    await until_async(lambda: _held(addrs[1], keys), 60.0, "every block on n1", ok=lambda k: k == N)
    assert await _held(addrs[0], keys) == N


async def test_a_push_target_stalled_past_the_deadline_costs_the_pushing_node_no_copy(start_daemon, tmp_path):
    n0, n1, _, addrs, keys = await _scene(start_daemon, tmp_path)
    failed = _metric(n0.admin, "tierkv_repair_push_failures_total")
    n1.signal(signal.SIGSTOP)  # a busy node, not a dead one
    try:
        # a push past the deadline (1 s) is the stall the fix is about; then a while longer
        await until_async(
            lambda: _metric(n0.admin, "tierkv_repair_push_failures_total"),
            60.0,
            "a push to the stalled node to fail",
            ok=lambda f: f > failed,
            interval_s=0.2,
        )
        await _passes_after_now(n0.admin, 1)
    finally:
        n1.signal(signal.SIGCONT)
    assert await _held(addrs[0], keys) == N
    await until_async(lambda: _held(addrs[1], keys), 60.0, "every block on n1", ok=lambda k: k == N)
    assert await _held(addrs[0], keys) == N
    assert _metric(n0.admin, "tierkv_repair_copies_dropped_deleted_elsewhere_total") == 0


async def test_a_copy_deleted_elsewhere_is_dropped_on_the_owners_answer_and_the_repair_writes_no_tombstone(
    start_daemon, tmp_path
):
    """The one answer that drops a copy: an owner's DELETED (its tombstone newer than the copy).
    The dropping node keeps no tombstone of its own: it takes the same copy from a peer again."""
    ports = [free_port() for _ in range(2)]
    addrs = [f"127.0.0.1:{p}" for p in ports]
    member = {"cluster": {"peers": addrs}, "repair": {"replicas": 2, **PACE, "max_bytes_per_s": 1 << 30}}

    def node(i: int):
        return start_daemon(workdir=tmp_path / f"n{i}", server={"data_port": ports[i]}, **member)

    ds = [node(0), node(1)]
    blocks = _blocks()[:8]
    keys = [h.key for h, _ in blocks]
    for a in addrs:
        c = NodeClient(a, CFG)
        assert [r.status.ok for r in await c.put(blocks, 30.0)] == [True] * 8
        await c.close()
    ds[1].kill9()
    c = NodeClient(addrs[0], CFG)
    assert await c.delete(keys, 10.0) == [True] * 8  # a client's delete while n1 is away
    await c.close()
    ds[1] = node(1)  # back with its disk, and the deleted copies on it
    await until_async(lambda: _held(addrs[1], keys), 60.0, "n1 to drop its copies", ok=lambda k: k == 0)
    assert _metric(ds[1].admin, "tierkv_repair_copies_dropped_deleted_elsewhere_total") == 8
    assert await _held(addrs[0], keys) == 0
    peer = NodeClient(addrs[1], ClientConfig(tenant=PEER_TENANT, op_timeout_s=5.0))
    deleter = NodeClient(addrs[0], ClientConfig(tenant=PEER_TENANT, op_timeout_s=5.0))
    try:
        assert [r.status for r in await deleter.put(blocks[:1], 10.0)] == [Status.DELETED]
        # n1 dropped its copies without a tombstone: the same copy is a plain write there
        assert [r.status for r in await peer.put(blocks[:1], 10.0)] == [Status.STORED]
    finally:
        await peer.close()
        await deleter.close()


async def test_the_under_replicated_gauge_is_zero_once_the_pass_that_restored_the_copies_ends(
    start_daemon, tmp_path
):
    """Issue 33: the gauge kept the copies a pass found missing until the next pass (one
    ``repair.interval_s`` later), though that pass had restored them."""
    ports = [free_port() for _ in range(2)]
    addrs = [f"127.0.0.1:{p}" for p in ports]
    blocks = _blocks()[:50]
    alone = start_daemon(workdir=tmp_path / "n0", server={"data_port": ports[0]})  # not a member yet
    c = NodeClient(addrs[0], CFG)
    assert [r.status.ok for r in await c.put(blocks, 30.0)] == [True] * 50
    await c.close()
    assert alone.stop() == 0
    member = {"cluster": {"peers": addrs}, "repair": {"replicas": 2, "interval_s": 3600.0, "settle_s": 0.0}}
    start_daemon(workdir=tmp_path / "n1", server={"data_port": ports[1]}, **member)
    n0 = start_daemon(workdir=tmp_path / "n0", server={"data_port": ports[0]}, **member)  # its disk: 50
    await until_async(
        lambda: _metric(n0.admin, "tierkv_repair_copies_pushed_total"),
        60.0,
        "50 pushed",
        ok=lambda k: k == 50,
    )
    assert _metric(n0.admin, "tierkv_repair_copies_missing_total") == 50
    assert _metric(n0.admin, "tierkv_repair_under_replicated") == 0


async def test_a_member_stopped_mid_repair_stops_its_passes_before_its_node(start_daemon, tmp_path):
    """Issue 33: a pass still running when the daemon closed its node read a released
    memoryview (``repair_pass_failed``); the passes now stop first. An unpaced pass of 4,000
    blocks, the daemon stopped while it pushes."""
    ports = [free_port() for _ in range(2)]
    addrs = [f"127.0.0.1:{p}" for p in ports]
    member = {"cluster": {"peers": addrs}, "repair": {"replicas": 2, "interval_s": 0.2, "settle_s": 0.0}}
    blocks = [b for i in range(40) for b in make_blocks(100, NBYTES, seed=5000 + i, ns=NS)]
    n0 = start_daemon(workdir=tmp_path / "n0", server={"data_port": ports[0]}, **member)
    c = NodeClient(addrs[0], CFG)
    for i in range(0, len(blocks), 200):
        assert all(r.status.ok for r in await c.put(blocks[i : i + 200], 30.0))
    await c.close()
    start_daemon(workdir=tmp_path / "n1", server={"data_port": ports[1]}, **member)
    keys = [h.key for h, _ in blocks]
    await until_async(
        lambda: _held(addrs[1], keys), 60.0, "pushes under way", ok=lambda k: k >= 100, interval_s=0.02
    )
    assert n0.stop() == 0
    logs = n0.logs()
    assert "repair_pass_failed" not in logs and "released memoryview" not in logs, logs[-3000:]
    assert "Traceback" not in logs, logs[-3000:]
