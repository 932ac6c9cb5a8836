"""Two builds of the daemon side by side: the same fetch and store against each, interleaved.

``bench/peers.py`` compares tierkv with the raw socket in one run; on a loaded host a cell
moves by up to 2x between runs, so a change to the daemon is hard to see across two runs.
This runs two ``kvstore serve`` daemons at once, one from each source tree (``--a``, ``--b``:
checkouts of the repository, e.g. ``git worktree add /tmp/base main``), with one client
(this tree's), and alternates them round by round, so the load falls on both alike.
Per block size: GB/s and daemon CPU s/GB of a whole-prefix fetch and store (peers.py's
``Tierkv`` cell: DRAM only, one connection), medians and the ratio b / a, with the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import peers  # noqa: E402

MiB = 1 << 20
SIZES = {256: 2048, 2048: 256, 32768: 32}  # KiB -> blocks (peers.py's cells)


def _daemon(src: Path, tmp: Path, size: int, count: int, data: np.ndarray) -> peers.Tierkv:
    peers.REPO = src  # the daemon is started from (and imports) this tree
    tmp.mkdir(parents=True, exist_ok=True)
    return peers.Tierkv(tmp, size, count, data, [1])


async def _run(args) -> dict:
    out = {}
    for kib in [int(x) for x in args.sizes.split(",")]:
        size, count = kib << 10, SIZES[kib]
        rng = np.random.default_rng(kib)
        data = rng.integers(0, 255, size=(count, size), dtype=np.uint8)
        dst = np.zeros_like(data)
        with tempfile.TemporaryDirectory() as t:
            ds = {
                "a": _daemon(Path(args.a), Path(t) / "a", size, count, data),
                "b": _daemon(Path(args.b), Path(t) / "b", size, count, data),
            }
            try:
                for d in ds.values():
                    await d.start()
                per = {(v, op): [] for v in ds for op in ("fetch", "store")}
                for r in range(args.rounds + 1):  # round 0 warms up, uncounted
                    for v in ("a", "b") if r % 2 else ("b", "a"):
                        d = ds[v]
                        for op in ("fetch", "store"):
                            c0, t0 = peers.cpu_of(d.pid), time.perf_counter()
                            bad = await (d.fetch(1, dst) if op == "fetch" else d.store(1, dst))
                            t1, c1 = time.perf_counter(), peers.cpu_of(d.pid)
                            assert bad == 0, f"{v} {op}: {bad} blocks failed"
                            if op == "fetch":
                                assert np.array_equal(dst, data), f"{v}: fetched bytes differ"
                                dst[:] = 0
                            else:
                                await d.after_store(1)
                            if r:
                                gb = size * count / 1e9
                                per[(v, op)].append((gb / (t1 - t0), (c1 - c0) / gb))
            finally:
                for d in ds.values():
                    await d.close()
        for op in ("fetch", "store"):
            a = [statistics.median(x[i] for x in per[("a", op)]) for i in (0, 1)]
            b = [statistics.median(x[i] for x in per[("b", op)]) for i in (0, 1)]
            out[f"{kib}K {op}"] = {"a": a, "b": b, "rounds": {v: per[(v, op)] for v in ("a", "b")}}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", required=True, help="source tree of daemon a (the base)")
    ap.add_argument("--b", required=True, help="source tree of daemon b (the change)")
    ap.add_argument("--sizes", default="256,2048,32768", help="block sizes in KiB")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    load0 = os.getloadavg()
    res = asyncio.run(_run(args))
    load1 = os.getloadavg()
    print("| cell | a GB/s | b GB/s | b / a | daemon CPU s/GB a | b | b / a |")
    print("|---|---|---|---|---|---|---|")
    for cell, r in res.items():
        (ga, ca), (gb, cb) = r["a"], r["b"]
        print(f"| {cell} | {ga:.2f} | {gb:.2f} | {gb / ga:.2f} | {ca:.3f} | {cb:.3f} | {cb / ca:.2f} |")
    print(f"load average (1, 5, 15 min): before {list(load0)}, after {list(load1)}")
    if args.json:
        Path(args.json).write_text(json.dumps({"load_avg": [load0, load1], "cells": res}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
