"""How many connections one batch should be split over (``ClientConfig.streams``) and how
many frames one connection pipelines (``ClientConfig.pipeline``): tierkv fetch and store of a
whole prefix with streams 1, 2 and 4 (``--pipeline``: with one stream and these depths),
interleaved, per block size.

Uses bench/peers.py's tierkv runner (one ``kvstore serve``, DRAM only, one client process).
Prints the median GB/s and every round, and the client's and daemon's CPU seconds per GB
(median); the ratios between the columns are what count. ``--sizes`` limits the block sizes.

    python bench/peers_streams.py --rounds 5
    python bench/peers_streams.py --rounds 5 --pipeline 1,2,4,8
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers  # noqa: E402

STREAMS = (1, 2, 4)


async def one(size: int, count: int, rounds: int, depths: list[int]) -> None:
    src = np.random.default_rng(1).integers(0, 256, (count, size), dtype=np.uint8)
    dst = np.ones((count, size), np.uint8)
    res: dict[tuple[str, int], list[float]] = {}
    cpu: dict[tuple[str, int], list[float]] = {}  # client and daemon CPU s/GB per round
    with tempfile.TemporaryDirectory() as td:
        kv = peers.Tierkv(Path(td), size, count, src, list(STREAMS))
        await kv.start()
        variants = list(STREAMS)
        if depths:  # one stream at each pipelining depth instead
            from kvstore.client.node import ClientConfig, NodeClient

            for c in kv.clients.values():
                await c.close()
            kv.clients = {
                d: NodeClient(
                    kv.addr, ClientConfig(namespaces=(kv.ns,), streams=1, pipeline=d, op_timeout_s=120)
                )
                for d in depths
            }
            variants = depths
        for s in variants:  # warm-up, not counted
            await kv.fetch(s, dst)
            await kv.store(s, dst)
            await kv.after_store(s)
        for _ in range(rounds):
            for s in variants:
                for op in ("fetch", "store"):
                    t0, c0, d0 = time.perf_counter(), time.process_time(), peers.cpu_of(kv.pid)
                    bad = await (kv.fetch(s, dst) if op == "fetch" else kv.store(s, dst))
                    gb = size * count / 1e9
                    res.setdefault((op, s), []).append(gb / (time.perf_counter() - t0))
                    cpu.setdefault((op, s), []).append((time.process_time() - c0) / gb)
                    cpu.setdefault((op, -s), []).append((peers.cpu_of(kv.pid) - d0) / gb)
                    assert bad == 0, f"{op} streams={s}: {bad} blocks failed"
                    if op == "store":
                        await kv.after_store(s)
        await kv.close()
    for (op, s), v in sorted(res.items()):
        what = f"pipeline={s}" if depths else f"streams={s}"
        print(
            f"{size >> 10} KiB x{count} {op} {what}: {statistics.median(v):.2f} GB/s {[round(x, 2) for x in v]}"
            f"  client CPU {statistics.median(cpu[op, s]):.2f} s/GB, daemon {statistics.median(cpu[op, -s]):.2f} s/GB"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pipeline", default="", help="pipelining depths to compare (one stream), e.g. 1,2,4,8")
    ap.add_argument("--sizes", default="", help="block sizes in KiB to run (default all: 2048,32768,256)")
    args = ap.parse_args()
    depths = [int(d) for d in args.pipeline.split(",")] if args.pipeline else []
    sizes = {int(x) << 10 for x in args.sizes.split(",")} if args.sizes else None
    print(f"load average (1, 5, 15 min): {os.getloadavg()}")
    for size, count in peers.SIZES:
        if sizes is None or size in sizes:
            asyncio.run(one(size, count, args.rounds, depths))
    print(f"load average at the end: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
