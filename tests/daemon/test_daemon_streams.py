"""Streamed batches against a real daemon (issue 18): a reader that stalls mid-stream, a
writer that lies about lengths, a pipelined flood: each costs only its own connection, and
the slots it held are given back once its transfer deadline passes. Pipelined requests on one
connection are answered in order."""

from __future__ import annotations

import asyncio

import pytest
from daemonutil import RawPeer, frame
from polling import until_async
from scraping import scrape_value_async

from kvstore import protocol as P
from kvstore.client.config import ClientConfig
from kvstore.client.node import NodeClient
from kvstore.client.read import get_into
from kvstore.results import Status

TOK = "tok-tenant-a1"
OP = "tok-operator1"
MiB = 1 << 20


@pytest.fixture
def daemon(authed_daemon):
    def start(**limits):
        dram = {"capacity": "128MiB", "slab_size": "4MiB"}
        return authed_daemon({TOK: "alpha", OP: "*"}, use_disk=False, dram=dram, limits=limits)

    return start


def client(d, ns, **kw) -> NodeClient:
    return NodeClient(
        d.addr, ClientConfig(token=TOK, namespaces=(ns,), op_timeout_s=10, probe_interval_s=60, **kw)
    )


def salted(d, ns):
    p = RawPeer(d.data_port)
    try:
        return ns.with_tenant(p.hello(TOK, ns)["salt"])
    finally:
        p.close()


async def _one_transfer_timeout(d) -> None:
    """Await the daemon's count of transfer timeouts at exactly one."""
    await until_async(
        lambda: scrape_value_async(d.admin, "tierkv_timeouts_total", OP, 0.0, kind="transfer"),
        30.0,
        "one transfer timeout counted",
        ok=lambda n: n == 1,
    )


async def _served(c: NodeClient, blocks) -> None:
    """``c`` reads every block of ``blocks`` back whole."""
    bufs = [bytearray(h.payload_len) for h, _ in blocks]
    got = await get_into(c, [h.key for h, _ in blocks], bufs)
    assert [g.status for g in got] == [Status.HIT] * len(blocks)
    assert all(bytes(b) == p for b, (_, p) in zip(bufs, blocks))


async def test_a_reader_that_stalls_mid_stream_costs_only_its_connection(daemon, ns, blocks_of):
    """A GET of a batch whose reader stops after a few bytes of the stream: other clients are
    served meanwhile; at the transfer deadline the stalled connection is closed and counted,
    and its leases end with it (the blocks can be deleted, their slots reused)."""
    d = daemon(transfer_timeout_s=1.0)
    blocks = blocks_of(salted(d, ns), 8, 2 * MiB, seed=1)
    c = client(d, ns)
    assert [r.status for r in await c.put(blocks)] == [Status.STORED] * len(blocks)
    stalled = RawPeer(d.data_port, rcvbuf=64 << 10, timeout=30)
    stalled.hello(TOK, ns)
    stalled.request({"op": "GET", "keys": b"".join([h.key.raw for h, _ in blocks])})
    rep = stalled.reply()
    assert list(rep["st"]) == [int(Status.HIT)] * 8
    stalled.exact(100 << 10)  # then it stops reading, inside the first block
    await _served(c, blocks)  # another connection is served while the stream is stuck
    await _one_transfer_timeout(d)
    assert await asyncio.get_running_loop().run_in_executor(None, stalled.closed_by_peer)
    # its leases went with the connection: the blocks delete, and their room takes new ones
    assert await c.delete([h.key for h, _ in blocks]) == [True] * 8
    fresh = blocks_of(salted(d, ns), 8, 2 * MiB, seed=2)
    assert [r.status for r in await c.put(fresh)] == [Status.STORED] * len(fresh)
    await _served(c, fresh)
    await c.close()


