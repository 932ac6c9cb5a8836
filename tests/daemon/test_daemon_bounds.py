"""Bounds a reviewer found missing (issue 12 follow-ups), each against a real daemon: a RESERVE
holds no buffer before its bytes come and refuses a payload over ``server.max_frame``; one GET
reads at most ``server.max_frame`` bytes of disk-resident blocks into private buffers; a whole
request, its reply included, has the transfer deadline."""

from __future__ import annotations

import asyncio
import threading
import time

import aiohttp
import pytest
from daemonutil import RawPeer, frame

from kvstore import protocol as P
from kvstore.results import Status

TOK = "tok-tenant-a1"
OP = "tok-operator1"


@pytest.fixture
def daemon(start_daemon, tmp_path):
    f = tmp_path / "tokens.txt"
    f.write_text(f"{TOK} alpha\n{OP} *\n")

    def start(server=None, **limits):
        return start_daemon(auth={"token_file": str(f)}, limits=limits, server=server or {})

    return start


def metrics(d) -> str:
    async def get():
        async with aiohttp.ClientSession(d.admin) as s:
            r = await s.get("/metrics", headers={"Authorization": f"Bearer {OP}"})
            return await r.text()

    return asyncio.run(get())


def until(what, deadline_s: float = 20.0) -> bool:
    """Poll ``what()`` until true or the deadline (no timed assert: the bound is generous)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if what():
            return True
        time.sleep(0.1)
    return False


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


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
    p.request({"op": "EXISTS", "keys": [h.key.raw]})
    assert p.reply()["tiers"] == [None]  # the connection stays usable


def test_one_get_reads_at_most_max_frame_bytes_from_disk(daemon, ns, blocks_of):
    """Blocks over the DRAM slab size live on disk only; a GET of five of them with room for
    two in max_frame returns two and misses the rest (no buffer for the others)."""
    d = daemon(server={"max_frame": "12MiB"})  # the DRAM slab is 4 MiB (daemonutil)
    blocks = blocks_of(ns.with_tenant("alpha"), 5, 5 << 20)
    p = RawPeer(d.data_port, timeout=20)
    p.hello(TOK, ns)
    for h, payload in blocks:
        p.request({"op": "PUT", "hdrs": [h.encode()]}, plen=len(payload))
        p.send(payload)
        assert p.reply()["res"][0][0] == int(Status.STORED)
    p.request({"op": "EXISTS", "keys": [h.key.raw for h, _ in blocks]})
    assert p.reply()["tiers"] == ["disk"] * 5
    p.request({"op": "GET", "keys": [h.key.raw for h, _ in blocks]})
    rep = p.reply()
    got = [r[0] for r in rep["res"]]
    assert got == [int(Status.HIT)] * 2 + [int(Status.MISS)] * 3
    assert p.exact(10 << 20) == blocks[0][1] + blocks[1][1]


def test_a_peer_that_stops_reading_replies_is_closed_and_counted(daemon, ns):
    """Pipelined STATS requests whose replies are never read: the daemon's send blocks; the
    request deadline closes the connection (the idle timeout does not apply while busy)."""
    d = daemon(transfer_timeout_s=1.0)
    p = RawPeer(d.data_port, rcvbuf=4096, timeout=30)
    p.hello(TOK, ns)
    req = frame({"op": "STATS", "rid": 1}) * 256

    def flood():
        try:
            while True:
                p.send(req)
        except OSError:
            pass  # the daemon closed the connection

    threading.Thread(target=flood, daemon=True).start()
    assert until(lambda: 'tierkv_timeouts_total{kind="request"} 1.0' in metrics(d), 30.0)
    assert until(lambda: "tierkv_connections 0.0" in metrics(d), 30.0)
