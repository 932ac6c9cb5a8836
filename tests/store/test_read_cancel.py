"""A cancelled read returns only when no thread writes into the caller's buffers any more.

``NodeStore.get_into`` of a disk block copies it into the caller's buffer on a disk reader
thread. Callers reuse their buffers (the connector's staging buffers, a daemon's receive
buffers): if a cancelled read (a deadline) returned while that thread still copied, the
next read into the same buffer could be verified and then overwritten by the old block's
bytes -- wrong output after a hit. Real NodeStore over LMDB; a tiny GIL switch interval lets
the cancellation land while the thread copies, as on a busy machine."""

from __future__ import annotations

import asyncio
import hashlib

from storeutil import make_blocks

from kvstore.node.store import NodeStore
from kvstore.results import Status

MiB = 1 << 20


async def test_a_cancelled_disk_read_does_not_write_into_the_buffer_after_it_returns(cfg_factory, busy_gil):
    cfg = cfg_factory(dram__capacity=0, disk__capacity="1GiB")
    blocks = make_blocks(8, nbytes=32 * MiB, seed=4)
    node = await NodeStore.open(cfg)
    await node.writer.put(blocks)
    keys = [h.key for h, _ in blocks]
    late = 0
    for delay in (0.0, 0.001, 0.003, 0.006, 0.01, 0.02):
        bufs = [bytearray(32 * MiB) for _ in keys]
        task = asyncio.ensure_future(node.reader.read(keys, bufs))
        await asyncio.sleep(delay)
        task.cancel()
        try:
            await task
            continue  # finished before the cancel: nothing to check
        except asyncio.CancelledError:
            pass
        before = [hashlib.blake2b(b, digest_size=16).digest() for b in bufs]
        await asyncio.sleep(0.3)  # a thread still copying would change the buffers now
        late += before != [hashlib.blake2b(b, digest_size=16).digest() for b in bufs]
    assert late == 0, f"{late} cancelled reads wrote into their buffers after they returned"
    # the node still serves the blocks whole
    bufs = [bytearray(32 * MiB) for _ in keys]
    assert [r.status for r in await node.reader.read(keys, bufs)] == [Status.HIT] * len(keys)
    assert all(bytes(b) == p for b, (_, p) in zip(bufs, blocks))
    await node.close()
