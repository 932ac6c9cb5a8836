"""A well-behaved client's GET latency beside hostile ones (docs/security.md).

One `kvstore serve` daemon on loopback with two tenants. The good tenant GETs 1 MiB blocks
one at a time (kvstore.client.node, checksum-verified) and its p50/p99 latency is measured:
  alone     nothing else connected
  hostile   beside 5 stalled PUTs (each sent 1 of 4 MiB, then nothing), 5 stalled GETs (each
            read 64 KiB of a 4 MiB reply, then nothing) and 1,000 idle authenticated
            connections of the other tenant
then beside each attack of issue 22, one at a time (the good tenant's p99 against its p99
alone measured just before that attack; 20 new good connections + HELLO each, counted; the
daemon's RSS growth):
  preauth_flood   connections re-opened from 127.0.0.2 at ~50/s, never sending HELLO
  header_cpu      pre-auth 64 KiB frames of empty msgpack maps, ~62 frames/s
  header_memory   8 authenticated PUTs behind ~4 MiB headers, their payloads stalled
  discard         64 EXISTS announcing 60 MiB payloads, stalled after 1 KiB
  leases          the bad tenant holds 24,576 leases (6 connections x 4,096)
  reserve         the bad tenant RESERVEs 2,048 x 1 MiB, never written (the good tenant's
                  DRAM blocks left in DRAM are counted)
  admin_flood     500 idle admin connections from 127.0.0.2 (/healthz probes counted)
and each attack of issue 34:
  ns_flood        the bad tenant writes 2 x 1 MiB blocks in each of 240 fresh namespaces (HELLOs
                  of 60), 480 MiB into a 512 MiB DRAM where the good tenant holds 80 MiB, 16 MiB
                  of it never read (how many of those 16 stay is the data lost: shares must
                  count tenants, not namespaces)
  metrics_scrape  the operator scrapes /metrics and /v1/stats every 0.25 s while those
                  namespaces are held (the scrape's size is reported)
  tiny_blocks     the bad tenant writes 50,000 blocks of 4 bytes (the index RAM they cost:
                  RSS growth, and the good tenant's misses)
  foreign_exists  the bad tenant EXISTS the good tenant's keys and absent ones, interleaved,
                  400 of each (the AUC of the two latency distributions: 0.5 tells nothing)
  admin_parse     ~200 requests/s with a 9,000-byte header line to the admin port from
                  127.0.0.2 (the daemon's log lines and bad_http count)
  pipeline        32 bad connections each pipeline 16 GETs of a 1 MiB block and never read
                  (the daemon's unacknowledged send queue, summed: what non-readers hold)
Target: p99 beside the hostile clients within 2x of p99 alone; new connections 100%
admitted. Prints a table and writes JSON (--json). Bounded: a fixed number of GETs per
phase, a few minutes in all.

    python bench/hostile.py --json .bench/hostile.json
"""

from __future__ import annotations

import argparse
import asyncio
import random
import resource
import signal
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import common  # noqa: E402
from common import pct  # noqa: E402
from daemonutil import rss_bytes  # noqa: E402 - tests/daemonutil.py
from hostile_attacks import (  # noqa: E402
    ATTACKS,
    BAD,
    GOOD,
    IDLE,
    NS,
    OPERATOR,
    STALLED,
    MiB,
    _admin_counter,
    _admitted,
    _block,
    _healthz,
    _hostile,
)

from kvstore.client.config import ClientConfig  # noqa: E402
from kvstore.client.node import NodeClient  # noqa: E402
from kvstore.client.read import get_into  # noqa: E402
from kvstore.results import Status  # noqa: E402


def _start(tmp: Path) -> common.Daemon:
    """The daemon under attack: DRAM only, two tenants and an operator, room for the idle
    connections."""
    (tmp / "tokens").write_text(f"{GOOD} good\n{BAD} bad\n{OPERATOR} *\n")
    (tmp / "secret").write_text("bench-hostile-salt-secret-0123456789\n")
    return common.start_daemon(
        tmp / "daemon",
        dram={"capacity": "512MiB", "slab_size": "4MiB"},
        auth={"token_file": str(tmp / "tokens"), "salt_secret_file": str(tmp / "secret")},
        limits={"max_conns_per_tenant": IDLE + 64, "max_unauthenticated": 64},
    )


async def _latencies(client: NodeClient, keys, n: int, misses: list[int] | None = None) -> list[float]:
    """``n`` GET latencies; a GET that misses fails the phase unless ``misses`` counts them
    (an attack that takes the good tenant's blocks is a result, not a crash)."""
    buf = np.empty(MiB, dtype=np.uint8)
    out = []
    rng = random.Random(7)
    for _ in range(n):
        k = keys[rng.randrange(len(keys))]
        t0 = time.perf_counter()
        [r] = await get_into(client, [k], [buf])
        out.append(time.perf_counter() - t0)
        if misses is not None:
            misses[0] += r.status is not Status.HIT
        else:
            assert r.status is Status.HIT, r
    return out


def _pct(xs: list[float], q: float) -> float:
    """The ``q`` percentile of ``xs`` (seconds), in ms."""
    return pct(xs, q / 100) * 1e3


