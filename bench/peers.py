"""Fetch and store of a whole prefix: tierkv beside the raw socket, Redis and Mooncake Store.

One client process (this one), blocks held by one server process on loopback, fetched into
preallocated buffers and stored from them. Per block size (2 MiB x 256, 32 MiB x 32,
256 KiB x 2,048) and round (interleaved, ``--rounds``), each peer fetches and stores the whole
prefix once:

  raw-1 / raw-4    blocking sendall -> recv_into, 1 or 4 connections (the limit for any TCP store)
  tierkv-1 / -4    ``kvstore serve`` (DRAM only), NodeClient get_into / put with streams=1 or 4
                   (every payload checksum-verified by the client)
  raw-Kp/tierkv-Kp with ``--clients K`` (default 8): K client processes at once, each with a
                   connection of its own and count/K blocks of its own (many engine workers on
                   one storage node); GB/s is all their bytes over the slowest one's time
  tierkv:P-1       with ``--policies P,...``: one more daemon per eviction policy P, measured
                   interleaved with the rest (the eviction order's per-op cost; each ratio
                   is to tierkv-1, which runs the default policy)
  redis            redis-server (no persistence), redis-py pipelined GET / SET (copied into
                   the same buffers)
  mooncake         Mooncake Store over its TCP protocol (bench/peers_mooncake.py in the peers
                   venv, ``make peers``), batch_get_into / batch_put_from registered buffers,
                   inside a private network namespace (``unshare --net``, only lo up); every
                   fetched block is compared with what was stored, failures reported

The stores themselves: bench/peer_stores.py. GB/s per peer (median of rounds), its ratio to
raw-1 (raw-4 for the striped tierkv), and the client's and server's CPU seconds per GB. Absent
peers are skipped with a note. JSON with every round and the load average (``--json``).

    python bench/peers.py --json docs/results/peers.json
    python bench/peers.py --peers redis --sizes 2048 --policies lru --rounds 3   # policy cost
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import common
import numpy as np
from common import cpu_s
from peer_stores import Mooncake, Procs, Raw, Redis, Tierkv, mooncake_absent

MiB = 1 << 20
KiB = 1 << 10
SIZES = [(2 * MiB, 256), (32 * MiB, 32), (256 * KiB, 2048)]


def _timed(fn, server_pid: int | None) -> tuple[float, float, float, int]:
    """(seconds, client CPU s, server CPU s, failures) of the blocking call ``fn()``."""
    srv0 = cpu_s(server_pid) if server_pid else 0.0
    c0, t0 = time.process_time(), time.perf_counter()
    bad = fn()
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    return dt, cpu, (cpu_s(server_pid) - srv0 if server_pid else 0.0), bad


async def _atimed(coro_fn, server_pid: int) -> tuple[float, float, float, int]:
    srv0 = cpu_s(server_pid)
    c0, t0 = time.process_time(), time.perf_counter()
    bad = await coro_fn()
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    return dt, cpu, cpu_s(server_pid) - srv0, bad


def _procs_timed(procs: Procs, cmd: str, server_pid: int) -> tuple[float, float, float, int]:
    """(seconds of the slowest client, client CPU s of all, server CPU s, failures) of ``cmd``."""
    srv0 = cpu_s(server_pid)
    secs, cpu, bad = procs.run(cmd)
    return secs, cpu, cpu_s(server_pid) - srv0, bad


async def bench_size(
    size: int,
    count: int,
    rounds: int,
    peers: set[str],
    policies: list[str],
    clients: list[int],
    notes: list[str],
) -> list[dict]:
    nbytes = size * count
    src = np.random.default_rng(size).integers(0, 256, (count, size), dtype=np.uint8)
    dst = np.ones((count, size), np.uint8)  # touched: no first-fetch page faults
    samples: dict[tuple[str, str], list[tuple]] = {}
    runners: dict[str, tuple] = {}  # name -> (fetch, store, after_store)
    closers = []
    kvs: list[Tierkv] = []
    with tempfile.TemporaryDirectory() as td:
        try:
            raws: dict[int, Raw] = {}
            for k in (1, 4):
                raw = raws[k] = Raw(nbytes, k)
                closers.append(raw.close)
                runners[f"raw-{k}"] = (
                    lambda raw=raw: _timed(lambda: raw.run(b"G", dst), raw.pid),
                    lambda raw=raw: _timed(lambda: raw.run(b"P", src), raw.pid),
                    None,
                )
            for policy in ["", *policies]:
                kv = Tierkv(
                    Path(td) / (policy or "default"),
                    size,
                    count,
                    src,
                    [1] if policy else [1, 4],
                    policy,
                    copies=3 if clients and not policy else 2,
                )
                kvs.append(kv)
                await kv.start()
                for s in kv.streams:
                    runners[f"tierkv{':' + policy if policy else ''}-{s}"] = (
                        lambda s=s, kv=kv: _atimed(lambda: kv.fetch(s, dst), kv.pid),
                        lambda s=s, kv=kv: _atimed(lambda: kv.store(s, dst), kv.pid),
                        lambda s=s, kv=kv: kv.after_store(s),
                    )
            for k in clients:  # k client processes, each its own connection and count/k blocks
                for name, server in (("raw", raws[1]), ("tierkv", kvs[0])):
                    procs = Procs(name, server.addr, size, count, k)
                    closers.append(procs.close)
                    runners[f"{name}-{k}p"] = (
                        lambda p=procs, pid=server.pid: _procs_timed(p, "fetch", pid),
                        lambda p=procs, pid=server.pid: _procs_timed(p, "store", pid),
                        (lambda p=procs: p.run("after")) if name == "tierkv" else None,
                    )
            if "redis" in peers:
                rd = Redis(src)
                closers.append(rd.close)
                runners["redis"] = (
                    lambda: _timed(lambda: rd.fetch(dst), rd.pid),
                    lambda: _timed(lambda: rd.store(dst), rd.pid),
                    rd.after_store,
                )
            if "mooncake" in peers:
                try:
                    mc = Mooncake(size, count)
                    closers.append(mc.close)

                    def mc_op(op):
                        r = mc.call(op)
                        return r["s"], r["client_cpu"], r["server_cpu"], r["failures"]

                    runners["mooncake"] = (
                        lambda: mc_op("fetch"),
                        lambda: mc_op("store"),
                        lambda: mc.call("clean"),
                    )
                except Exception as exc:  # reported, not hidden
                    notes.append(f"mooncake at {size // KiB} KiB: {exc}")
            for rnd in range(-1, rounds):  # round -1 warms every peer up and is not counted
                for name, (fetch, store, after) in runners.items():
                    for op, fn in (("fetch", fetch), ("store", store)):
                        got = fn()
                        if asyncio.iscoroutine(got):
                            got = await got
                        if rnd >= 0:
                            samples.setdefault((name, op), []).append(got)
                        if op == "store" and after is not None:
                            a = after()
                            if asyncio.iscoroutine(a):
                                await a
                print(f"{size // KiB} KiB x{count} round {rnd + 1}/{rounds} done", flush=True)
        finally:
            for kv in kvs:
                await kv.close()
            for c in closers:
                c()
    rows = []
    for (name, op), ss in samples.items():
        secs = statistics.median(s[0] for s in ss)
        rows.append(
            {
                "block_kib": size // KiB,
                "blocks": count,
                "peer": name,
                "op": op,
                "gbps": nbytes / secs / 1e9,
                "client_cpu_s_per_gb": statistics.median(s[1] for s in ss) / (nbytes / 1e9),
                "server_cpu_s_per_gb": statistics.median(s[2] for s in ss) / (nbytes / 1e9),
                "failures": sum(s[3] for s in ss),
                "rounds_s": [round(s[0], 4) for s in ss],
            }
        )
    base = {(r["op"], r["peer"]): r["gbps"] for r in rows}
    for r in rows:
        peer = r["peer"]
        ref = "tierkv-1" if peer.startswith("tierkv:") else "raw-" + peer.rpartition("-")[2]
        ref = ref if (r["op"], ref) in base else "raw-1"  # redis, mooncake
        r["vs_raw"] = r["gbps"] / base[(r["op"], ref)]
        r["raw_ref"] = ref
    return rows


def table(rows: list[dict]) -> str:
    """One row per block size, op and peer: GB/s, its ratio to its reference (raw-1, raw-4 for
    4 streams, raw-Kp for K client processes, tierkv-1 for a policy), CPU s per GB of client
    and server beside the raw's."""
    by = {(r["block_kib"], r["op"], r["peer"]): r for r in rows}

    def row(r: dict) -> tuple:
        kib = r["block_kib"]
        raw = by[(kib, r["op"], r["raw_ref"] if r["raw_ref"].startswith("raw") else "raw-1")]
        cpu = [f"{r[k]:.2f} ({raw[k]:.2f})" for k in ("client_cpu_s_per_gb", "server_cpu_s_per_gb")]
        blocks = f"{r['blocks']} x {kib // 1024} MiB" if kib >= 1024 else f"{r['blocks']} x {kib} KiB"
        return (
            blocks,
            r["op"],
            r["peer"],
            f"{r['gbps']:.2f}",
            f"{r['vs_raw']:.2f} ({r['raw_ref']})",
            *cpu,
            r["failures"],
        )

    header = [
        "blocks",
        "op",
        "peer",
        "GB/s",
        "/ ref",
        "client CPU s/GB (raw's)",
        "server CPU s/GB (raw's)",
        "failures",
    ]
    return common.md_table(header, [row(r) for r in rows])


