"""The data port under denial-of-service (issue 22), each against a real daemon: no cheap way to
take the node from everyone, with a tenant token or without one, and no work done on another
tenant's block. Memory is the daemon's VmRSS; timing is a distribution over many tries in the
same run (a median ratio or an AUC with a generous margin), never an absolute time."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from daemonutil import RawPeer, frame
from storeutil import remade

from kvstore import protocol as P
from kvstore.client.config import ClientConfig
from kvstore.client.node import NodeClient
from kvstore.client.read import get_into
from kvstore.results import Status

TOK_A, TOK_B = "tok-tenant-a1", "tok-tenant-b1"
MiB = 1 << 20


@pytest.fixture
def tenants(authed_daemon):
    """Tenants alpha (TOK_A) and beta (TOK_B); salts are tenant names (no secret file)."""

    def start(use_disk: bool = True, workdir=None, **sections):
        tokens = {TOK_A: "alpha", TOK_B: "beta", "tok-operator1": "*"}
        return authed_daemon(tokens, use_disk, workdir=workdir, **sections)

    return start


def client(d, ns, token=TOK_A) -> NodeClient:
    return NodeClient(
        d.addr, ClientConfig(token=token, namespaces=(ns,), op_timeout_s=20, probe_interval_s=60)
    )


def rss(d) -> int:
    with open(f"/proc/{d.proc.pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def peak_rss(d, settle_s: float = 3.0) -> int:
    """The daemon's largest RSS over ``settle_s`` (the headers sent are read meanwhile)."""
    top, end = 0, time.monotonic() + settle_s
    while time.monotonic() < end:
        top = max(top, rss(d))
        time.sleep(0.1)
    return top


def auc(xs: list[float], ys: list[float]) -> float:
    """P(x > y) over all pairs (ties half): 0.5 when the two cannot be told apart."""
    n = sum((x > y) + 0.5 * (x == y) for x in xs for y in ys)
    return n / (len(xs) * len(ys))


def authed(d, ns, token=TOK_A, **kw) -> RawPeer:
    p = RawPeer(d.data_port, **kw)
    p.hello(token, ns)
    return p


# ---------------------------------------------------------------- without a token


def test_a_preauth_flood_from_one_address_does_not_lock_out_a_new_client(tenants, ns):
    d = tenants(limits={"max_unauthenticated": 8, "hello_timeout_s": 60.0})
    stop, flood = threading.Event(), []

    def flooder() -> None:  # re-opens connections that never send HELLO, from 127.0.0.2
        while not stop.is_set():
            s = socket.socket()
            s.bind(("127.0.0.2", 0))
            s.connect(("127.0.0.1", d.data_port))
            flood.append(s)
            time.sleep(0.02)

    t = threading.Thread(target=flooder, daemon=True)
    t.start()
    try:
        while len(flood) < 24:
            time.sleep(0.05)
        ok = 0
        for _ in range(20):
            try:
                authed(d, ns, timeout=5).close()
                ok += 1
            except (AssertionError, ConnectionError, OSError):
                pass
        assert ok == 20
    finally:
        stop.set()
        t.join()
        for s in flood:
            s.close()


def test_a_preauth_header_of_empty_maps_is_refused_before_it_is_decoded(tenants):
    d = tenants()
    p = RawPeer(d.data_port)
    p.send(frame({"op": "HELLO", "rid": 0, "v": 1, "token": TOK_A, "ns": [], "pad": [{}] * 60000}))
    rep = p.reply()
    assert rep["code"] == P.TOO_LARGE and "objects" in rep["err"], rep
    assert p.closed_by_peer()


def test_hello_lines_are_rate_limited(tenants, ns):
    d = tenants()
    p = RawPeer(d.data_port)
    for _ in range(300):
        p.hello(TOK_A, ns)
    p.close()
    n = d.logs().count("event=hello ")
    assert 1 <= n <= 20, n


# ---------------------------------------------------------------- with a token


def test_an_authenticated_header_of_empty_maps_is_refused(tenants, ns):
    d = tenants()
    p = authed(d, ns)
    p.request({"op": "EXISTS", "keys": b"", "pad": [{}] * 1_000_000})
    rep = p.reply()
    assert rep["code"] == P.TOO_LARGE and "objects" in rep["err"], rep
    assert p.closed_by_peer()


def test_a_stalled_put_keeps_nothing_of_its_header(tenants, ns, blocks_of):
    """32 PUTs, each behind a ~4 MiB header (4,000 bins of 1,000 bytes in an unknown field),
    each stalled after 1 KiB of its payload: the header is emptied once parsed (before:
    about 4 MiB per connection, 130 MiB in all)."""
    d = tenants(use_disk=False, dram={"capacity": "256MiB", "slab_size": "4MiB"})
    [(h, _)] = blocks_of(ns.with_tenant("alpha"), 1, MiB)
    pad = [bytes([i % 251]) * 1000 for i in range(4000)]
    peers = [authed(d, ns) for _ in range(32)]
    base = rss(d)
    for p in peers:
        p.request({"op": "PUT", "hdrs": [h.encode()], "pad": pad}, plen=h.payload_len)
        p.send(b"x" * 1024)
    grown = peak_rss(d) - base
    assert grown < 48 * MiB, grown / MiB
    for p in peers:
        p.close()


