"""What an operator's listing costs the data port (issue 33, finding 3).

One ``kvstore serve`` daemon on loopback holds N blocks (default 100,000). A client measures
data-port round trips (EXISTS of one stored key, one at a time) while nothing else runs
("alone"), then while another process pages through every block on the admin port
(``GET /v1/blocks``, pages of 10,000, over and over: "listing"), and while it pages through a
namespace that holds a few blocks ("filtered": the node looks at every block, answers few).
The phases alternate ``--rounds`` times, so host noise lands on all of them. Reported: p50,
p99 and max of each phase, and p99 during each listing over p99 alone (target: <= 2x), with
the load average beside them (only same-run ratios mean anything on a shared host).

    python bench/listing.py --blocks 100000 --json .bench/listing.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from daemonutil import launch_daemon  # noqa: E402

from kvstore.block import make_header  # noqa: E402
from kvstore.client.node import ClientConfig, NodeClient  # noqa: E402
from kvstore.keys import Namespace  # noqa: E402

NS = Namespace("bench-listing", "uint8", 4)
RARE = Namespace("bench-listing-rare", "uint8", 4)

# The listing process: pages through the admin port until stopped (a separate process, so its
# JSON decoding never delays the measuring client).
LISTER = """
import asyncio, sys, aiohttp
async def main(url, params):
    async with aiohttp.ClientSession(url) as s:
        while True:
            after = None
            while True:
                q = dict(params, limit="10000", **({"after": after} if after else {}))
                async with s.get("/v1/blocks", params=q) as r:
                    after = (await r.json())["next"]
                if after is None:
                    break
            print("listed", flush=True)
asyncio.run(main(sys.argv[1], dict(a.split("=", 1) for a in sys.argv[2:])))
"""


def blocks(ns: Namespace, n: int, start: int) -> list:
    out = []
    for i in range(start, start + n):
        tokens = [i & 0xFFFF, i >> 16, 7, 9]
        key = ns.block_keys(tokens)[0]
        payload = i.to_bytes(8, "little") * 32
        h = make_header(
            key=key, parent=ns.id, namespace=ns.id, tokens=tokens, dtype="uint8", shape=[256], payload=payload
        )
        out.append((h, payload))
    return out


async def fill(addr: str, n: int) -> None:
    c = NodeClient(addr, ClientConfig(namespaces=(NS, RARE)))
    try:
        for off in range(0, n, 5000):
            res = await c.put(blocks(NS, min(5000, n - off), off))
            assert all(r.status.ok for r in res), "fill: a put failed"
        await c.put(blocks(RARE, 20, 0))
    finally:
        await c.close()


async def sample(client: NodeClient, key, seconds: float) -> list[float]:
    out = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t = time.perf_counter()
        await client.exists([key])
        out.append(time.perf_counter() - t)
    return out


def q(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def summary(xs: list[float]) -> dict:
    return {"n": len(xs), "p50_ms": q(xs, 0.5) * 1e3, "p99_ms": q(xs, 0.99) * 1e3, "max_ms": max(xs) * 1e3}


async def run(args) -> dict:
    wd = Path(tempfile.mkdtemp(prefix="bench-listing-"))
    d = launch_daemon(wd, use_disk=True, dram={"capacity": "512MiB", "slab_size": "4MiB"})
    phases: dict[str, list[float]] = {"alone": [], "listing": [], "filtered": []}
    listed = {"listing": 0, "filtered": 0}
    try:
        await fill(d.addr, args.blocks)
        client = NodeClient(d.addr, ClientConfig(namespaces=(NS,)))
        key = blocks(NS, 1, 0)[0][0].key
        await sample(client, key, 0.5)  # warm
        for _ in range(args.rounds):
            for phase in ("alone", "listing", "filtered"):
                lister = None
                if phase != "alone":
                    extra = [f"namespace={RARE.id.hex}"] if phase == "filtered" else []
                    lister = subprocess.Popen(
                        [sys.executable, "-c", LISTER, d.admin, *extra], stdout=subprocess.PIPE, text=True
                    )
                    await asyncio.sleep(0.3)  # its first page is under way
                phases[phase] += await sample(client, key, args.seconds)
                if lister is not None:
                    lister.terminate()
                    out, _ = lister.communicate()
                    listed[phase] += out.count("listed")
        await client.close()
    finally:
        d.stop()
    res = {k: summary(v) for k, v in phases.items()}
    alone = res["alone"]["p99_ms"]
    return {
        "blocks": args.blocks,
        "rounds": args.rounds,
        "seconds_per_phase": args.seconds,
        "loadavg": os.getloadavg(),
        "phases": res,
        "full_listings": listed,
        "p99_ratio_listing": res["listing"]["p99_ms"] / alone,
        "p99_ratio_filtered": res["filtered"]["p99_ms"] / alone,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=4.0, help="seconds per phase per round")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args()
    doc = asyncio.run(run(args))
    la = ", ".join(f"{x:.1f}" for x in doc["loadavg"])
    print(f"{doc['blocks']} blocks, load average {la}; data-port EXISTS round trips:")
    for name, s in doc["phases"].items():
        print(
            f"  {name:9s} n={s['n']:6d}  p50 {s['p50_ms']:7.2f} ms  p99 {s['p99_ms']:7.2f} ms  max {s['max_ms']:7.1f} ms"
        )
    print(f"  full listings done: {doc['full_listings']}")
    print(
        f"  p99 during a listing / alone: {doc['p99_ratio_listing']:.2f}x (filtered: {doc['p99_ratio_filtered']:.2f}x; target <= 2x)"
    )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
