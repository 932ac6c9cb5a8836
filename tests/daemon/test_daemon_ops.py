"""Every data-port op and admin route against a real daemon, and bad input on both ports."""

from __future__ import annotations

import asyncio
import socket
import struct

import aiohttp
import msgpack
import numpy as np
import pytest
from scraping import scrape_async
from storeutil import read_back, remade

from kvstore import protocol as P
from kvstore.client.config import ClientConfig
from kvstore.client.node import NodeClient
from kvstore.client.read import get_into
from kvstore.results import Expect, Status


@pytest.fixture
def daemon(start_daemon):
    return start_daemon()


async def test_round_trip_all_ops(daemon, ns, blocks_of):
    c = NodeClient(daemon.addr, ClientConfig(namespaces=(ns,)))
    blocks = blocks_of(ns, 8, 70_000)
    keys = [h.key for h, _ in blocks]
    assert (await c.lookup(keys)).names() == [None] * 8
    res = await c.put(blocks)
    assert [r.status for r in res] == [Status.STORED] * 8
    assert [r.status for r in await c.put(blocks[:2])] == [Status.EXISTS] * 2
    assert (await c.lookup(keys)).names() == ["dram"] * 8

    # GET into numpy arrays, bytearrays and torch tensors
    torch = pytest.importorskip("torch")
    bufs = [np.zeros(70_000, np.uint8), bytearray(80_000), torch.zeros(70_000, dtype=torch.uint8)] + [
        bytearray(70_000) for _ in range(5)
    ]
    got = await get_into(c, keys, bufs)
    assert [g.status for g in got] == [Status.HIT] * 8
    assert bytes(memoryview(bufs[0])) == blocks[0][1]
    assert bytes(bufs[1][:70_000]) == blocks[1][1]
    assert bytes(bufs[2].numpy()) == blocks[2][1]
    assert all(bytes(b) == p for b, (_, p) in zip(bufs[3:], blocks[3:]))
    assert got[0].header == blocks[0][0] and got[0].tier == "dram"

    # expectations: right parent/tokens hit, wrong ones are MISMATCH; short buffer is BUF_TOO_SMALL
    h1 = blocks[1][0]
    exp = [Expect(h1.parent, h1.token_bytes), Expect(parent=keys[5])]
    got = await get_into(c, keys[1:3], [bytearray(70_000), bytearray(70_000)], exp)
    assert [g.status for g in got] == [Status.HIT, Status.MISMATCH]
    assert (await get_into(c, keys[:1], [bytearray(10)]))[0].status is Status.BUF_TOO_SMALL

    # the descriptor path: LEASE + transport READ + RELEASE, RESERVE + WRITE + COMMIT
    dc = NodeClient(daemon.addr, ClientConfig(namespaces=(ns,), descriptors="always"))
    bufs = [np.zeros(70_000, np.uint8) for _ in keys]
    got = await get_into(dc, keys, bufs)
    assert [g.status for g in got] == [Status.HIT] * 8
    assert all(b.tobytes() == p for b, (_, p) in zip(bufs, blocks))
    more = blocks_of(ns, 3, 5000, seed=9)
    assert [r.status for r in await dc.put(more)] == [Status.STORED] * 3
    await dc.close()
    bufs = [bytearray(5000) for _ in more]
    assert [g.status for g in await get_into(c, [h.key for h, _ in more], bufs)] == [Status.HIT] * 3
    assert all(bytes(b) == p for b, (_, p) in zip(bufs, more))

    # DELETE, then it is gone; deleting again is False
    assert await c.delete(keys[:2]) == [True, True]
    assert await c.delete(keys[:1]) == [False]
    assert (await c.lookup(keys[:3])).names() == [None, None, "dram"]
    assert [g.status for g in await get_into(c, keys[:1], [bytearray(70_000)])] == [Status.MISS]

    stats = await c.stats()
    assert "tiers" in stats and "dram" in stats["tiers"]
    assert c.counters["hits"] >= 8 and c.counters["errors"] == 0
    await c.close()


