"""The client's failure contract against peers that misbehave: a node that stalls mid-reply,
one that refuses connections, one that answers garbage. Calls return misses or dropped
writes within their deadline and never raise."""

from __future__ import annotations

import asyncio
import socket
import struct

import numpy as np
from stubpeer import frame, serve_with

from kvstore import protocol as P
from kvstore.block import make_header
from kvstore.client.config import ClientConfig
from kvstore.client.node import NodeClient
from kvstore.client.read import get_into
from kvstore.results import Status


def _block(ns, size):
    payload = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes()
    key = ns.block_keys([1, 2, 3, 4])[0]
    h = make_header(
        key=key,
        parent=ns.id,
        namespace=ns.id,
        tokens=[1, 2, 3, 4],
        dtype="uint8",
        shape=[size],
        payload=payload,
    )
    return h, payload


async def test_stall_mid_payload_is_a_timeout_and_the_buffer_is_left_alone(ns):
    h, payload = _block(ns, 4 << 20)

    async def half_then_stall(req, writer):
        writer.write(
            frame(
                {
                    "rid": req["rid"],
                    "ok": True,
                    **P.GetReply.of(req["rid"], 1, [0], b"\x00", [h.encode()], b"\x02").to_wire(),
                    "plen": h.payload_len,
                }
            )
        )
        writer.write(payload[: 1 << 20])
        await writer.drain()
        await asyncio.sleep(0.8)  # just past the client's deadline
        writer.write(payload[1 << 20 :])  # would land in the caller's buffer if we were careless

    server, port = await serve_with(half_then_stall)
    c = NodeClient(f"127.0.0.1:{port}", ClientConfig(namespaces=(ns,), op_timeout_s=0.5, probe_interval_s=60))
    buf = np.zeros(4 << 20, np.uint8)
    (g,) = await get_into(c, [h.key], [buf])
    # the stub sends the whole block 0.8 s in: a client that waited past its deadline would hit
    assert g.status is Status.TIMEOUT
    snapshot = buf.copy()
    await asyncio.sleep(1.0)
    assert (buf == snapshot).all(), "no copy may touch the buffer after get_into returned"
    assert c.counters["timeouts"] == 1 and not c.up
    await c.close()
    server.close()


async def test_garbage_reply_is_a_miss_not_an_exception(ns):
    h, payload = _block(ns, 1000)

    async def garbage(req, writer):
        writer.write(struct.pack(">I", 5) + b"\xc1\xc1\xc1\xc1\xc1")
        await writer.drain()

    server, port = await serve_with(garbage)
    c = NodeClient(f"127.0.0.1:{port}", ClientConfig(namespaces=(ns,), op_timeout_s=1, probe_interval_s=60))
    assert [g.status for g in await get_into(c, [h.key], [bytearray(1000)])] == [Status.ERROR]
    await c.close()
    server.close()


async def test_corrupt_payload_is_detected_by_the_client(ns):
    h, payload = _block(ns, 1000)
    bad = bytes([payload[0] ^ 0xFF]) + payload[1:]

    async def corrupt(req, writer):
        writer.write(
            frame(
                {
                    "rid": req["rid"],
                    "ok": True,
                    **P.GetReply.of(req["rid"], 1, [0], b"\x00", [h.encode()], b"\x02").to_wire(),
                    "plen": 1000,
                }
            )
            + bad
        )
        await writer.drain()

    server, port = await serve_with(corrupt)
    c = NodeClient(f"127.0.0.1:{port}", ClientConfig(namespaces=(ns,), op_timeout_s=1))
    (g,) = await get_into(c, [h.key], [bytearray(1000)])
    assert g.status is Status.CORRUPT and c.counters["corrupt"] == 1 and c.up
    await c.close()
    server.close()


async def test_refused_connections_are_dropped_writes_and_misses(ns):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    h, payload = _block(ns, 100)
    c = NodeClient(f"127.0.0.1:{port}", ClientConfig(namespaces=(ns,), op_timeout_s=1, probe_interval_s=60))
    assert [r.status for r in await c.put([(h, payload)])] == [Status.ERROR]
    assert (await c.lookup([h.key])).names() == [None]
    assert [g.status for g in await get_into(c, [h.key], [bytearray(100)])] == [Status.MISS]
    assert await c.delete([h.key]) == [False]
    assert c.counters["dropped_writes"] == 1 and c.counters["skipped"] == 3
    await c.close()
    assert [g.status for g in await get_into(c, [h.key], [bytearray(100)])] == [Status.MISS]