async def amain(args) -> int:
    notes: list[str] = []
    peers = set(args.peers.split(","))
    if "redis" in peers and not shutil.which("redis-server"):
        notes.append("redis skipped: no redis-server on PATH")
        peers.discard("redis")
    if "redis" in peers:
        try:
            import redis  # noqa: F401
        except ImportError:
            notes.append("redis skipped: redis-py not installed")
            peers.discard("redis")
    if "mooncake" in peers and (why := mooncake_absent()):
        notes.append(f"mooncake skipped: {why}")
        peers.discard("mooncake")
    load_before = common.loadavg()
    print(f"load average (1, 5, 15 min) before: {load_before}", flush=True)
    rows = []
    sizes = [s for s in SIZES if str(s[0] // KiB) in args.sizes.split(",")] if args.sizes else SIZES
    policies = [p for p in args.policies.split(",") if p]
    clients = [int(k) for k in args.clients.split(",") if k and int(k) > 1]
    for size, count in sizes:
        rows += await bench_size(size, count, args.rounds, peers, policies, clients, notes)
    load = {"before": load_before, "after": common.loadavg()}
    doc = {
        "python": sys.version.split()[0],
        "rounds": args.rounds,
        "load_avg": load,
        "notes": notes,
        "rows": rows,
    }
    print()
    print(table(rows))
    for n in notes:
        print("note:", n)
    print(f"load average (1, 5, 15 min): before {load['before']}, after {load['after']}")
    common.write_json(args.json, doc)
    return 0


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--peers", default="redis,mooncake", help="besides raw and tierkv")
    ap.add_argument("--sizes", default="", help="block sizes in KiB to run (default all: 2048,32768,256)")
    ap.add_argument("--policies", default="", help="eviction policies, one more daemon each (tierkv:P-1)")
    ap.add_argument(
        "--clients", default="8", help="client process counts besides 1 (raw-Kp, tierkv-Kp); '' for none"
    )
    return asyncio.run(amain(ap.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