async def test_admin_routes(daemon, ns, blocks_of):
    c = NodeClient(daemon.addr, ClientConfig(namespaces=(ns,)))
    blocks = blocks_of(ns, 5, 1000, seed=3)
    await c.put(blocks)
    await get_into(c, [blocks[0][0].key], [bytearray(1000)])
    async with aiohttp.ClientSession(daemon.admin) as s:
        assert (await (await s.get("/healthz")).json()) == {"ok": True}
        assert (await s.get("/readyz")).status == 200
        m = await scrape_async(daemon.admin)
        assert m.has("tierkv_tier_waste_bytes", tier="dram")
        for name in (
            "tierkv_tier_bytes",
            "tierkv_hits_total",
            "tierkv_op_seconds_bucket",
            "tierkv_bytes_in_total",
        ):
            assert m.of(name), f"no {name} on /metrics"
        page1 = await (await s.get("/v1/blocks", params={"limit": "3"})).json()
        assert len(page1["blocks"]) == 3 and page1["next"]
        page2 = await (await s.get("/v1/blocks", params={"limit": "3", "after": page1["next"]})).json()
        listed = {b["key"] for b in page1["blocks"] + page2["blocks"]}
        assert listed == {h.key.hex for h, _ in blocks}
        only_ns = await (await s.get("/v1/blocks", params={"namespace": ns.id.hex, "tier": "dram"})).json()
        assert len(only_ns["blocks"]) == 5
        key = blocks[0][0].key.hex
        detail = await (await s.get(f"/v1/blocks/{key}")).json()
        assert detail["key"] == key and detail["header"]["tokens"] == blocks[0][0].tokens
        assert (await s.post(f"/v1/blocks/{key}/pin")).status == 200
        assert (await (await s.get(f"/v1/blocks/{key}")).json())["pinned"] is True
        assert (await s.delete(f"/v1/blocks/{key}/pin")).status == 200
        assert (await s.delete(f"/v1/blocks/{key}")).status == 200
        assert (await s.get(f"/v1/blocks/{key}")).status == 404
        assert (await s.get("/v1/blocks/nothex")).status == 400
        assert (await s.get("/v1/blocks", params={"limit": "0"})).status == 400
        assert (await s.get("/v1/blocks", params={"tier": "tape"})).status == 400
        stats = await (await s.get("/v1/stats")).json()
        assert stats["daemon"]["tierkv_hits_total"] >= 1
    await c.close()