async def _run(ports: dict, pid: int, gets: int, only: set[str]) -> dict:
    port = ports["data_port"]
    good = NodeClient(
        f"127.0.0.1:{port}", ClientConfig(token=GOOD, namespaces=(NS,), pool_size=1, op_timeout_s=10)
    )
    gns = await good.tenant_namespace(NS)
    blocks = [_block(gns, MiB, i) for i in range(64)]
    assert all(r.status is Status.STORED for r in await good.put(blocks))
    keys = [h.key for h, _ in blocks]
    # 16 more the good tenant never reads: the oldest in DRAM, the first a flood would evict
    cold = [_block(gns, MiB, 100 + i) for i in range(16)]
    assert all(r.status is Status.STORED for r in await good.put(cold))
    await _latencies(good, keys, 50)  # warm-up
    alone = await _latencies(good, keys, gets)
    t0 = time.perf_counter()
    socks = await asyncio.to_thread(_hostile, port)
    setup_s = time.perf_counter() - t0
    hostile = await _latencies(good, keys, gets)
    for s in socks:
        s.close()
    rows = {
        "alone": {"p50_ms": _pct(alone, 50), "p99_ms": _pct(alone, 99)},
        "hostile": {"p50_ms": _pct(hostile, 50), "p99_ms": _pct(hostile, 99)},
    }
    attacks = {}
    load_before = common.loadavg()
    for name, attack in ATTACKS.items():
        if only and name not in only:
            continue
        ctx: dict = {"good_keys": keys, "extra": {}}
        alone_now = await _latencies(good, keys, gets, [0])  # alone, just before this attack
        floor, floor50 = _pct(alone_now, 99), _pct(alone_now, 50)
        base = rss_bytes(pid)
        try:
            stop = await asyncio.to_thread(attack, ports, ctx)
        except (OSError, AssertionError, KeyError) as exc:  # the attack itself failed: say which
            attacks[name] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"{name}: the attack failed: {exc!r}", file=sys.stderr)
            continue
        await asyncio.sleep(1.0)  # the attack under way
        missed = [0]
        lat = await _latencies(good, keys, gets, missed)
        row = {
            "good_get_misses": missed[0],
            "p50_ms": _pct(lat, 50),
            "p99_ms": _pct(lat, 99),
            "alone_p50_ms": floor50,
            "alone_p99_ms": floor,
            "p50_ratio": _pct(lat, 50) / floor50,
            "p99_ratio": _pct(lat, 99) / floor,
            "admitted": await asyncio.to_thread(_admitted, port),
            "rss_growth_mib": round((rss_bytes(pid) - base) / MiB, 1),
        }
        if name == "reserve":
            row["good_blocks_in_dram"] = (await good.lookup(keys)).names().count("dram")
        if name == "ns_flood":  # data lost: the good tenant's cold blocks, 80 MiB in all, under its share
            row["good_cold_kept"] = (
                f"{sum(t is not None for t in (await good.lookup([h.key for h, _ in cold])).names())}/16"
            )
        if name == "admin_flood":
            row["healthz_ok"] = await asyncio.to_thread(_healthz, ports)
        if name == "admin_parse":
            row["admin_bad_http"] = await asyncio.to_thread(
                _admin_counter, ports, 'tierkv_admin_request_errors_total{kind="bad_http"}'
            )
        await asyncio.to_thread(stop)
        row.update(ctx["extra"])
        attacks[name] = row
    await good.close()
    return {
        "gets_per_phase": gets,
        "block_bytes": MiB,
        "stalled_puts": STALLED,
        "stalled_gets": STALLED,
        "idle_connections": IDLE,
        "hostile_setup_s": round(setup_s, 2),
        "phases": rows,
        "p99_ratio": rows["hostile"]["p99_ms"] / rows["alone"]["p99_ms"],
        "target_p99_ratio": 2.0,
        "attacks": attacks,
        "load_avg_before": load_before,
        "load_avg": common.loadavg(),
    }


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--gets", type=int, default=1000, help="GETs per phase")
    ap.add_argument("--attacks", default="", help="comma-separated attacks to run (default: all)")
    args = ap.parse_args()
    only = {a for a in args.attacks.split(",") if a}
    unknown = only - set(ATTACKS)
    if unknown:
        ap.error(f"unknown attacks {sorted(unknown)}; known: {', '.join(ATTACKS)}")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < IDLE + 200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4 * IDLE), hard))
    with tempfile.TemporaryDirectory() as tmp:
        daemon = _start(Path(tmp))
        try:
            res = asyncio.run(_run(daemon.ports, daemon.proc.pid, args.gets, only))
        finally:
            daemon.stop()
    p = res["phases"]
    print(f"{'phase':<9} {'p50 ms':>8} {'p99 ms':>8}")
    for name in ("alone", "hostile"):
        print(f"{name:<9} {p[name]['p50_ms']:>8.3f} {p[name]['p99_ms']:>8.3f}")
    ok = res["p99_ratio"] <= res["target_p99_ratio"]
    print(f"p99 hostile/alone = {res['p99_ratio']:.2f} (target <= 2.0: {'met' if ok else 'NOT met'})")
    print(
        f"\n{'attack':<14} {'p50 ms':>8} {'p99 ms':>8} {'p50/alone':>9} {'p99/alone':>9} {'admitted':>8} {'RSS +MiB':>8}  other"
    )
    for name, r in res["attacks"].items():
        if "error" in r:
            print(f"{name:<14} attack failed: {r['error']}")
            continue
        shown = (
            "good_blocks_in_dram",
            "healthz_ok",
            "good_get_misses",
            "good_cold_kept",
            "hellos_refused",
            "scrape_kib",
            "scrapes",
            "foreign_vs_absent_auc",
            "admin_bad_http",
            "kernel_unsent_mib",
        )
        other = {k: v for k, v in r.items() if k in shown and v is not None}
        print(
            f"{name:<14} {r['p50_ms']:>8.3f} {r['p99_ms']:>8.3f} {r['p50_ratio']:>9.2f} {r['p99_ratio']:>9.2f} "
            f"{r['admitted']:>5}/20 {r['rss_growth_mib']:>8.1f}  {other or ''}"
        )
    print(f"load average before the attacks {res['load_avg_before']}, after {res['load_avg']}")
    common.write_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