async def test_a_writer_that_lies_about_lengths_costs_only_its_connection(daemon, ns, blocks_of):
    """Three lies: ``plen`` not the headers' sum (refused, the connection stays usable); fewer
    payload bytes than announced, then silence (closed at the transfer deadline, nothing
    stored); more bytes than announced (the surplus is read as the next frame: a bad frame,
    the connection closed, the announced block stored whole). Others are served throughout."""
    d = daemon(transfer_timeout_s=1.0)
    sns = salted(d, ns)
    c = client(d, ns)
    [(h1, p1), (h2, p2), (h3, p3)] = blocks_of(sns, 3, MiB, seed=3)

    short_sum = RawPeer(d.data_port)
    short_sum.hello(TOK, ns)
    short_sum.request({"op": "PUT", "hdrs": [h1.encode()]}, plen=len(p1) - 1)
    short_sum.send(p1[:-1])
    rep = short_sum.reply()
    assert rep["ok"] is False and rep["code"] == P.BAD_REQUEST
    short_sum.request({"op": "EXISTS", "keys": h1.key.raw})
    assert short_sum.reply()["ok"], "a refused request leaves the connection usable"

    silent = RawPeer(d.data_port, timeout=30)
    silent.hello(TOK, ns)
    silent.request({"op": "PUT", "hdrs": [h2.encode()]}, plen=len(p2))
    silent.send(p2[: len(p2) // 3])  # then nothing more
    assert [r.status for r in await c.put([(h3, p3)])] == [Status.STORED]
    await _served(c, [(h3, p3)])
    assert await asyncio.get_running_loop().run_in_executor(None, silent.closed_by_peer)
    assert (await c.lookup([h2.key])).names() == [None], "a payload that never arrived stores nothing"

    surplus = RawPeer(d.data_port, timeout=30)
    surplus.hello(TOK, ns)
    surplus.request({"op": "PUT", "hdrs": [h1.encode()]}, plen=len(p1))
    surplus.send(p1 + b"\xff" * 64)
    assert surplus.reply()["st"] == bytes([int(Status.STORED)])
    assert await asyncio.get_running_loop().run_in_executor(None, surplus.closed_by_peer)
    await _served(c, [(h1, p1), (h3, p3)])
    await c.close()


async def test_a_pipelined_get_flood_whose_replies_are_never_read_is_closed(daemon, ns, blocks_of):
    """A peer that pipelines GETs of a 2 MiB block and never reads: the daemon's stream stalls
    on it, the transfer deadline closes that connection alone, and another client is served
    meanwhile."""
    d = daemon(transfer_timeout_s=1.0)
    [(h, p)] = blocks_of(salted(d, ns), 1, 2 * MiB, seed=4)
    c = client(d, ns)
    assert [r.status for r in await c.put([(h, p)])] == [Status.STORED]
    flood = RawPeer(d.data_port, rcvbuf=4096, timeout=30)
    flood.hello(TOK, ns)
    flood.flood(b"".join(frame({"op": "GET", "rid": i + 1, "keys": h.key.raw}) for i in range(256)))
    await _served(c, [(h, p)])
    await _one_transfer_timeout(d)
    await until_async(
        lambda: scrape_value_async(d.admin, "tierkv_connections", OP),
        30.0,
        "only c's own connection left",
        ok=lambda n: n == 1,
    )
    flood.close()
    await _served(c, [(h, p)])
    await c.close()


async def test_pipelined_requests_are_answered_in_order_each_with_its_payload(daemon, ns, blocks_of):
    """Forty GETs and EXISTSes written at once, then read: each reply answers its request (rid)
    in order, and each GET's payload follows its own reply."""
    d = daemon()
    blocks = blocks_of(salted(d, ns), 4, 300 << 10, seed=5)
    c = client(d, ns)
    assert [r.status for r in await c.put(blocks)] == [Status.STORED] * len(blocks)
    p = RawPeer(d.data_port, timeout=30)
    p.hello(TOK, ns)
    reqs = []
    for i in range(40):
        h, _ = blocks[i % 4]
        op = {"op": "GET", "keys": h.key.raw} if i % 2 == 0 else {"op": "EXISTS", "keys": h.key.raw}
        reqs.append(frame({**op, "rid": 100 + i}))
    p.send(b"".join(reqs))
    for i in range(40):
        rep = p.reply()
        assert rep["rid"] == 100 + i and rep["ok"], rep
        if i % 2 == 0:
            assert p.exact(rep["plen"]) == blocks[i % 4][1]
        else:
            assert rep.get("plen", 0) == 0
    p.close()
    await c.close()
