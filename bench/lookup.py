"""Longest-prefix lookup latency over a 3-node cluster on loopback.

A 128K-token prompt is cut into blocks (16 and 256 tokens per block: 8192 and 512 keys); its
blocks are stored on 3 ``kvstore serve`` daemons (DRAM only, replicas=2, 1 KiB payloads:
lookups only send keys). Then a lookup through the store facade (``kvstore.client.open``) is
timed as the connector makes it: ``exists`` of every key, the longest prefix of hits. Each key
goes to its owners (one batched EXISTS per node, in parallel), the keys no owner holds then
to the next ``lookahead`` node. Cases: the whole prompt cached, half of it cached (the other
half asks the lookahead node too), and replicas=1, lookahead=0 (each node asked only for its
own keys, one round). Per case: wall-time percentiles of repeated lookups, the first lookup
(cold rank cache), and the CPU one lookup costs the client and the three daemons together
(load-independent; wall time adds the waits for a core). Prints a table; --json writes it.

    python bench/lookup.py --json .bench/lookup.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import kvstore.client  # noqa: E402
from kvstore.client import make_header  # noqa: E402
from kvstore.keys import Namespace  # noqa: E402

PROMPT_TOKENS = 128 * 1024


def start_daemon(wd: Path) -> tuple[subprocess.Popen, str]:
    wd.mkdir(parents=True)
    cfg = wd / "node.toml"
    cfg.write_text(
        '[dram]\ncapacity = "256MiB"\nslab_size = "1MiB"\n[disk]\nenabled = false\n'
        f'[server]\nport_file = "{wd / "ports.json"}"\n'
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERKV_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore.cli", "serve", "--config", str(cfg), "--log-level", "WARNING"],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    end = time.monotonic() + 30
    while not (wd / "ports.json").exists():
        if proc.poll() is not None or time.monotonic() > end:
            proc.kill()
            raise RuntimeError("daemon did not start")
        time.sleep(0.05)
    return proc, f"127.0.0.1:{json.loads((wd / 'ports.json').read_text())['data_port']}"


def blocks_of(ns: Namespace, tokens: list[int]):
    bt, out, parent = ns.block_tokens, [], ns.id
    payload = bytes(1024)
    for i, k in enumerate(ns.block_keys(tokens)):
        toks = tokens[i * bt : (i + 1) * bt]
        out.append(
            (
                make_header(
                    key=k,
                    parent=parent,
                    namespace=ns.id,
                    tokens=toks,
                    dtype="uint8",
                    shape=[1024],
                    payload=payload,
                ),
                payload,
            )
        )
        parent = k
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def open_cluster(addrs, ns, **options):
    return kvstore.client.open(f"kvstore://{','.join(addrs)}", namespaces=(ns,), **options)


async def lookup_prefix(c, keys) -> int:
    """The connector's lookup: which keys are stored, then the longest prefix of them."""
    tiers = await c.exists(keys, 5.0)
    return next((i for i, t in enumerate(tiers) if t is None), len(tiers))


def cpu_s(pids) -> float:
    """User + system CPU seconds the processes ``pids`` used so far (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / tick


async def measure(addrs, pids, ns, keys, expect, options, iters: int) -> dict:
    c = open_cluster(addrs, ns, **options)
    await c.start(5.0)
    t0 = time.perf_counter()
    assert await lookup_prefix(c, keys) == expect  # the first: a cold rank cache
    first = (time.perf_counter() - t0) * 1e3
    asked0 = c.counters["lookup_keys_asked"]
    times = []
    # CPU per lookup says what a lookup costs whatever the machine's load; wall time is
    # that plus the waits for a core (this bench shares the cores with whatever else runs)
    cpu0, dcpu0 = time.process_time(), cpu_s(pids)
    for _ in range(iters):
        t0 = time.perf_counter()
        n = await lookup_prefix(c, keys)
        times.append((time.perf_counter() - t0) * 1e3)
        assert n == expect
    cpu, dcpu = time.process_time() - cpu0, cpu_s(pids) - dcpu0
    asked = (c.counters["lookup_keys_asked"] - asked0) / iters  # keys sent to nodes per lookup
    await c.close()
    return {
        "p50_ms": statistics.median(times),
        "p99_ms": pct(times, 0.99),
        "max_ms": max(times),
        "first_ms": first,
        "client_cpu_ms": cpu / iters * 1e3,
        "daemons_cpu_ms": dcpu / iters * 1e3,
        "keys_asked": asked,
    }


async def store(addrs, ns, blocks) -> None:
    w = open_cluster(addrs, ns, replicas=2)
    for i in range(0, len(blocks), 512):
        assert (await w.put(blocks[i : i + 512], 30.0)).dropped == 0
    await w.close()


async def run(addrs, pids, iters: int) -> list[dict]:
    rows = []
    tokens = [(i * 7919) % 50000 for i in range(PROMPT_TOKENS)]
    for bt in (256, 16):
        ns = Namespace("bench-lookup", "uint8", bt)
        blocks = blocks_of(ns, tokens)
        keys = [h.key for h, _ in blocks]
        half = len(keys) // 2
        await store(addrs, ns, blocks[:half])
        cases = [("half cached, replicas=2", half, {"replicas": 2})]
        for name, expect, cc in cases:
            rows.append(
                {
                    "block_tokens": bt,
                    "keys": len(keys),
                    "case": name,
                    **await measure(addrs, pids, ns, keys, expect, cc, iters),
                }
            )
        await store(addrs, ns, blocks[half:])
        cases = [
            ("all cached, replicas=2", len(keys), {"replicas": 2}),
            ("all cached, replicas=1 la=0", len(keys), {"replicas": 1, "lookahead": 0}),
        ]
        for name, expect, cc in cases:
            rows.append(
                {
                    "block_tokens": bt,
                    "keys": len(keys),
                    "case": name,
                    **await measure(addrs, pids, ns, keys, expect, cc, iters),
                }
            )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()
    procs = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            addrs = []
            for i in range(3):
                p, a = start_daemon(Path(tmp) / f"n{i}")
                procs.append(p)
                addrs.append(a)
            load = os.getloadavg()
            rows = asyncio.run(run(addrs, [p.pid for p in procs], args.iters))
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(30)
    print(
        f"lookup of a {PROMPT_TOKENS // 1024}K-token prompt over 3 nodes (loopback), {args.iters} runs each"
    )
    print(f"load average at start: {load[0]:.2f} (1 min) on {os.cpu_count()} CPUs")
    print(
        f"{'block_tokens':>12} {'keys':>6}  {'case':<28} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}"
        f" {'first ms':>8} {'cli cpu':>8} {'srv cpu':>8} {'asked':>7}"
    )
    for r in rows:
        print(
            f"{r['block_tokens']:>12} {r['keys']:>6}  {r['case']:<28} {r['p50_ms']:>8.2f} "
            f"{r['p99_ms']:>8.2f} {r['max_ms']:>8.2f} {r['first_ms']:>8.2f} {r['client_cpu_ms']:>8.2f} "
            f"{r['daemons_cpu_ms']:>8.2f} {r['keys_asked']:>7.0f}"
        )
    doc = {
        "bench": "lookup",
        "nodes": 3,
        "prompt_tokens": PROMPT_TOKENS,
        "cpus": os.cpu_count(),
        "loadavg_1m_at_start": load[0],
        "python": platform.python_version(),
        "rows": rows,
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
