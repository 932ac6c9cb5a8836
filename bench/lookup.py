"""Longest-prefix lookup latency of a 128K-token prompt (8,192 keys) on loopback.

The prompt is cut into blocks of 16 tokens (8,192 keys); its blocks are stored on 1 and on 3
``kvstore serve`` daemons (DRAM only, 1 KiB payloads: lookups only send keys; replicas=2).
Then the connector's lookup through the store facade is timed: ``StoreClient.lookup`` of the
packed keys (one :class:`~kvstore.keys.KeyBatch`), the held prefix of its tier codes. Each key
goes to its owners (one packed EXISTS per node of at most 16,384 keys, in parallel), the
keys no owner holds then to the next ``lookahead`` node. Cases: all, half and none of the
prompt present. Per case: wall-time percentiles of repeated lookups, the first lookup (cold
rank cache), and the CPU one lookup costs the client and the daemons (load-independent; wall
time adds the waits for a core). The floor, measured in the same run: the same 8,192 keys
asked of one daemon as two packed EXISTS on one raw socket (no tierkv client), so the ratio
says what the client and the cluster add to the bare round trips. ``--profile`` prints the
client's cProfile of the "none present" lookups on 3 daemons (where a miss's time goes).
(uvloop for the daemons' loop was measured once, then dropped: docs/benchmarks.md.)

    python bench/lookup.py --json .bench/lookup.json [--profile]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import os
import platform
import pstats
import resource
import socket
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

import common
import msgpack
from common import cpu_s, pct
from storeutil import make_blocks  # tests/storeutil.py (common puts tests/ on the path)

import kvstore.client
from kvstore import protocol as P
from kvstore.keys import KeyBatch, Namespace

PROMPT_TOKENS = 128 * 1024
BLOCK_TOKENS = 16


def open_cluster(addrs, ns, **options):
    return kvstore.client.open(f"kvstore://{','.join(addrs)}", namespaces=(ns,), **options)


def raw_floor(addr: str, ns: Namespace, keys: KeyBatch, iters: int) -> dict:
    """The same keys asked of one daemon as packed EXISTS on one raw socket: HELLO once, then
    per round one request per MAX_EXISTS_KEYS keys, all sent before the replies are read."""
    host, port = addr.rsplit(":", 1)
    s = socket.create_connection((host, int(port)))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    f = s.makefile("rb")

    def send(h):
        body = msgpack.packb(h, use_bin_type=True)
        s.sendall(struct.pack(">I", len(body)) + body)

    def reply():
        (n,) = struct.unpack(">I", f.read(4))
        return msgpack.unpackb(f.read(n), raw=False)

    send({"op": "HELLO", "rid": 0, "v": P.PROTOCOL_VERSION, "token": "", "ns": [P.namespace_to_wire(ns)]})
    assert reply()["ok"]
    parts = [keys[i : i + P.MAX_EXISTS_KEYS].raw for i in range(0, len(keys), P.MAX_EXISTS_KEYS)]
    times = []
    for it in range(iters + 5):
        t0 = time.perf_counter()
        for i, raw in enumerate(parts):
            send({"op": "EXISTS", "rid": it * 8 + i + 1, "keys": raw})
        for _ in parts:
            assert reply()["ok"]
        if it >= 5:
            times.append((time.perf_counter() - t0) * 1e3)
    s.close()
    return {"p50_ms": statistics.median(times), "p99_ms": pct(times, 0.99)}


async def measure(addrs, pids, ns, keys: KeyBatch, expect: int, iters: int, profile: bool) -> dict:
    c = open_cluster(addrs, ns, replicas=2)
    await c.start(5.0)
    t0 = time.perf_counter()
    assert (await c.lookup(keys, 5.0)).hit_blocks == expect  # the first: a cold rank cache
    first = (time.perf_counter() - t0) * 1e3
    asked0 = c.counters["lookup_keys_asked"]
    times = []
    # CPU per lookup says what a lookup costs whatever the machine's load; wall time is
    # that plus the waits for a core (this bench shares the cores with whatever else runs)
    cpu0, dcpu0, sys0 = time.process_time(), cpu_s(pids), resource.getrusage(resource.RUSAGE_SELF).ru_stime
    for _ in range(iters):
        t0 = time.perf_counter()
        n = (await c.lookup(keys, 5.0)).hit_blocks
        times.append((time.perf_counter() - t0) * 1e3)
        assert n == expect
    cpu, dcpu = time.process_time() - cpu0, cpu_s(pids) - dcpu0
    sys_s = resource.getrusage(resource.RUSAGE_SELF).ru_stime - sys0  # the kernel's share of cpu
    prof = None
    if profile:  # more lookups under the profiler, after the measured ones (it costs CPU)
        prof = cProfile.Profile(time.process_time)  # CPU time: a loaded host preempts
        prof.enable()
        for _ in range(iters):
            assert (await c.lookup(keys, 5.0)).hit_blocks == expect
        prof.disable()
    asked = (c.counters["lookup_keys_asked"] - asked0) / (iters * (2 if profile else 1))  # per lookup
    await c.close()
    out = {
        "p50_ms": statistics.median(times),
        "p99_ms": pct(times, 0.99),
        "max_ms": max(times),
        "first_ms": first,
        "client_cpu_ms": cpu / iters * 1e3,
        "client_sys_ms": sys_s / iters * 1e3,
        "daemons_cpu_ms": dcpu / iters * 1e3,
        "keys_asked": asked,
    }
    if prof:
        buf = io.StringIO()
        st = pstats.Stats(prof, stream=buf).sort_stats("tottime")
        st.print_stats(18)
        st.print_callers("builtins.max|take")
        out["profile"] = buf.getvalue()
    return out


async def store(addrs, ns, blocks) -> None:
    w = open_cluster(addrs, ns, replicas=2, op_timeout_s=30.0)  # a loaded host: writes take time
    for i in range(0, len(blocks), 256):
        assert (await w.put(blocks[i : i + 256], 30.0)).dropped == 0
    await w.close()


async def run(addrs, pids, iters: int, profile: bool, tag: str) -> list[dict]:
    """All, half and none of a prompt present on the daemons ``addrs`` (fresh namespace)."""
    rows = []
    tokens = [(i * 7919) % 50000 for i in range(PROMPT_TOKENS)]
    ns = Namespace(f"bench-lookup-{tag}", "uint8", BLOCK_TOKENS)
    blocks = make_blocks(PROMPT_TOKENS // BLOCK_TOKENS, 1024, ns=ns, tokens=tokens)
    keys = ns.key_batch(tokens)
    absent = Namespace(f"bench-lookup-absent-{tag}", "uint8", BLOCK_TOKENS)
    nowhere = absent.key_batch(tokens)  # the same prompt under a namespace never stored
    half = len(keys) // 2
    base = {"daemons": len(addrs), "keys": len(keys)}
    rows.append(
        {**base, "case": "none present", **await measure(addrs, pids, ns, nowhere, 0, iters, profile)}
    )
    await store(addrs, ns, blocks[:half])
    rows.append({**base, "case": "half present", **await measure(addrs, pids, ns, keys, half, iters, False)})
    await store(addrs, ns, blocks[half:])
    rows.append(
        {**base, "case": "all present", **await measure(addrs, pids, ns, keys, len(keys), iters, False)}
    )
    floor = raw_floor(addrs[0], ns, keys, iters)
    for r in rows:
        r["floor_p50_ms"] = floor["p50_ms"]
        r["p50_vs_floor"] = r["p50_ms"] / floor["p50_ms"]
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--profile", action="store_true", help="cProfile the client's misses on 3 daemons")
    args = ap.parse_args()

    rows = []
    load = common.loadavg()
    with tempfile.TemporaryDirectory() as tmp:
        for n in (1, 3):
            daemons = []
            try:
                for i in range(n):
                    dram = {"capacity": "256MiB", "slab_size": "1MiB"}
                    daemons.append(common.start_daemon(Path(tmp) / f"c{n}-n{i}", dram=dram))
                addrs, pids = [d.addr for d in daemons], [d.proc.pid for d in daemons]
                rows += asyncio.run(run(addrs, pids, args.iters, args.profile and n == 3, f"c{n}"))
            finally:
                for d in daemons:
                    d.stop()
    load_end = common.loadavg()
    print(
        f"lookup of a {PROMPT_TOKENS // 1024}K-token prompt (8,192 keys), replicas=2, loopback, {args.iters} runs each"
    )
    print(f"load average (1 min): {load[0]:.2f} at start, {load_end[0]:.2f} at end, on {os.cpu_count()} CPUs")
    print(
        f"{'daemons':>7}  {'case':<13} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7} {'first ms':>8}"
        f" {'cli cpu':>7} {'cli sys':>7} {'srv cpu':>7} {'asked':>6} {'floor':>6} {'p50/floor':>9}"
    )
    for r in rows:
        print(
            f"{r['daemons']:>7}  {r['case']:<13} {r['p50_ms']:>7.2f} {r['p99_ms']:>7.2f} {r['max_ms']:>7.2f}"
            f" {r['first_ms']:>8.2f} {r['client_cpu_ms']:>7.2f} {r['client_sys_ms']:>7.2f} {r['daemons_cpu_ms']:>7.2f}"
            f" {r['keys_asked']:>6.0f} {r['floor_p50_ms']:>6.2f} {r['p50_vs_floor']:>9.2f}"
        )
    for r in rows:
        if "profile" in r:
            print(f"\nclient CPU profile, {r['case']} on {r['daemons']} daemons (by own CPU time):")
            print(r["profile"])
    doc = {
        "bench": "lookup",
        "prompt_tokens": PROMPT_TOKENS,
        "block_tokens": BLOCK_TOKENS,
        "loadavg_1m_at_start": load[0],
        "loadavg_1m_at_end": load_end[0],
        "python": platform.python_version(),
        "rows": rows,
    }
    common.write_json(args.json, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
