"""The client's streamed batches (issue 18): a reply's payloads land in the caller's buffers as
one stream with one hand-off to a worker, digests computed as they land; batches cut into
several frames are pipelined; ``streams`` splits a batch over connections. Every result is
the one the unsplit, unpipelined path gives: hits verified, misses and mismatches per key."""

from __future__ import annotations

import asyncio
import socket
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import xxhash

import kvstore.client.node as node_mod
from kvstore.block import checksum
from kvstore.client.config import ClientConfig
from kvstore.client.node import NodeClient, _stripes
from kvstore.client.read import get_into
from kvstore.results import Expect, Status
from rdma.channel import SocketChannel

MiB = 1 << 20


class CountingPool(ThreadPoolExecutor):
    def __init__(self) -> None:
        super().__init__(2, thread_name_prefix="count")
        self.jobs = 0

    def submit(self, *a, **kw):
        self.jobs += 1
        return super().submit(*a, **kw)


@pytest.mark.parametrize("wait_s", [0.0, 0.2])
async def test_a_stream_lands_in_many_views_with_their_digests(wait_s):
    """Sixty-four views of mixed sizes (one empty) filled from one stream: each gets its own
    bytes and its own xxh3 digest; with a worker that may wait, one hand-off for the lot."""
    a_sock, b_sock = socket.socketpair()
    pool = CountingPool()
    a, b = SocketChannel(a_sock), SocketChannel(b_sock, offload=pool, worker_wait_s=wait_s)
    rng = np.random.default_rng(7)
    sizes = [int(x) for x in rng.integers(1, 200_000, 64)]
    sizes[5] = 0
    payloads = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    send = asyncio.ensure_future(a.send(payloads))
    dst = [np.zeros(n, np.uint8) for n in sizes]
    digests = await b.recv_views(dst, xxhash.xxh3_64)
    await send
    assert len(digests) == 64
    for p, got, dig in zip(payloads, dst, digests):
        assert (got == p).all() and dig == checksum(p)
    if wait_s:
        assert pool.jobs == 1, pool.jobs
    assert b.bytes_in == sum(sizes)
    a.close()
    b.close()
    pool.shutdown()


async def test_a_stream_cut_short_raises_and_names_the_bytes():
    a_sock, b_sock = socket.socketpair()
    a, b = SocketChannel(a_sock), SocketChannel(b_sock)
    await a.send([b"x" * 1000])
    a.close()
    with pytest.raises(ConnectionError, match="after 1000 of 2000"):
        await b.recv_views([bytearray(1500), bytearray(500)], xxhash.xxh3_64)
    b.close()


def test_stripes_cut_by_bytes_and_leave_small_batches_whole():
    assert _stripes([MiB] * 8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert _stripes([MiB] * 3, 4) == [(0, 1), (1, 2), (2, 3)]
    assert _stripes([4096] * 100, 4) == [(0, 100)]  # under a stripe's worth: one connection
    assert _stripes([8 * MiB, MiB, MiB, MiB], 2) == [(0, 1), (1, 4)]
    runs = _stripes([MiB] * 10, 3)
    assert runs[0][0] == 0 and runs[-1][1] == 10 and len(runs) == 3
    assert all(i < j for i, j in runs) and all(runs[k][1] == runs[k + 1][0] for k in range(2))


@pytest.mark.parametrize("streams", [1, 4])
async def test_pipelined_and_striped_batches_give_each_key_its_result(start_daemon, ns, blocks_of, streams):
    """A 4 MiB ``max_frame`` cuts a batch of 1 MiB blocks into many pipelined frames; with
    ``streams=4`` it is also split over four connections. Hits are whole and verified, a
    missing key is a MISS, a wrong expectation a MISMATCH, a short buffer BUF_TOO_SMALL, in
    place; PUT statuses likewise (a second store of a block is EXISTS)."""
    d = start_daemon(
        use_disk=False, dram={"capacity": "96MiB", "slab_size": "2MiB"}, server={"max_frame": "4MiB"}
    )
    blocks = blocks_of(ns, 24, MiB, seed=11)
    missing = blocks_of(ns, 2, MiB, seed=12)
    c = NodeClient(d.addr, ClientConfig(namespaces=(ns,), pool_size=4, streams=streams, op_timeout_s=30))
    stored = await c.put(blocks[:20])
    assert [r.status for r in stored] == [Status.STORED] * 20
    again = await c.put(blocks)  # 20 stored already, 4 new
    assert [r.status for r in again] == [Status.EXISTS] * 20 + [Status.STORED] * 4
    order = [*blocks[:10], missing[0], *blocks[10:], missing[1]]
    keys = [h.key for h, _ in order]
    bufs = [bytearray(MiB) for _ in order]
    bufs[3] = bytearray(MiB - 1)
    expect = [None] * len(order)
    expect[7] = Expect(parent=blocks[0][0].key)  # not block 7's parent
    got = await get_into(c, keys, bufs, expect)
    want = [Status.HIT] * len(order)
    want[10] = want[-1] = Status.MISS
    want[3], want[7] = Status.BUF_TOO_SMALL, Status.MISMATCH
    assert [g.status for g in got] == want
    for (h, p), buf, g in zip(order, bufs, got):
        if g.status is Status.HIT:
            assert bytes(buf) == p and g.header == h
    await c.close()


def test_streams_must_be_positive():
    with pytest.raises(ValueError, match="streams must be >= 1"):
        ClientConfig(streams=0)
    assert ClientConfig(pool_size=1).streams == 4  # used as min(streams, pool_size)


async def test_concurrent_batches_split_only_over_unclaimed_connections(
    start_daemon, ns, blocks_of, monkeypatch
):
    """Four 8 MiB writes at once on a pool of four (a cluster's chunked save): the first may
    take every connection, the others one each, so no call waits behind another's stripes;
    every block is stored and read back, and no claim is left."""
    d = start_daemon(use_disk=False, dram={"capacity": "96MiB", "slab_size": "2MiB"})
    c = NodeClient(d.addr, ClientConfig(namespaces=(ns,), pool_size=4, streams=4, op_timeout_s=30))
    batches = [blocks_of(ns, 8, MiB, seed=20 + i) for i in range(4)]
    split: list[int] = []
    real = node_mod._stripes

    def recording(sizes, streams):
        runs = real(sizes, streams)
        split.append(len(runs))
        return runs

    monkeypatch.setattr(node_mod, "_stripes", recording)
    res = await asyncio.gather(*(c.put(b) for b in batches))
    assert [[r.status for r in rs] for rs in res] == [[Status.STORED] * 8] * 4
    assert sorted(split) == [1, 1, 1, 4], split
    assert c._claimed == 0
    for b in batches:
        bufs = [bytearray(MiB) for _ in b]
        got = await get_into(c, [h.key for h, _ in b], bufs)
        assert [g.status for g in got] == [Status.HIT] * 8 and [bytes(x) for x in bufs] == [p for _, p in b]
    assert split[-4:] == [4, 4, 4, 4]  # alone, each read is split again
    await c.close()
