"""A lease of a disk-only block whose key is deleted and stored anew, with other bytes of
another length, while the lease reads it: the lease carries exactly the bytes its header
names (never the length indexed before, never the tail of a slot's previous occupant), and
no DRAM copy is committed with the old length. Real tiers; the reader threads are kept busy
by large reads so that the rewrite lands while the lease waits for its read."""

from __future__ import annotations

import asyncio
import random

from storeutil import checked, make_blocks, remade

from kvstore.block import checksum
from kvstore.node.store import NodeStore

KiB, MiB = 1 << 10, 1 << 20


def _rewrite(h, nbytes: int, seed: int):
    """The same key as ``h`` with a new payload of ``nbytes``: (header, payload)."""
    p = random.Random(seed).randbytes(nbytes)
    return remade(h, p), p


async def test_a_lease_reads_the_copy_its_header_names_when_the_key_is_rewritten(cfg_factory):
    cfg = cfg_factory(dram__capacity="2MiB", dram__slab_size="1MiB", disk__capacity="512MiB")
    big = make_blocks(4, nbytes=32 * MiB, seed=1)  # over the slab size: disk only
    rounds = make_blocks(6, nbytes=512 * KiB, seed=3)
    node = await NodeStore.open(cfg)
    await node.writer.put(big + rounds)
    await node.close()
    async with checked(await NodeStore.open(cfg)) as node:  # DRAM empty: every block on disk only
        for n, (h, _) in enumerate(rounds):
            h2, p2 = _rewrite(h, 256 * KiB, seed=100 + n)
            filler = make_blocks(2, nbytes=1 * MiB, seed=200 + n)  # fills DRAM (whatever it held)
            assert [r.tier for r in await node.writer.put(filler)] == ["dram", "dram"]
            hogs = [
                asyncio.create_task(node.reader.read([b.key], [bytearray(b.payload_len)])) for b, _ in big * 2
            ]
            lease_task = asyncio.create_task(node.leaser.lease([h.key]))
            await asyncio.sleep(0)  # the lease has taken the old length; its read waits
            node.state.pin([f.key for f, _ in filler])  # nothing to evict: the rewrite goes to disk
            assert await node.delete([h.key]) == [True]
            [pr] = await node.writer.put([(h2, p2)])
            assert pr.tier == "disk"
            node.state.unpin([f.key for f, _ in filler])
            [lease] = await lease_task
            await asyncio.gather(*hogs)
            if lease is not None:
                assert lease.view.nbytes == lease.header.payload_len, "view and header disagree"
                assert checksum(lease.view) == lease.header.checksum, "bytes of another copy"
                node.state.release([lease])
            node.check()
            rep = await node.inspector.verify()
            assert rep["corrupt"] == [], rep
            got = await node.inspector.describe(h.key)
            assert got is not None and got[0] == h2, "the new copy stays"
