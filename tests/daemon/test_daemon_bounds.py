"""Bounds a reviewer found missing (issue 12 follow-ups), each against a real daemon: a RESERVE
holds no buffer before its bytes come and refuses a payload over ``server.max_frame``; one GET
reads at most ``server.max_frame`` bytes of disk-resident blocks into private buffers; a whole
request, its reply included, has a deadline; a GET never sends a slot whose lease lapsed."""

from __future__ import annotations

import pytest
from daemonutil import RawPeer, frame, rss_bytes
from polling import until
from scraping import scrape

from kvstore import protocol as P
from kvstore.results import Status

TOK = "tok-tenant-a1"
OP = "tok-operator1"


@pytest.fixture
def daemon(authed_daemon):
    def start(server=None, **limits):
        return authed_daemon({TOK: "alpha", OP: "*"}, limits=limits, server=server or {})

    return start


def test_reserve_of_a_block_without_a_slot_holds_no_buffer(daemon, ns, blocks_of):
    """A 60 MiB block no DRAM slot can take would need a private buffer: it is answered
    inline (no descriptor, no hold) and the daemon does not grow by its size."""
    d = daemon()
    [(h, _)] = blocks_of(ns.with_tenant("alpha"), 1, 60 << 20)
    before = rss_bytes(d.proc.pid)
    peers = []
    for _ in range(3):
        p = RawPeer(d.data_port, timeout=10)
        p.hello(TOK, ns)
        p.request({"op": "RESERVE", "hdrs": [h.encode()]})
        assert p.reply()["res"] == [[None, None]]
        peers.append(p)
    grown = rss_bytes(d.proc.pid) - before
    assert grown < 40 << 20, f"the daemon grew by {grown >> 20} MiB for three RESERVEs"


def test_reserve_over_max_frame_is_a_bad_request(daemon, ns, blocks_of):
    d = daemon(server={"max_frame": "4MiB"})
    [(h, _)] = blocks_of(ns.with_tenant("alpha"), 1, 5 << 20)
    p = RawPeer(d.data_port)
    p.hello(TOK, ns)
    p.request({"op": "RESERVE", "hdrs": [h.encode()]})
    rep = p.reply()
    assert rep["code"] == P.BAD_REQUEST and "payload_len" in rep["err"]
    p.request({"op": "EXISTS", "keys": h.key.raw})
    assert p.reply()["tiers"] == b"\x00"  # the connection stays usable


def test_one_get_reads_at_most_max_frame_bytes_from_disk(daemon, ns, blocks_of):
    """Blocks over the DRAM slab size live on disk only; a GET of five of them with room for
    two in max_frame returns two and misses the rest (no buffer for the others)."""
    d = daemon(server={"max_frame": "12MiB"})  # the DRAM slab is 4 MiB (daemonutil)
    blocks = blocks_of(ns.with_tenant("alpha"), 5, 5 << 20)
    p = RawPeer(d.data_port, timeout=20)
    p.hello(TOK, ns)
    p.put_each(blocks)
    p.request({"op": "EXISTS", "keys": b"".join(h.key.raw for h, _ in blocks)})
    assert p.reply()["tiers"] == b"\x03" * 5
    p.request({"op": "GET", "keys": b"".join([h.key.raw for h, _ in blocks])})
    rep = p.reply()
    got = list(rep["st"])
    assert got == [int(Status.HIT)] * 2 + [int(Status.MISS)] * 3
    assert p.exact(10 << 20) == blocks[0][1] + blocks[1][1]


def test_a_peer_that_stops_reading_replies_is_closed_and_counted(daemon, ns):
    """Pipelined STATS requests whose replies are never read: the daemon's send blocks; the
    request deadline closes the connection (the idle timeout does not apply while busy)."""
    d = daemon(transfer_timeout_s=1.0)
    p = RawPeer(d.data_port, rcvbuf=4096, timeout=30)
    p.hello(TOK, ns)
    p.flood(frame({"op": "STATS", "rid": 1}) * 256)
    # the daemon's send blocks only once the kernel holds what the peer will not read (up to
    # tcp_wmem's 4 MiB of small replies): on a loaded host, serving that many STATS takes tens
    # of seconds before the request deadline can even start
    until(
        lambda: scrape(d.admin, OP).value("tierkv_timeouts_total", 0.0, kind="request"),
        120.0,
        "one request timeout counted",
        ok=lambda n: n == 1,
    )
    until(
        lambda: scrape(d.admin, OP).value("tierkv_connections"),
        30.0,
        "no connection left",
        ok=lambda n: n == 0,
    )


