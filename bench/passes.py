"""Background passes against serving (issue 34, finding 7): another client's GET latency on a
node while orphan passes run over its blocks, against the same client with no pass, same run.

Two ``kvstore serve`` daemons on loopback form a static cluster (repair off). Node 0 holds
``--blocks`` children whose parents are on node 1, so each orphan pass on node 0 reads every
block's header and asks node 1 about every parent (and drops nothing: the passes can repeat).
A client reads 4 blocks of 4 KiB in another namespace on node 0, one GET at a time, for
``--seconds`` per phase:

- ``alone``: no pass;
- ``passes``: one ``POST /v1/orphans/pass`` after the other (a periodic pass at its worst);
- ``requests``: ``--concurrent`` operators each POSTing passes in a loop (before the fix ten
  requests ran ten passes one after the other; now they join one).

The POSTs come from a child process (their threads never share this process's interpreter
lock with the measuring client). ``--rounds`` repeats the three phases, interleaved. Prints,
as a Markdown table of medians over the rounds, p50/p99 per phase and their ratios to
``alone`` taken round by round (target: p99 within 2x), the passes run, the daemon's CPU per
pass (its CPU less the reads' at the ``alone`` rate: what the orphan pass's own work costs) and
the load average; --json writes every round (bench/common.py's ``write_json``).

    python bench/passes.py --blocks 50000 --rounds 3 --json docs/results/passes.json
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import common  # noqa: I001  (puts the repository and tests/ on the path)

from kvstore.block import make_header
from kvstore.client.config import ClientConfig
from kvstore.client.node import NodeClient
from kvstore.client.read import get_into
from kvstore.keys import Namespace

NS = Namespace("bench-passes", "uint8", 4)
READER = Namespace("bench-passes-reader", "uint8", 4)

_POSTER = """
import sys, threading, time, urllib.request
url, n, stop_at = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
def loop():
    while time.time() < stop_at:
        req = urllib.request.Request(url, data=b"{}", method="POST")
        try:
            urllib.request.urlopen(req, timeout=600).read()
        except Exception as exc:
            print("post failed:", exc, file=sys.stderr)
