"""Anti-entropy repair: time to full redundancy after a node is replaced, and the hit rate
of a second failure after the repair.

Three ``kvstore serve`` daemons on loopback form a static cluster (``cluster.peers``,
replicas=2, repair on with its default rate limit unless --rate is given). N blocks are
written through the cluster client, then node 0 is killed with kill -9, its disk wiped and
it is started again empty on the same address. Measured: seconds until every block has 2
copies again (EXISTS on every node, polled every 0.2 s), the repair's push rate, the read
latency of a client serving requests *during* the repair against the same client before the
failure (p50/p99: the repair must not starve serving), and, after the repair, the hit rate of
every block with node 1 killed as well. Prints a table; --json writes it.

    python bench/repair.py --blocks 4000 --json .bench/repair.json
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import common  # noqa: E402
from common import pct  # noqa: E402
from storeutil import make_blocks  # noqa: E402 - tests/storeutil.py (common puts tests/ on the path)

from kvstore.client.cluster import ClusterClient, ClusterConfig  # noqa: E402
from kvstore.client.config import ClientConfig  # noqa: E402
from kvstore.client.node import NodeClient  # noqa: E402
from kvstore.client.read import get_into  # noqa: E402
from kvstore.config import parse_size  # noqa: E402
from kvstore.keys import Namespace  # noqa: E402
from kvstore.member.peer_sessions import PEER_TENANT  # noqa: E402

NS = Namespace("bench-repair", "uint8", 16)
CFG = ClientConfig(namespaces=(NS,), op_timeout_s=5.0)


def start(wd: Path, port: int, peers: list[str], rate: str) -> common.Daemon:
    """A static cluster member on ``port`` with its disk under ``wd`` (kept across restarts)."""
    return common.start_daemon(
        wd,
        use_disk=True,
        dram={"capacity": "512MiB", "slab_size": "1MiB"},
        disk={"capacity": "2GiB", "sync": False},
        server={"data_port": port},
        cluster={"peers": peers},
        repair={"replicas": 2, "interval_s": 1.0, "settle_s": 0.2, "max_bytes_per_s": rate},
    )


async def copies(addrs: list[str], keys) -> list[int]:
    out = [0] * len(keys)
    for a in addrs:
        n = NodeClient(a, CFG)
        for off in range(0, len(keys), 4096):
            for i, t in enumerate((await n.lookup(keys[off : off + 4096], 10.0)).names()):
                out[off + i] += t is not None
        await n.close()
    return out


async def serve_reads(
    c: ClusterClient, blocks, nbytes: int, stop: asyncio.Event, lat: list, hits: list
) -> None:
    rnd = random.Random(3)
    while not stop.is_set():
        j = rnd.randrange(0, len(blocks) - 8)
        part = blocks[j : j + 8]
        bufs = [bytearray(nbytes) for _ in part]
        t0 = time.perf_counter()
        res = await get_into(c, [h.key for h, _ in part], bufs, None, 2.0)
        lat.append((time.perf_counter() - t0) * 1e3)
        hits.append(sum(r.status.ok and bytes(b) == p for r, b, (_, p) in zip(res, bufs, part)) / len(part))
        await asyncio.sleep(0.005)


async def run(tmp: Path, n: int, nbytes: int, rate: str) -> dict:
    ports = [common.free_port() for _ in range(3)]
    addrs = [f"127.0.0.1:{p}" for p in ports]
    procs = [start(tmp / f"n{i}", ports[i], addrs, rate) for i in range(3)]
    try:
        probe = NodeClient(addrs[0], ClientConfig(tenant=PEER_TENANT, op_timeout_s=2.0))
        if await probe.stats(2.0) is None:
            raise SystemExit("the daemons refuse peer sessions (HELLO tenant '*'): repair cannot push")
        await probe.close()
        blocks = make_blocks(n, nbytes, seed=1, ns=NS)
        keys = [h.key for h, _ in blocks]
        c = ClusterClient.static(addrs, CFG, ClusterConfig(replicas=2))
        await c.start(5.0)
        for off in range(0, n, 256):
            r = await c.put(blocks[off : off + 256], 30.0)
            assert r.dropped == 0 and r.under_replicated == 0, r
        stop, base_lat, base_hits = asyncio.Event(), [], []
        t = asyncio.create_task(serve_reads(c, blocks, nbytes, stop, base_lat, base_hits))
        await asyncio.sleep(3.0)
        stop.set()
        await t
        held = sum(x > 0 for x in await copies(addrs[:1], keys))  # what the replacement must get back
        procs[0].kill9()
        shutil.rmtree(tmp / "n0" / "disk")
        t0 = time.monotonic()
        procs[0] = start(tmp / "n0", ports[0], addrs, rate)
        stop, rep_lat, rep_hits = asyncio.Event(), [], []
        t = asyncio.create_task(serve_reads(c, blocks, nbytes, stop, rep_lat, rep_hits))
        while (got := await copies(addrs, keys)) != [2] * n:
            if time.monotonic() - t0 > 600:
                raise RuntimeError(f"not repaired in 600 s: {sum(x == 2 for x in got)} of {n}")
            await asyncio.sleep(0.2)
        repair_s = time.monotonic() - t0
        stop.set()
        await t
        await c.close()
        procs[1].kill9()
        c = ClusterClient.static(addrs, CFG, ClusterConfig(replicas=2))
        ok = 0
        for off in range(0, n, 64):
            part = blocks[off : off + 64]
            bufs = [bytearray(nbytes) for _ in part]
            res = await get_into(c, [h.key for h, _ in part], bufs, None, 5.0)
            ok += sum(r.status.ok and bytes(b) == p for r, b, (_, p) in zip(res, bufs, part))
        await c.close()
        return {
            "blocks": n,
            "block_bytes": nbytes,
            "replaced_node_held": held,
            "rate_limit": rate,
            "repair_s": round(repair_s, 2),
            "repair_mib_per_s": round(held * nbytes / repair_s / 2**20, 1),
            "read_p50_ms_before": round(statistics.median(base_lat), 2),
            "read_p99_ms_before": round(pct(base_lat, 0.99), 2),
            "read_p50_ms_during_repair": round(statistics.median(rep_lat), 2),
            "read_p99_ms_during_repair": round(pct(rep_lat, 0.99), 2),
            "hit_rate_during_repair": round(statistics.mean(rep_hits), 4),
            "hit_rate_second_failure": round(ok / n, 4),
        }
    finally:
        for d in procs:
            d.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=4000)
    ap.add_argument("--block-bytes", type=lambda v: parse_size(v, "--block-bytes"), default=64 * 1024)
    ap.add_argument("--rate", default="64MiB", help="repair.max_bytes_per_s of every node")
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        row = asyncio.run(run(Path(tmp), args.blocks, args.block_bytes, args.rate))
    for k, v in row.items():
        print(f"{k:>28}  {v}")
    common.write_json(args.json, {"bench": "repair", "nodes": 3, "rows": [row]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
