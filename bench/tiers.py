"""Tier throughput beside its physical limit, measured in the same run.

For 2 MiB and 32 MiB blocks:
- DRAM put / get through the node (checksum on put, copy into the caller's buffer on get)
  against a plain memcpy of the same bytes (numpy copy between preallocated buffers);
- disk put / get through the node (LMDB, write-through; get verifies the xxh3 checksum)
  against raw sequential file write (+fsync when the tier syncs) / read of the same bytes.
Plus the index's memory per block at 1M blocks (tracemalloc), and slab waste for common block
sizes. Prints a table, writes JSON (``--json PATH``). Not a test: numbers, not asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
import tracemalloc

import common
import numpy as np
from storeutil import make_blocks  # tests/storeutil.py (common puts tests/ on the path)

from kvstore.config import load_store_config
from kvstore.keys import Namespace
from kvstore.node.store import NodeStore
from kvstore.node.tiers.arena import HostArena
from kvstore.node.tiers.memory import MemoryTier
from kvstore.node.tiers.slab import SlabAllocator

MiB = 1 << 20


def _best(fn, reps):
    """Median seconds of ``reps`` runs of ``fn`` (after one warm-up)."""
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


async def _time_node(node, blocks, keys, bufs, reps: int, batch: int) -> tuple[float, float]:
    """Best seconds of putting ``blocks`` into ``node`` (deleted first; ``batch`` blocks a put)
    and of getting them back into ``bufs`` (checked byte for byte); the node is closed after."""

    async def put() -> None:
        await node.delete(keys)
        for i in range(0, len(blocks), batch):
            await node.writer.put(blocks[i : i + batch])

    async def get() -> None:
        await node.reader.read(keys, bufs)

    t_put, t_get = await _abest(put, reps), await _abest(get, reps)
    assert all(bytes(b) == p for b, (_, p) in zip(bufs, blocks))
    await node.close()
    return t_put, t_get


async def _abest(fn, reps):
    await fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        await fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


async def bench_size(nbytes: int, total: int, root: str, reps: int, sync: bool) -> list[dict]:
    n = max(4, total // nbytes)
    blocks = make_blocks(n, nbytes, seed=nbytes, ns=Namespace(f"bench-{nbytes}", "bfloat16", 16))
    gb = n * nbytes / 1e9
    rows = []
    srcs = [np.frombuffer(p, dtype=np.uint8) for _, p in blocks]
    dsts = [np.empty(nbytes, dtype=np.uint8) for _ in blocks]
    bufs = [memoryview(d) for d in dsts]

    def memcpy():
        for s, d in zip(srcs, dsts):
            np.copyto(d, s)

    t_memcpy = _best(memcpy, reps)

    # DRAM: capacity for all blocks (plus slack); disk off so only DRAM is timed
    cfg = load_store_config(
        None,
        {
            "dram.capacity": (n + 2) * max(nbytes, 32 * MiB),
            "dram.slab_size": max(nbytes, 32 * MiB),
            "disk.enabled": False,
            "dram.pin": "false",
        },
        env={},
    )
    keys = [h.key for h, _ in blocks]
    t_put, t_get = await _time_node(await NodeStore.open(cfg), blocks, keys, bufs, reps, len(blocks))
    rows.append(
        dict(tier="dram", block=nbytes, op="put", gbps=gb / t_put, baseline="memcpy", base_gbps=gb / t_memcpy)
    )
    rows.append(
        dict(tier="dram", block=nbytes, op="get", gbps=gb / t_get, baseline="memcpy", base_gbps=gb / t_memcpy)
    )

    # raw file baseline: sequential write (+fsync) and read of the same bytes
    raw = os.path.join(root, f"raw-{nbytes}")

    def raw_write():
        with open(raw, "wb") as f:
            for _, p in blocks:
                f.write(p)
            if sync:
                f.flush()
                os.fsync(f.fileno())

    def raw_read():
        with open(raw, "rb", buffering=0) as f:
            for b in bufs:
                f.readinto(b)

    t_raw_w = _best(raw_write, reps)
    t_raw_r = _best(raw_read, reps)

    # disk: DRAM off, so every op goes to LMDB; reads verify checksums
    dcfg = load_store_config(
        None,
        {
            "dram.capacity": 0,
            "disk.path": os.path.join(root, f"lmdb-{nbytes}"),
            "disk.capacity": 3 * n * nbytes,
            "disk.sync": sync,
        },
        env={},
    )
    t_dput, t_dget = await _time_node(await NodeStore.open(dcfg), blocks, keys, bufs, reps, 8)
    wlabel = "raw write+fsync" if sync else "raw write"
    rows.append(
        dict(tier="disk", block=nbytes, op="put", gbps=gb / t_dput, baseline=wlabel, base_gbps=gb / t_raw_w)
    )
    rows.append(
        dict(
            tier="disk", block=nbytes, op="get", gbps=gb / t_dget, baseline="raw read", base_gbps=gb / t_raw_r
        )
    )
    for r in rows:
        r["ratio"] = r["gbps"] / r["base_gbps"]
    return rows


def index_bytes_per_block(n: int) -> float:
    """tracemalloc bytes per block of a memory tier's index holding ``n`` blocks: the packed
    entry, the key, the header kept beside it (180 B) and the per-span key sets."""
    # 4 KiB slots, so header room (capacity / 16) is not what limits; the arena is never touched
    tier = MemoryTier("dram", HostArena(n * 4096 + 32 * MiB, "false"), 32 * MiB)
    keys = [os.urandom(16) for _ in range(n)]  # keys exist anyway (the caller's); not counted
    slots = [tier.reserve(os.urandom(180), 4096) for _ in range(n)]  # allocator state: not index
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for k, slot in zip(keys, slots):
        tier.commit(k, slot, 180, 4096)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    # the key and header objects are owned by the index from here on: count them too
    owned = sum(k.__sizeof__() + s[1].__sizeof__() for k, s in zip(keys, slots)) / n
    return (after - before) / n + owned


def slab_waste() -> list[dict]:
    """Per block size: its slot, the span (run of pages) its class takes, and the share of that
    span no payload byte uses (slack in slots + the tail the slots do not tile)."""
    out = []
    a = SlabAllocator(1 << 30, 32 * MiB)
    for label, nbytes in [
        ("2 MiB", 2 * MiB),
        ("1.5 MiB", 3 * MiB // 2),
        ("640 KiB", 640 << 10),
        ("64 KiB", 64 << 10),
        ("96 KiB", 96 << 10),
        ("4 MiB", 4 * MiB),
        ("Llama-3-8B, 16 tok, bf16", 32 * 2 * 16 * 8 * 128 * 2),
        ("SmolLM2-135M, 16 tok, fp32", 30 * 2 * 16 * 3 * 64 * 4),
        ("32 MiB", 32 * MiB),
    ]:
        slot = a.slot_size_for(nbytes)
        span = a.span_pages(nbytes) * a.page
        used = (span // slot) * nbytes
        out.append(dict(block=label, bytes=nbytes, slot=slot, span=span, waste=1 - used / span))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write results here")
    ap.add_argument(
        "--total-mib", type=int, default=256, help="bytes moved per measurement (default 256 MiB)"
    )
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--no-sync", action="store_true", help="disk tier without fsync (and raw writes without fsync)"
    )
    ap.add_argument("--index-blocks", type=int, default=1_000_000)
    a = ap.parse_args()
    rows = []
    load0 = common.loadavg()
    with tempfile.TemporaryDirectory(prefix="tierkv-bench-") as root:
        for nbytes in (2 * MiB, 32 * MiB):
            rows += asyncio.run(bench_size(nbytes, a.total_mib * MiB, root, a.reps, not a.no_sync))
    print(f"{'tier':5} {'block':>6} {'op':4} {'GB/s':>7}  {'baseline':16} {'GB/s':>7} {'ratio':>6}")
    for r in rows:
        print(
            f"{r['tier']:5} {r['block'] // MiB:>4}Mi {r['op']:4} {r['gbps']:7.2f}  {r['baseline']:16} {r['base_gbps']:7.2f} {r['ratio']:6.2f}"
        )
    idx = index_bytes_per_block(a.index_blocks)
    print(f"\nindex memory: {idx:.0f} bytes per block at {a.index_blocks:,} blocks")
    waste = slab_waste()
    print("\nslab waste (32 MiB slabs):")
    for w in waste:
        print(
            f"  {w['block']:28} slot {w['slot']:>10}  span {w['span'] // MiB:>3} MiB  waste {w['waste'] * 100:5.1f}%"
        )
    print(f"load average before {load0}, after {common.loadavg()}")
    doc = dict(
        sync=not a.no_sync,
        loadavg_start=load0,
        rows=rows,
        index_bytes_per_block=idx,
        index_blocks=a.index_blocks,
    )
    common.write_json(a.json, {**doc, "slab_waste": waste})


if __name__ == "__main__":
    main()
