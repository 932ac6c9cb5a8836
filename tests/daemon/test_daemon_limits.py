"""What one client may cost the daemon (issue 12): HELLO, idle and transfer deadlines; caps on
connections before HELLO and per tenant; a small header before HELLO; no payload memory
before its bytes come; leases per connection and their longest TTL. Each against a real
daemon with small limits."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from daemonutil import RawPeer, frame, rss_bytes
from polling import until, until_async
from scraping import scrape, scrape_value_async

from kvstore import protocol as P
from kvstore.client.config import ClientConfig
from kvstore.client.node import NodeClient
from kvstore.client.read import get_into
from kvstore.results import Status

TOK_A, TOK_B = "tok-tenant-a1", "tok-tenant-b1"
OP = "tok-operator1"


@pytest.fixture
def limited(authed_daemon):
    def start(use_disk: bool = True, **limits):
        return authed_daemon({TOK_A: "alpha", TOK_B: "beta", OP: "*"}, use_disk, limits=limits)

    return start


def client(d, ns, token=TOK_A, **kw) -> NodeClient:
    cfg = dict(token=token, namespaces=(ns,), op_timeout_s=5, probe_interval_s=60)
    cfg.update(kw)
    return NodeClient(d.addr, ClientConfig(**cfg))


def read_all(port: int, n: int) -> bool:
    """At least ``n`` connections accepted on loopback ``port``, all with nothing left unread
    in the kernel (the receive queue of /proc/net/tcp is 0)."""
    with open("/proc/net/tcp") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    mine = [r for r in rows if int(r[1].split(":")[1], 16) == port and r[3] == "01"]  # ESTABLISHED
    return len(mine) >= n and all(int(r[4].split(":")[1], 16) == 0 for r in mine)


def test_a_connection_that_never_says_hello_is_closed(limited):
    d = limited(hello_timeout_s=1.0)
    silent = RawPeer(d.data_port, timeout=5)
    trickle = RawPeer(d.data_port, timeout=5)
    trickle.send(frame({"op": "HELLO", "rid": 0, "v": P.PROTOCOL_VERSION, "token": TOK_A, "ns": []})[:3])
    assert silent.closed_by_peer()
    assert trickle.closed_by_peer()
    assert scrape(d.admin, OP).value("tierkv_timeouts_total", kind="hello") == 2


def test_connections_before_hello_are_capped_and_healthz_answers(limited, ns, blocks_of):
    d = limited(max_unauthenticated=4, hello_timeout_s=5.0)
    flood = [RawPeer(d.data_port, timeout=10) for _ in range(12)]
    until(
        lambda: scrape(d.admin, OP).value("tierkv_refused_connections_total", 0.0, why="unauthenticated"),
        20.0,
        "8 connections before HELLO refused",
        ok=lambda n: n == 8,
    )
    # capped now (the 8 oldest were dropped for newcomers, the newest 4 wait out the HELLO
    # deadline): the probes still answer
    assert _get(d, "/healthz") == (200, {"ok": True})
    closed = sum(p.closed_by_peer() for p in flood)
    assert closed == 12
    c = client(d, ns)
    [(h, p)] = blocks_of(ns.with_tenant("alpha"), 1, 1000)
    assert [r.status for r in asyncio.run(c.put([(h, p)]))] == [Status.STORED]
    asyncio.run(c.close())


def test_an_idle_connection_is_closed_and_the_client_reconnects(limited, ns, blocks_of):
    d = limited(idle_timeout_s=1.0)
    idle = RawPeer(d.data_port, timeout=5)
    idle.hello(TOK_A, ns)
    assert idle.closed_by_peer()

    async def run():
        c = client(d, ns)
        [(h, p)] = blocks_of(ns.with_tenant("alpha"), 1, 1000)
        assert [r.status for r in await c.put([(h, p)])] == [Status.STORED]
        # the node closes the pooled connection at its idle deadline
        await until_async(
            lambda: scrape_value_async(d.admin, "tierkv_connections", OP),
            20.0,
            "the pooled connection closed",
            ok=lambda n: n == 0,
        )
        buf = bytearray(1000)
        assert [g.status for g in await get_into(c, [h.key], [buf])] == [Status.HIT]
        assert c.counters["node_down"] == 0 and c.counters["stale_connections"] >= 1
        await c.close()

    asyncio.run(run())


def test_a_large_header_before_hello_is_refused_unread(limited):
    d = limited()
    p = RawPeer(d.data_port)
    p.send((1 << 20).to_bytes(4, "big"))  # announces a 1 MiB header, sends none of it
    rep = p.reply()
    assert rep["code"] == P.TOO_LARGE
    assert p.closed_by_peer()


def test_a_payload_costs_memory_only_as_its_bytes_come_and_has_a_deadline(limited, ns, blocks_of):
    """A 60 MiB block that no DRAM slot can take goes to a private buffer: announcing it and
    sending 1 KiB must not allocate 60 MiB; trickling it is cut at the transfer deadline."""
    d = limited(transfer_timeout_s=2.0)
    [(h, _)] = blocks_of(ns.with_tenant("alpha"), 1, 60 << 20)
    before = rss_bytes(d.proc.pid)
    peers = []
    for _ in range(3):
        p = RawPeer(d.data_port, timeout=60)  # a generous bound: the daemon's is 2 s
        p.hello(TOK_A, ns)
        p.request({"op": "PUT", "hdrs": [h.encode()]}, plen=h.payload_len)
        p.send(b"\0" * 1024)
        peers.append(p)
    # measured once the daemon has read every byte sent (headers and the 1 KiB), so any buffer
    # it makes for them exists by now
    until(lambda: read_all(d.data_port, 3), 20.0, "3 connections read to the end")
    grown = rss_bytes(d.proc.pid) - before
    assert grown < 40 << 20, f"the daemon grew by {grown >> 20} MiB for 3 KiB of payload"
    # closed by the daemon (a socket timeout of the test's own is False), and counted as the
    # daemon's transfer timeouts below
    assert all(p.closed_by_peer() for p in peers)
    assert scrape(d.admin, OP).value("tierkv_timeouts_total", kind="transfer") == 3


def test_connections_per_tenant_are_capped(limited, ns):
    d = limited(max_conns_per_tenant=2)
    a = [RawPeer(d.data_port) for _ in range(3)]
    a[0].hello(TOK_A, ns)
    a[1].hello(TOK_A, ns)
    a[2].send(
        frame(
            {
                "op": "HELLO",
                "rid": 0,
                "v": P.PROTOCOL_VERSION,
                "token": TOK_A,
                "ns": [P.namespace_to_wire(ns)],
            }
        )
    )
    assert a[2].reply()["code"] == P.BUSY
    b = RawPeer(d.data_port)
    assert b.hello(TOK_B, ns)["ok"]  # another tenant's share is its own
    a[0].close()
    until(
        lambda: scrape(d.admin, OP).value("tierkv_connections"),
        20.0,
        "2 connections (a[1] and b)",
        ok=lambda n: n == 2,
    )
    again = RawPeer(d.data_port)
    assert again.hello(TOK_A, ns)["ok"]


def test_leases_per_connection_and_their_ttl_are_bounded(limited, ns, blocks_of):
    d = limited(max_leases_per_conn=4, max_lease_ttl_s=60.0)
    blocks = blocks_of(ns.with_tenant("alpha"), 6, 100)

    async def store():
        c = client(d, ns)
        assert [r.status for r in await c.put(blocks)] == [Status.STORED] * 6
        await c.close()

    asyncio.run(store())
    keys = [h.key.raw for h, _ in blocks]
    p = RawPeer(d.data_port)
    p.hello(TOK_A, ns)
    p.request({"op": "LEASE", "keys": b"".join(keys[:1]), "ttl": 86400})
    rep = p.reply()
    assert rep["code"] == P.BAD_REQUEST and "ttl" in rep["err"]
    p.request({"op": "LEASE", "keys": b"".join(keys[:3])})
    assert [r[0] for r in p.reply()["res"]] == [int(Status.HIT)] * 3
    p.request({"op": "LEASE", "keys": b"".join(keys[3:5])})
    rep = p.reply()
    assert rep["code"] == P.BAD_REQUEST and "at most 4" in rep["err"]
    handles = []
    p.request({"op": "LEASE", "keys": b"".join(keys[3:4])})
    handles = [r[3][0] for r in p.reply()["res"]]
    p.request({"op": "RELEASE", "handles": handles})
    assert p.reply()["res"] == [True]
    # ttl nil is the node's default (it was an internal error that closed the connection)
    p.request({"op": "LEASE", "keys": b"".join(keys[3:4]), "ttl": None})
    rep = p.reply()
    assert rep["ok"] and rep["res"][0][0] == int(Status.HIT), rep


def _get(d, path: str) -> tuple[int, dict]:
    async def get():
        async with aiohttp.ClientSession(d.admin) as s:
            r = await s.get(path)
            return r.status, await r.json()

    return asyncio.run(get())