def test_a_get_never_sends_a_slot_whose_lease_lapsed(start_daemon, ns, blocks_of):
    """GET [A, B1..B12]: A is leased in DRAM first, then the Bs (too big for a DRAM slot) are
    read from disk, each read an await. Meanwhile another connection deletes A and PUTs C:
    the PUT's sweep expires A's lease (a 1 ms TTL), frees A's slot and C takes it (a 4 MiB
    DRAM tier: before the fix, A's header went out with C's bytes, every run). A must then be a miss, or its own bytes: never C's bytes under A's header."""
    d = start_daemon(dram={"capacity": "4MiB", "slab_size": "2MiB"}, node={"lease_ttl_s": 0.001})
    [(ha, pa)] = blocks_of(ns, 1, 1536 << 10, seed=1)
    [(hc, pc)] = blocks_of(ns, 1, 1536 << 10, seed=2)
    bs = blocks_of(ns, 12, 5 << 19, seed=3)
    reader = RawPeer(d.data_port, timeout=30)
    writer = RawPeer(d.data_port, timeout=30)
    for p in (reader, writer):
        p.hello("", ns)
    for h, payload in [(ha, pa), *bs]:
        writer.request({"op": "PUT", "hdrs": [h.encode()]}, plen=len(payload))
        writer.send(payload)
        assert writer.reply()["st"][0] == int(Status.STORED)
    writer.request({"op": "EXISTS", "keys": ha.key.raw + b"".join(h.key.raw for h, _ in bs)})
    assert writer.reply()["tiers"] == b"\x02" + b"\x03" * 12
    reader.request({"op": "GET", "keys": b"".join([ha.key.raw] + [h.key.raw for h, _ in bs])})
    # once the daemon has read the GET it has leased A (no await before): now delete and reuse
    reader.until_read("the GET read by the daemon")
    writer.request({"op": "DELETE", "keys": ha.key.raw})
    writer.request({"op": "PUT", "hdrs": [hc.encode()]}, plen=len(pc))
    writer.send(pc)
    rep = reader.reply()
    st = rep["st"][0]
    sizes = [h.payload_len for (h, _), s in zip([(ha, pa), *bs], rep["st"]) if s == int(Status.HIT)]
    payload = reader.exact(sum(sizes))
    assert writer.reply()["res"] == b"\x01"
    rep_c = writer.reply()
    assert (rep_c["st"][0], P.PUT_TIERS[rep_c["tier"][0]]) == (int(Status.STORED), "dram")  # C took A's room
    if st == int(Status.HIT):
        assert payload[: len(pa)] == pa, "A's header went out with another block's bytes"


def test_leases_of_disk_blocks_hold_at_most_max_frame_bytes_per_connection(daemon, ns, blocks_of):
    """A LEASE of a disk-only block holds a private copy until RELEASE or its TTL: across all
    of one connection's leases those copies stay within ``server.max_frame``, however many
    LEASE requests it sends; released copies make room again."""
    d = daemon(server={"max_frame": "12MiB"})  # the DRAM slab is 4 MiB: 5 MiB blocks stay on disk
    blocks = blocks_of(ns.with_tenant("alpha"), 5, 5 << 20)
    p = RawPeer(d.data_port, timeout=20)
    p.hello(TOK, ns)
    p.put_each(blocks)
    handles = []
    for h, _ in blocks:  # one block per request: the bound is the connection's, not the request's
        p.request({"op": "LEASE", "keys": h.key.raw, "ttl": 60.0})
        [r] = p.reply()["res"]
        if r[0] == int(Status.HIT):
            handles.append(r[3][0])
    assert len(handles) == 2  # 2 x 5 MiB within 12 MiB; the third would pass it
    p.request({"op": "RELEASE", "handles": handles[:1]})
    p.reply()
    p.request({"op": "LEASE", "keys": b"".join([blocks[4][0].key.raw]), "ttl": 60.0})
    assert p.reply()["res"][0][0] == int(Status.HIT)
