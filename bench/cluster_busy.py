"""Idle under load: a cluster with no fault at all, next to CPU burners (issue 23).

Three ``kvstore serve`` daemons on loopback (tests/daemonutil.py), replicas=2, one cluster
client with ``--workers`` concurrent request streams (store a prompt of 8 x 32 KiB blocks,
then look up the longest prefix under the connector's 0.2 s lookup deadline and read it and
two older prompts, every byte compared). The same load runs twice in one process: ``idle``
(the floor of this run) and ``busy``, with ``--burners`` processes spinning on the CPU next to
the daemons (the host's load average is recorded). Nothing is injected. Reported per phase:
each node's share of time in the client's healthy view (sampled every 20 ms), the share of
writes acknowledged with ``replicas`` copies, the hit rate, request p50/p99, the client's
worst loop lag, and ejections by reason. Target: every node in the view >= 95% of the time,
>= 99% of writes with ``replicas`` copies.

    python bench/cluster_busy.py --seconds 30 --json docs/results/cluster_busy_<date>.json

Runs on any code of the client (it only samples ``live_addrs()``), so the same file measures
an older checkout for comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import common  # noqa: E402
from common import pct  # noqa: E402
from slow_node import sample_view  # noqa: E402

from kvstore.client.cluster import ClusterClient, ClusterConfig  # noqa: E402
from kvstore.client.config import ClientConfig  # noqa: E402
from kvstore.keys import Namespace  # noqa: E402

NS = Namespace("bench-busy", "uint8", 4)
NBYTES = 32 * 1024
BLOCKS = 8
LOOKUP_DEADLINE_S = 0.2


def burn(stop) -> None:
    """Spin on the CPU until ``stop`` is set (a process: a real competitor for the cores)."""
    x = 0
    while not stop.is_set():
        for _ in range(100_000):
            x = (x * 31 + 7) % 1_000_003


class Tally:
    def __init__(self) -> None:
        self.copies: list[int] = []
        self.hits = self.wanted = self.wrong = 0
        self.lat_ms: list[float] = []


async def worker(c: ClusterClient, w: int, phase: int, t_end: float, tally: Tally, replicas: int) -> None:
    from storeutil import make_blocks, read_back

    stored: list = []
    seed = 0
    while time.monotonic() < t_end:
        seed += 1
        prompt = make_blocks(BLOCKS, NBYTES, seed=10_000_000 * phase + 100_000 * (w + 1) + seed, ns=NS)
        rep = await c.put(prompt, 1.0)
        tally.copies += list(rep.copies)
        stored.append(prompt)
        for p in (stored[-1], stored[seed // 2], stored[seed // 3]):
            t0 = time.perf_counter()
            hits, wrong = await read_back(c, p, LOOKUP_DEADLINE_S, 1.0)
            tally.lat_ms.append((time.perf_counter() - t0) * 1e3)
            tally.hits += hits
            tally.wrong += wrong
            tally.wanted += len(p)


async def loop_lag(stop: asyncio.Event, out: list[float]) -> None:
    while not stop.is_set():
        t0 = time.monotonic()
        await asyncio.sleep(0.01)
        out.append(max(0.0, time.monotonic() - t0 - 0.01))


async def phase(addrs: list[str], name: str, number: int, seconds: float, workers: int) -> dict:
    replicas = 2
    cfg = ClientConfig(namespaces=(NS,), op_timeout_s=2.0, connect_timeout_s=1.0, probe_interval_s=0.1)
    c = ClusterClient.static(addrs, cfg, ClusterConfig(replicas=replicas))
    await c.start(5.0)
    stop = asyncio.Event()
    inview = dict.fromkeys(addrs, 0)
    samples = [0]
    lags: list[float] = []
    tasks = [
        asyncio.create_task(sample_view(c, stop, inview, samples)),
        asyncio.create_task(loop_lag(stop, lags)),
    ]
    tally = Tally()
    t_end = time.monotonic() + seconds
    await asyncio.gather(*(worker(c, w, number, t_end, tally, replicas) for w in range(workers)))
    stop.set()
    await asyncio.gather(*tasks)
    counters = c.counters
    await c.close()
    full = sum(1 for x in tally.copies if x >= replicas) / max(1, len(tally.copies))
    return {
        "phase": name,
        "load_avg_1m": common.loadavg()[0],
        "requests": len(tally.lat_ms),
        "p50_ms": round(statistics.median(tally.lat_ms), 2),
        "p99_ms": round(pct(tally.lat_ms, 0.99), 2),
        "loop_lag_p99_ms": round(pct(lags, 0.99) * 1e3, 1),
        "loop_lag_max_ms": round(max(lags) * 1e3, 1),
        "time_in_view": {a: round(v / max(1, samples[0]), 4) for a, v in inview.items()},
        "min_time_in_view": round(min(v / max(1, samples[0]) for v in inview.values()), 4),
        "writes_with_replicas_copies": round(full, 4),
        "blocks_written": len(tally.copies),
        "hit_rate": round(tally.hits / max(1, tally.wanted), 4),
        "wrong_bytes": tally.wrong,
        "ejections": {k: v for k, v in sorted(counters.items()) if k.startswith(("ejected_", "readmitted_"))},
        "marked_down": counters.get("marked_down", 0),
        "slow_kept_for_floor": counters.get("slow_kept_for_floor", 0),
    }


async def run(tmp: Path, seconds: float, workers: int, burners: int) -> list[dict]:
    from daemonutil import launch_daemon

    ds = [launch_daemon(tmp / f"n{i}", use_disk=False) for i in range(3)]
    try:
        addrs = [d.addr for d in ds]
        rows = [await phase(addrs, "idle (floor)", 1, seconds, workers)]
        ctx = multiprocessing.get_context("spawn")
        stop = ctx.Event()
        procs = [ctx.Process(target=burn, args=(stop,), daemon=True) for _ in range(burners)]
        for p in procs:
            p.start()
        try:
            await asyncio.sleep(2.0)  # let the load average rise
            rows.append(await phase(addrs, f"busy ({burners} CPU burners)", 2, seconds, workers))
        finally:
            stop.set()
            for p in procs:
                p.join(5)
        return rows
    finally:
        for d in ds:
            d.stop(10)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--burners", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = asyncio.run(run(Path(tmp), args.seconds, args.workers, args.burners))
    cols = [
        "phase",
        "load_avg_1m",
        "requests",
        "p50_ms",
        "p99_ms",
        "loop_lag_p99_ms",
        "min_time_in_view",
        "writes_with_replicas_copies",
        "hit_rate",
        "marked_down",
    ]
    print(common.md_table(cols, [[r.get(k, "") for k in cols] for r in rows]))
    for r in rows:
        print(r["phase"], "time in view", r["time_in_view"], "ejections", r["ejections"])
    common.write_json(
        args.json,
        {
            "bench": "cluster_busy",
            "seconds": args.seconds,
            "workers": args.workers,
            "burners": args.burners,
            "rows": rows,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