class Raw:
    """A bare data-port connection for sending what a client never would."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def frame(self, header: dict, payload: bytes = b"") -> None:
        if payload:
            header = {**header, "plen": len(payload)}
        body = msgpack.packb(header, use_bin_type=True)
        self.send(struct.pack(">I", len(body)) + body + payload)

    def reply(self) -> dict | None:
        """The next reply header (payload skipped), or None when the daemon closed."""
        head = self._exact(4)
        if head is None:
            return None
        body = self._exact(struct.unpack(">I", head)[0])
        h = msgpack.unpackb(body, raw=False)
        if h.get("plen"):
            self._exact(h["plen"])
        return h

    def _exact(self, n: int) -> bytes | None:
        buf = b""
        while len(buf) < n:
            try:
                chunk = self.sock.recv(n - len(buf))
            except ConnectionResetError:
                return None
            if not chunk:
                return None
            buf += chunk
        return buf

    def hello(self, ns, token: str = "", **extra) -> dict:
        self.frame({"op": "HELLO", "rid": 1, "v": P.PROTOCOL_VERSION, "token": token, "ns": [ns], **extra})
        return self.reply()

    def close(self) -> None:
        self.sock.close()


async def _still_serves(daemon, ns, blocks_of) -> None:
    c = NodeClient(daemon.addr, ClientConfig(namespaces=(ns,)))
    blocks = blocks_of(ns, 1, 100, seed=77)
    await c.put(blocks)
    buf = bytearray(100)
    assert (await get_into(c, [blocks[0][0].key], [buf]))[0].status is Status.HIT
    assert bytes(buf) == blocks[0][1]
    await c.close()
    assert daemon.proc.poll() is None


async def test_bad_input_on_the_data_port(daemon, ns, blocks_of):
    wire_ns = P.namespace_to_wire(ns)
    loop = asyncio.get_running_loop()

    def scenario():
        out = {}
        r = Raw(daemon.data_port)  # op before HELLO: refused and closed
        r.frame({"op": "GET", "rid": 5, "keys": b""})
        out["no_hello"] = (r.reply(), r.reply())
        r.close()
        r = Raw(daemon.data_port)  # wrong protocol version: refused and closed
        r.frame({"op": "HELLO", "rid": 1, "v": 99})
        out["version"] = (r.reply(), r.reply())
        r.close()
        r = Raw(daemon.data_port)  # length over max_frame: refused and closed
        r.send(struct.pack(">I", 200 << 20))
        out["too_large"] = (r.reply(), r.reply())
        r.close()
        r = Raw(daemon.data_port)  # garbage msgpack: refused and closed
        r.send(struct.pack(">I", 4) + b"\xc1\xc1\xc1\xc1")
        out["garbage"] = (r.reply(), r.reply())
        r.close()
        r = Raw(daemon.data_port)  # truncated frame, then hang up: nothing to reply to
        r.send(struct.pack(">I", 100) + b"\x80")
        r.close()
        r = Raw(daemon.data_port)  # request-level errors keep the connection
        assert r.hello(wire_ns)["ok"]
        r.frame({"op": "FROB", "rid": 2})
        out["unknown"] = r.reply()
        r.frame({"op": "GET", "rid": 3, "keys": b"short"})
        out["bad_keys"] = r.reply()
        [(h, payload)] = blocks_of(ns, 1, 256, seed=5)
        r.frame({"op": "PUT", "rid": 4, "hdrs": [h.encode()]}, payload[:-1] + bytes([payload[-1] ^ 1]))
        out["bad_checksum"] = r.reply()
        r.frame({"op": "PUT", "rid": 5, "hdrs": [h.encode()]}, payload + b"extra")
        out["bad_plen"] = r.reply()
        r.frame({"op": "EXISTS", "rid": 6, "keys": h.key.raw})
        out["exists"] = r.reply()
        r.close()
        return out

    out = await loop.run_in_executor(None, scenario)
    for name, code in (("no_hello", P.AUTH), ("version", P.BAD_VERSION), ("too_large", P.TOO_LARGE)):
        first, after = out[name]
        assert first["ok"] is False and first["code"] == code, name
        assert after is None, f"{name}: connection should be closed"
    assert out["garbage"][0]["code"] == P.BAD_FRAME and out["garbage"][1] is None
    assert out["unknown"]["code"] == P.UNKNOWN_OP and out["unknown"]["rid"] == 2
    assert out["bad_keys"]["code"] == P.BAD_REQUEST
    assert out["bad_checksum"]["ok"] and out["bad_checksum"]["st"][0] == int(Status.INVALID)
    assert out["bad_plen"]["code"] == P.BAD_REQUEST
    assert out["exists"]["tiers"] == b"\x00", "a block with a bad checksum must not be stored"
    await _still_serves(daemon, ns, blocks_of)
    m = await scrape_async(daemon.admin)
    assert m.value("tierkv_protocol_errors_total", code="too_large") >= 1
    assert m.value("tierkv_checksum_failures_total") == 1


async def test_bad_input_on_the_admin_port(daemon):
    async with aiohttp.ClientSession(daemon.admin) as s:
        assert (await s.get("/v1/nothing")).status == 404
        assert (await s.post("/v1/blocks/" + "00" * 16 + "/pin")).status == 404
        assert (await s.get("/v1/blocks", params={"namespace": "zz"})).status == 400
        assert (await s.get("/v1/blocks", params={"limit": "many"})).status == 400


async def test_wrong_namespace_writes_are_refused(daemon, ns, blocks_of):
    c = NodeClient(daemon.addr, ClientConfig(namespaces=(ns,)))
    other = ns.with_tenant("someone-else")
    blocks = blocks_of(other, 2, 100)
    assert [r.status for r in await c.put(blocks)] == [Status.INVALID] * 2
    [(h, payload)] = blocks_of(ns, 1, 100)
    forged = remade(h, payload, namespace=other.id)
    assert [r.status for r in await c.put([(forged, payload)])] == [Status.INVALID]
    assert (await c.lookup([h.key, blocks[0][0].key])).names() == [None, None]
    await c.close()


async def test_large_batches_are_cut_to_fit_frames(daemon, blocks_of):
    from kvstore.keys import Namespace

    wide = Namespace("test-model", "uint8", 256)  # 1 KiB of token ids in every header
    c = NodeClient(daemon.addr, ClientConfig(namespaces=(wide,)))
    blocks = blocks_of(wide, 1500, 64, seed=21)
    assert [r.status for r in await c.put(blocks)] == [Status.STORED] * 1500
    assert await read_back(c, blocks, 30.0, 30.0) == (1500, 0)  # every block found, read whole
    assert await c.delete([h.key for h, _ in blocks]) == [True] * 1500
    await c.close()


async def test_client_hanging_up_mid_reply_releases_its_leases(daemon, ns, blocks_of):
    c = NodeClient(daemon.addr, ClientConfig(namespaces=(ns,)))
    blocks = blocks_of(ns, 3, 3 << 20, seed=31)
    await c.put(blocks)
    keys = [h.key for h, _ in blocks]

    def hang_up():
        for _ in range(5):
            r = Raw(daemon.data_port)
            assert r.hello(P.namespace_to_wire(ns))["ok"]
            r.frame({"op": "GET", "rid": 2, "keys": b"".join([k.raw for k in keys])})
            r.sock.recv(1000)  # the reply has started; now vanish without reading the rest
            r.close()

    await asyncio.get_running_loop().run_in_executor(None, hang_up)
    await asyncio.sleep(0.3)
    async with aiohttp.ClientSession(daemon.admin) as s:
        for k in keys:
            info = await (await s.get(f"/v1/blocks/{k.hex}")).json()
            assert info["leases"] == 0, info
    assert await c.delete(keys) == [True] * 3  # nothing is stuck behind a lease
    await _still_serves(daemon, ns, blocks_of)
    await c.close()