def test_a_discarded_payload_costs_about_the_bytes_sent(tenants, ns):
    """64 EXISTS requests announcing 60 MiB payloads (bad_request: the payload is skipped),
    each stalled after 1 KiB (before: a 1 MiB scratch buffer per connection)."""
    d = tenants(use_disk=False)
    peers = [authed(d, ns) for _ in range(64)]
    base = rss(d)
    for p in peers:
        p.request({"op": "EXISTS", "keys": b""}, plen=60 * MiB)
        p.send(b"x" * 1024)
    grown = peak_rss(d) - base
    assert grown < 24 * MiB, grown / MiB
    for p in peers:
        p.close()


async def test_many_leases_held_by_one_tenant_do_not_slow_another(tenants, ns, blocks_of):
    """Tenant alpha holds 24,576 leases (6 connections x 4,096, within its caps); beta's GET
    median stays within 3x of its median without them (before: every request swept them all)."""
    d = tenants(use_disk=False)
    a, b = client(d, ns, TOK_A), client(d, ns, TOK_B)
    [(ha, pa)] = blocks_of(ns.with_tenant("alpha"), 1, 4096, seed=1)
    [(hb, pb)] = blocks_of(ns.with_tenant("beta"), 1, 4096, seed=2)
    assert [r.status for r in await a.put([(ha, pa)])] == [Status.STORED]
    assert [r.status for r in await b.put([(hb, pb)])] == [Status.STORED]

    async def median_get() -> float:
        ts = []
        for _ in range(300):
            t0 = time.perf_counter()
            await _get(b, hb)
            ts.append(time.perf_counter() - t0)
        ts.sort()
        return ts[len(ts) // 2]

    alone = await median_get()
    holders = []
    for _ in range(6):
        p = authed(d, ns)
        p.request({"op": "LEASE", "keys": ha.key.raw * 4096, "ttl": 300.0})
        rep = p.reply()
        assert len(rep["res"]) == 4096 and all(e[0] == int(Status.HIT) for e in rep["res"])
        holders.append(p)
    beside = await median_get()
    assert beside < 3 * alone, (beside, alone)
    for p in holders:
        p.close()
    await a.close()
    await b.close()


async def _get(c: NodeClient, h):
    [r] = await get_into(c, [h.key], [bytearray(h.payload_len)])
    assert r.status is Status.HIT
    return [r]


async def test_a_reserve_never_written_demotes_nothing(tenants, ns, blocks_of):
    d = tenants(dram={"capacity": "64MiB", "slab_size": "4MiB"})
    b = client(d, ns, TOK_B)
    mine = blocks_of(ns.with_tenant("beta"), 10, 3 * MiB, seed=3)
    assert [r.status for r in await b.put(mine)] == [Status.STORED] * 10
    assert (await b.lookup([h.key for h, _ in mine])).names() == ["dram"] * 10
    attacker = authed(d, ns, TOK_A)
    theirs = blocks_of(ns.with_tenant("alpha"), 12, 3 * MiB, seed=4)
    attacker.request({"op": "RESERVE", "hdrs": [h.encode() for h, _ in theirs]})
    rep = attacker.reply()
    assert len(rep["res"]) == 12
    assert (await b.lookup([h.key for h, _ in mine])).names() == ["dram"] * 10
    attacker.close()
    await b.close()


async def test_idle_leases_of_disk_only_blocks_pin_at_most_the_tenants_share(tenants, ns, blocks_of):
    limits = {"max_leased_disk_bytes_per_tenant": "8MiB"}
    d = tenants(limits=limits)
    a = client(d, ns)
    blocks = blocks_of(ns.with_tenant("alpha"), 8, 3 * MiB, seed=5)
    assert [r.status for r in await a.put(blocks)] == [Status.STORED] * 8
    await a.close()
    d.stop()
    d = tenants(workdir=d.workdir, limits=limits)  # a restart: every block is on disk only
    peers, hits = [], 0
    for h, _ in blocks:
        p = authed(d, ns)
        p.request({"op": "LEASE", "keys": h.key.raw, "ttl": 300.0})
        hits += p.reply()["res"][0][0] == int(Status.HIT)
        peers.append(p)  # idle, holding its lease
    assert hits == 2  # 2 x 3 MiB within the tenant's 8 MiB, over all its connections
    for p in peers:
        p.close()


# ---------------------------------------------------------------- cross-tenant


async def test_a_foreign_disk_only_block_is_not_read_promoted_or_told_apart(tenants, ns, blocks_of):
    """Beta GETs 300 of alpha's disk-only blocks and 300 absent keys, interleaved: all MISS,
    nothing promoted, and the two latency distributions cannot be told apart (AUC near 0.5;
    before: a disk read and a promotion for each foreign key, AUC ~0.9)."""
    d = tenants()
    a = client(d, ns)
    blocks = blocks_of(ns.with_tenant("alpha"), 300, 64 << 10, seed=6)
    for i in range(0, 300, 100):
        assert [r.status for r in await a.put(blocks[i : i + 100])] == [Status.STORED] * 100
    await a.close()
    d.stop()
    d = tenants(workdir=d.workdir)
    b = authed(d, ns, TOK_B)
    foreign, absent = [], []
    for i, (h, _) in enumerate(blocks):
        for key, out in ((h.key.raw, foreign), (bytes([i % 256, 7]) * 8, absent)):
            t0 = time.perf_counter()
            b.request({"op": "GET", "keys": key})
            rep = b.reply()
            out.append(time.perf_counter() - t0)
            assert rep["st"][0] == int(Status.MISS)
    b.close()
    assert auc(foreign, absent) < 0.75, auc(foreign, absent)
    a = client(d, ns)
    tiers = (await a.lookup([h.key for h, _ in blocks])).names()
    assert tiers.count("disk") == 300
    await a.close()


async def test_a_foreign_block_takes_no_share_of_a_gets_read_budget(tenants, ns, blocks_of):
    """Disk-only blocks (over the DRAM slot size) and a 16 MiB frame: GET [alpha's 10 MiB, own
    9 MiB] answers as GET [absent, own 9 MiB] (before: the foreign block took the budget)."""
    d = tenants(server={"max_frame": "16MiB"}, dram={"capacity": "64MiB", "slab_size": "4MiB"})
    a, b = client(d, ns, TOK_A), client(d, ns, TOK_B)
    [(ha, pa)] = blocks_of(ns.with_tenant("alpha"), 1, 10 * MiB, seed=7)
    [(hb, pb)] = blocks_of(ns.with_tenant("beta"), 1, 9 * MiB, seed=8)
    assert [r.status for r in await a.put([(ha, pa)])] == [Status.STORED]
    assert [r.status for r in await b.put([(hb, pb)])] == [Status.STORED]
    p = authed(d, ns, TOK_B)
    answers = []
    for first in (ha.key.raw, bytes(range(16))):
        p.request({"op": "GET", "keys": first + hb.key.raw})
        rep = p.reply()
        p.exact(rep.get("plen", 0))
        answers.append(list(rep["st"]))
    assert answers == [[int(Status.MISS), int(Status.HIT)]] * 2
    p.close()
    await a.close()
    await b.close()


async def test_a_stalled_get_naming_a_foreign_key_holds_no_lease_on_it(tenants, ns, blocks_of):
    d = tenants(use_disk=False, dram={"capacity": "64MiB", "slab_size": "16MiB"})
    a, b = client(d, ns, TOK_A), client(d, ns, TOK_B)
    [(ha, pa)] = blocks_of(ns.with_tenant("alpha"), 1, 4096, seed=9)
    [(hb, pb)] = blocks_of(ns.with_tenant("beta"), 1, 8 * MiB, seed=10)
    assert [r.status for r in await a.put([(ha, pa)])] == [Status.STORED]
    assert [r.status for r in await b.put([(hb, pb)])] == [Status.STORED]
    stalled = authed(d, ns, TOK_B, rcvbuf=64 << 10)
    stalled.request({"op": "GET", "keys": ha.key.raw + hb.key.raw})
    rep = stalled.reply()  # the reply's header; its 8 MiB payload then stalls
    assert list(rep["st"]) == [int(Status.MISS), int(Status.HIT)]
    assert await a.delete([ha.key]) == [True]
    # a key deleted while leased stays held (a PUT of it is BUSY) until its last release
    assert [r.status for r in await a.put([(ha, pa)])] == [Status.STORED]
    stalled.close()
    await a.close()
    await b.close()


async def test_a_reserve_of_a_key_another_tenant_holds_answers_busy_like_put(tenants, ns, blocks_of):
    """Beta derives alpha's second key from alpha's first key and tokens (what an on-path
    observer has): RESERVE and PUT of it both answer BUSY, never EXISTS."""
    d = tenants()
    a, b = client(d, ns, TOK_A), client(d, ns, TOK_B)
    chain = blocks_of(ns.with_tenant("alpha"), 2, 4096, seed=11)
    assert [r.status for r in await a.put(chain)] == [Status.STORED] * 2
    (h0, _), (h1, p1) = chain
    beta = ns.with_tenant("beta")
    assert beta.next_key(h0.key, h1.tokens) == h1.key
    forged = remade(h1, p1, namespace=beta.id)
    p = authed(d, ns, TOK_B)
    p.request({"op": "RESERVE", "hdrs": [forged.encode()]})
    assert p.reply()["res"][0][0] == int(Status.BUSY)
    assert [r.status for r in await b.put([(forged, p1)])] == [Status.BUSY]
    p.close()
    await a.close()
    await b.close()
