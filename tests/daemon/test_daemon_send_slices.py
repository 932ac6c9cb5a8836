"""A large reply is sent by a worker in blocking ``sendmsg`` slices (SO_SNDTIMEO,
rdma/bursts.py ``send_slices``): a reader that stops reading holds a worker for at most one
slice, so more stalled readers than the copy pool has workers (16 at most) do not hold up
another client's reads and writes."""

from __future__ import annotations

import asyncio

import numpy as np
from daemonutil import RawPeer, frame

from kvstore.client.config import ClientConfig
from kvstore.client.node import NodeClient
from kvstore.client.read import get_into
from kvstore.results import Status

MiB = 1 << 20


async def test_stalled_readers_of_large_replies_cost_only_their_own_connections(start_daemon, ns, blocks_of):
    """20 connections each GET 12 MiB (more than the daemon's socket buffer) and never read,
    two more read a byte now and then; another client's 3 MiB GET and PUT are served within its
    5 s deadline, its bytes its own."""
    d = start_daemon(dram={"capacity": "64MiB", "slab_size": "4MiB"}, limits={"transfer_timeout_s": 30.0})
    c = NodeClient(d.addr, ClientConfig(namespaces=(ns,), op_timeout_s=5, probe_interval_s=60))
    blocks = blocks_of(ns, 5, 3 * MiB, seed=11)
    assert [r.status for r in await c.put(blocks[:4])] == [Status.STORED] * 4
    keys = b"".join(h.key.raw for h, _ in blocks[:4])
    stalled = []
    for _ in range(22):
        p = RawPeer(d.data_port, rcvbuf=4096, timeout=30)
        p.hello("", ns)
        p.send(frame({"op": "GET", "rid": 1, "keys": keys}))
        stalled.append(p)
    await asyncio.sleep(1.0)
    for _ in range(3):  # two trickling readers: each read lets the daemon's send go on a little
        for p in stalled[-2:]:
            p.sock.setblocking(False)  # never waits here: the test's loop goes on
            try:
                p.sock.recv(4096)
            except BlockingIOError:
                pass
        await asyncio.sleep(0.2)
    buf = np.zeros(3 * MiB, dtype=np.uint8)
    [got] = await get_into(c, [blocks[0][0].key], [buf])
    assert got.status is Status.HIT and buf.tobytes() == blocks[0][1]
    assert [r.status for r in await c.put(blocks[4:])] == [Status.STORED]
    [got] = await get_into(c, [blocks[4][0].key], [buf])
    assert got.status is Status.HIT and buf.tobytes() == blocks[4][1]
    for p in stalled:
        p.close()
    await c.close()
