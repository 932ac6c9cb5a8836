"""Restarts: graceful SIGTERM with the disk tier, and kill -9 in the middle of GETs."""

from __future__ import annotations

import asyncio
import time

from kvstore.client import ClientConfig, NodeClient
from kvstore.results import Status

MiB = 1 << 20


async def test_sigterm_then_restart_finds_every_block(start_daemon, ns, blocks_of, tmp_path):
    wd = tmp_path / "node"
    d = start_daemon(workdir=wd, disk={"sync": True})
    c = NodeClient(d.addr, ClientConfig(namespaces=(ns,)))
    blocks = blocks_of(ns, 12, 300_000)
    res = await c.put(blocks)
    assert all(r.status is Status.STORED and r.durable for r in res), res
    await c.close()
    assert d.stop() == 0
    assert "event=stopped" in d.logs()

    d2 = start_daemon(workdir=wd)
    c = NodeClient(d2.addr, ClientConfig(namespaces=(ns,)))
    keys = [h.key for h, _ in blocks]
    assert all(t is not None for t in await c.exists(keys))
    bufs = [bytearray(300_000) for _ in keys]
    got = await c.get_into(keys, bufs)
    assert [g.status for g in got] == [Status.HIT] * 12
    assert all(bytes(b) == p for b, (_, p) in zip(bufs, blocks))
    await c.close()


async def test_kill9_mid_get_gives_misses_then_recovers(start_daemon, ns, blocks_of, tmp_path):
    wd = tmp_path / "node"
    d = start_daemon(workdir=wd)
    cfg = ClientConfig(namespaces=(ns,), op_timeout_s=2.0, probe_interval_s=0.1, pool_size=2)
    c = NodeClient(d.addr, cfg)
    blocks = blocks_of(ns, 16, 2 * MiB, seed=4)
    assert all(r.status is Status.STORED for r in await c.put(blocks))
    keys = [h.key for h, _ in blocks]
    outcomes: list[list[Status]] = []
    stop = asyncio.Event()

    async def reader():
        bufs = [bytearray(2 * MiB) for _ in keys]
        while not stop.is_set():
            got = await c.get_into(keys, bufs)
            for g, b, (_, p) in zip(got, bufs, blocks):
                assert g.status is not Status.HIT or bytes(b) == p  # a hit is never wrong data
            outcomes.append([g.status for g in got])

    tasks = [asyncio.create_task(reader()) for _ in range(2)]
    while len(outcomes) < 4:
        await asyncio.sleep(0.01)
    d.kill9()
    t0 = time.monotonic()
    n = len(outcomes)
    while len(outcomes) < n + 4:
        await asyncio.sleep(0.01)
        assert time.monotonic() - t0 < 10, "readers hung after kill -9"
    stop.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    assert all(s is not Status.HIT for s in outcomes[-1])
    assert not c.up and c.counters["node_down"] == 1
    assert c.counters["errors"] + c.counters["timeouts"] >= 1

    # the node comes back on the same port; the background probe notices and reads hit again
    d2 = start_daemon(workdir=wd, server={"data_port": d.data_port})
    for _ in range(100):
        if c.up:
            break
        await asyncio.sleep(0.05)
    assert c.up
    bufs = [bytearray(2 * MiB) for _ in keys]
    got = await c.get_into(keys, bufs)
    assert [g.status for g in got] == [Status.HIT] * 16
    assert all(bytes(b) == p for b, (_, p) in zip(bufs, blocks))
    await c.close()
    assert d2.stop() == 0
