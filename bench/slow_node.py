"""One slow node: request latency and lookup timeouts with a node behind a token bucket.

Three ``kvstore serve`` daemons on separate network namespaces (root only; the test suite's
helpers in tests/cluster), replicas=2, 20 prompts of 8 blocks of 32 KiB. A load of requests
(lookup of the longest prefix, then a read of the hit blocks, one at a time, deadline 1 s) runs
for --seconds with every node healthy, then for --seconds with one node shaped by ``tc tbf rate
2mbit burst 16kb`` (both directions). Reported per phase: p50/p99/max request latency, lookup
timeouts (a lookup that took the whole deadline), blocks missed, readmissions of the slow node,
each node's share of time in the client's healthy view (sampled every 20 ms) and the share of
writes (a fresh prompt every 4th request) acknowledged with ``replicas`` copies.
The same load runs once more with a health config shaped like the old one (a one-key probe, no
backoff, a late read given up at half the deadline) for comparison. Prints a table; --json writes it.

    sudo python bench/slow_node.py --seconds 20 --json .bench/slow_node.json
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import common  # noqa: E402
from common import pct  # noqa: E402

from kvstore.client.cluster import ClusterClient, ClusterConfig  # noqa: E402
from kvstore.client.read import get_into  # noqa: E402

DEADLINE_S = 1.0
NBYTES = 32 * 1024


async def sample_view(c: ClusterClient, stop: asyncio.Event, inview: dict[str, int], n: list[int]) -> None:
    while not stop.is_set():
        live = set(c.live_addrs())
        for a in inview:
            inview[a] += a in live
        n[0] += 1
        await asyncio.sleep(0.02)


async def load(c: ClusterClient, prompts, seconds: float, fresh) -> dict:
    """Requests for ``seconds``; every 4th also stores a fresh prompt (``fresh(i)``), so the
    share of writes with ``replicas`` copies is measured beside time in view per node."""
    lat, lookup_timeouts, missed, n = [], 0, 0, 0
    copies: list[int] = []
    stop = asyncio.Event()
    inview, samples = {a: 0 for a in c.nodes}, [0]
    sampler = asyncio.create_task(sample_view(c, stop, inview, samples))
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        p = prompts[n % len(prompts)]
        n += 1
        if n % 4 == 0:
            copies += (await c.put(fresh(n), DEADLINE_S)).copies
        keys = [h.key for h, _ in p]
        t0 = time.perf_counter()
        got = (await c.lookup(keys, DEADLINE_S)).hit_blocks
        if time.perf_counter() - t0 >= DEADLINE_S * 0.95:
            lookup_timeouts += 1
        bufs = [bytearray(NBYTES) for _ in range(got)]
        res = await get_into(c, keys[:got], bufs, None, DEADLINE_S)
        lat.append((time.perf_counter() - t0) * 1e3)
        missed += len(keys) - sum(r.status.ok for r in res)
    stop.set()
    await sampler
    replicas = c.cfg.replicas
    return {
        "time_in_view": {a: round(v / max(1, samples[0]), 4) for a, v in inview.items()},
        "min_time_in_view": round(min(v / max(1, samples[0]) for v in inview.values()), 4),
        "writes_with_replicas_copies": round(sum(x >= replicas for x in copies) / max(1, len(copies)), 4),
        "requests": n,
        "p50_ms": round(statistics.median(lat), 2),
        "p99_ms": round(pct(lat, 0.99), 2),
        "max_ms": round(max(lat), 2),
        "lookup_timeouts": lookup_timeouts,
        "blocks_missed": missed,
    }


async def phase(hosts, ds, prompts, cfg: ClusterConfig, seconds: float, name: str, fresh) -> list[dict]:
    c = ClusterClient.static([d.addr for d in ds], hosts.client_cfg(op_timeout_s=DEADLINE_S), cfg)
    await c.start(5.0)
    for p in prompts:
        assert all(r.status.ok for r in await c.put(p, 5.0))
    base = await load(c, prompts, seconds, lambda i: fresh(name, "base", i))
    hosts.net.shape(ds[1].host, "2mbit", "16kb")
    before = c.counters["marked_up"]
    slow = await load(c, prompts, seconds, lambda i: fresh(name, "slow", i))
    slow["readmitted"] = c.counters["marked_up"] - before
    hosts.net.heal(ds[1].host)
    await c.close()
    return [
        {"health": name, "phase": "baseline", **base},
        {
            "health": name,
            "phase": "one node at 2mbit",
            **slow,
            "p99_x_baseline": round(slow["p99_ms"] / base["p99_ms"], 2),
        },
    ]


async def run(tmp: Path, seconds: float) -> list[dict]:
    from cluster.cluster_hosts import TENANT_NS, Cluster
    from cluster.cluster_netns import cannot_make_namespaces
    from storeutil import make_blocks

    why = cannot_make_namespaces()
    if why:
        raise SystemExit(f"bench/slow_node.py: {why}")
    hosts = Cluster(tmp)
    try:
        ds = [hosts.start_node() for _ in range(3)]
        prompts = [make_blocks(8, NBYTES, seed=100 + i, ns=TENANT_NS) for i in range(20)]

        def fresh(health: str, part: str, i: int):
            seed = 1_000_000 * (1 + len(health) % 7) + 100_000 * (part == "slow") + i
            return make_blocks(8, NBYTES, seed=seed, ns=TENANT_NS)

        rows = await phase(
            hosts, ds, prompts, ClusterConfig(replicas=2, probe_interval_s=0.1), seconds, "data path", fresh
        )
        old = ClusterConfig(
            replicas=2,
            probe_interval_s=0.1,
            probe_keys=1,
            probe_rounds=1,
            eject_base_s=0.001,
            flap_window_s=0.001,
            outlier_factor=1e9,
            hedge_factor=1e-9,  # a late read is given up at half the deadline, as before
            hedge_floor_s=DEADLINE_S / 2,
        )
        rows += await phase(hosts, ds, prompts, old, seconds, "old-style (1-key probe, no backoff)", fresh)
        return rows
    finally:
        hosts.teardown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = asyncio.run(run(Path(tmp), args.seconds))
    cols = [
        "health",
        "phase",
        "requests",
        "p50_ms",
        "p99_ms",
        "max_ms",
        "lookup_timeouts",
        "blocks_missed",
        "readmitted",
        "p99_x_baseline",
        "min_time_in_view",
        "writes_with_replicas_copies",
    ]
    print(common.md_table(cols, [[r.get(k, "") for k in cols] for r in rows]))
    common.write_json(args.json, {"bench": "slow_node", "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