threads = [threading.Thread(target=loop) for _ in range(n)]
for t in threads: t.start()
for t in threads: t.join()
"""


def start(wd: Path, port: int, peers: list[str], batch_keys: int):
    """A member of the static cluster ``peers`` on ``port``: DRAM only, repair off, the orphan
    pass only when asked (its period is a day)."""
    return common.start_daemon(
        wd,
        dram={"capacity": "1GiB", "slab_size": "1MiB"},
        server={"data_port": port},
        cluster={"peers": peers},
        repair={"enabled": False},
        orphans={"interval_s": 86400.0, "batch_keys": batch_keys},
    )


def chains(n: int) -> tuple[list, list]:
    """``n`` two-block chains: (parents, children)."""
    parents, children = [], []
    for i in range(n):
        tokens = [i, i + 1, i + 2, i + 3, 7, 7, 7, 7]
        k0, k1 = NS.block_keys(tokens)
        p0, p1 = i.to_bytes(8, "little") * 2, (i + 1).to_bytes(8, "little") * 2
        h0 = make_header(
            key=k0, parent=NS.id, namespace=NS.id, tokens=tokens[:4], dtype="uint8", shape=[16], payload=p0
        )
        h1 = make_header(
            key=k1, parent=k0, namespace=NS.id, tokens=tokens[4:], dtype="uint8", shape=[16], payload=p1
        )
        parents.append((h0, p0))
        children.append((h1, p1))
    return parents, children


async def put_all(addr: str, blocks: list, ns: Namespace) -> None:
    c = NodeClient(addr, ClientConfig(namespaces=(ns,), op_timeout_s=60.0))
    for i in range(0, len(blocks), 256):
        res = await c.put(blocks[i : i + 256])
        assert all(r.status.ok for r in res), [r.status.name for r in res if not r.status.ok][:3]
    await c.close()


async def reads(addr: str, keys, seconds: float) -> list[float]:
    """GET latencies (ms) of one client reading ``keys`` one GET after the other."""
    c = NodeClient(addr, ClientConfig(namespaces=(READER,), op_timeout_s=30.0))
    bufs = [bytearray(4096) for _ in keys]
    out: list[float] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        res = await get_into(c, keys, bufs)
        out.append((time.perf_counter() - t0) * 1e3)
        assert all(r.status.name == "HIT" for r in res)
    await c.close()
    return out


def passes_done(admin: str) -> float:
    with urllib.request.urlopen(admin + "/metrics", timeout=60) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("tierkv_orphans_passes_total "):
                return float(line.split()[1])
    return 0.0


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=50000, help="children on node 0 (one pass reads them all)")
    ap.add_argument("--seconds", type=float, default=10.0, help="per phase")
    ap.add_argument("--concurrent", type=int, default=10, help="operators POSTing passes at once")
    ap.add_argument("--batch-keys", type=int, default=1024, help="orphans.batch_keys: blocks per slice")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of the three phases, interleaved")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    ports = [common.free_port(), common.free_port()]
    addrs = [f"127.0.0.1:{p}" for p in ports]
    with tempfile.TemporaryDirectory(prefix="bench-passes-") as tmp:
        daemons = []
        try:
            for i in range(2):
                daemons.append(start(Path(tmp) / f"n{i}", ports[i], addrs, a.batch_keys))
            parents, children = chains(a.blocks)
            await put_all(addrs[1], parents, NS)
            await put_all(addrs[0], children, NS)
            mine = []
            for i in range(4):
                tokens = [9000 + 4 * i + j for j in range(4)]
                payload = bytes([i]) * 4096
                (k,) = READER.block_keys(tokens)
                parent = mine[-1][0].key if mine else READER.id
                h = make_header(
                    key=k, parent=parent, namespace=READER.id, tokens=tokens, dtype="uint8", shape=[4096],
                    payload=payload,
                )  # fmt: skip
                mine.append((h, payload))
            await put_all(addrs[0], mine, READER)
            keys = [h.key for h, _ in mine]
            runs: dict[str, list[dict]] = {phase: [] for phase, _ in PHASES}
            for _ in range(a.rounds):  # the phases interleaved: a load change hits each alike
                for phase, posters in PHASES:
                    n = a.concurrent if posters is None else posters
                    runs[phase].append(await phase_run(daemons[0], keys, n, a.seconds))
        finally:
            for d in daemons:
                d.stop()
    for rs in runs.values():  # CPU per pass: the phase's, less its reads at the alone rate
        for r, b in zip(rs, runs["alone"]):
            reads_cpu = b["daemon_cpu_s"] * r["gets"] / b["gets"]
            r["cpu_ms_per_pass"] = (
                round(1e3 * (r["daemon_cpu_s"] - reads_cpu) / r["passes"], 1) if r["passes"] else 0.0
            )
    rows = {phase: summary(rs, runs["alone"]) for phase, rs in runs.items()}
    print(
        f"{a.blocks} blocks on the node, {a.concurrent} concurrent operators, batch_keys {a.batch_keys}, "
        f"{a.rounds} rounds of {a.seconds:g} s per phase (medians over rounds)"
    )
    cols = ("gets", "p50_ms", "p99_ms", "p50_x", "p99_x", "passes", "cpu_ms_per_pass", "loadavg")
    print(common.md_table(("phase", *cols), [(name, *(r[c] for c in cols)) for name, r in rows.items()]))
    common.write_json(a.json, {"args": vars(a), "rows": rows, "rounds": runs})


# (phase, operators POSTing passes back to back): none; one; ``--concurrent`` (None)
PHASES = (("alone", 0), ("passes", 1), ("requests", None))


async def phase_run(daemon, keys, posters: int, seconds: float) -> dict:
    """One phase on ``daemon``: ``posters`` operators POSTing passes while one client reads;
    ``cpu_ms_per_pass``: the daemon's CPU beyond serving the reads, per pass (its CPU less
    what the reads alone cost, at the ``alone`` phase's rate, filled in by :func:`main`)."""
    addr, admin = daemon.addr, daemon.admin
    before, cpu0 = passes_done(admin), common.cpu_s(daemon.proc.pid)
    child = None
    if posters:
        stop_at = time.time() + seconds
        url = admin + "/v1/orphans/pass"
        child = subprocess.Popen([sys.executable, "-c", _POSTER, url, str(posters), str(stop_at)])
        await asyncio.sleep(0.2)  # the first pass under way
    lat = await reads(addr, keys, seconds)
    if child is not None:
        child.wait()
    return {
        "gets": len(lat),
        "p50_ms": round(common.pct(lat, 0.5), 3),
        "p99_ms": round(common.pct(lat, 0.99), 3),
        "passes": passes_done(admin) - before,
        "daemon_cpu_s": round(common.cpu_s(daemon.proc.pid) - cpu0, 3),
        "loadavg": common.loadavg()[0],
    }


def summary(rs: list[dict], alone: list[dict]) -> dict:
    """A phase's medians over the rounds, its ratios to ``alone`` taken round by round."""
    keys = ("gets", "p50_ms", "p99_ms", "passes", "cpu_ms_per_pass", "loadavg")
    out = {k: statistics.median(r[k] for r in rs) for k in keys}
    for q in ("p50", "p99"):
        out[f"{q}_x"] = round(statistics.median(r[f"{q}_ms"] / b[f"{q}_ms"] for r, b in zip(rs, alone)), 2)
    return out


if __name__ == "__main__":
    asyncio.run(main())
