"""The long chaos run (issue 33): blocks lost per fault type.

For each fault type (kill -9, SIGSTOP, restart, partition, wipe; partition only where network
namespaces can be made, i.e. as root) a fresh three-node cluster (replicas 2, repair on, each
node on its own disk) takes a byte-verified write/read load while that fault hits one node
at a time for ``--seconds``; then ``mixed`` does all of them at random. After each run
everything heals, repair settles (at most ``--settle`` s) and a census reads every
acknowledged block from every node (tests/cluster/chaos_run.py). Reported per run: faults,
blocks acknowledged, lost (and how many a double wipe excuses), wrong bytes, reads that hit,
blocks under 2 copies after settling. The bounded version is tests/cluster/test_cluster_chaos.py.

    python bench/chaos.py --seconds 120 --json .bench/chaos.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from cluster.chaos_run import Chaos  # noqa: E402
from cluster.cluster_netns import cannot_make_namespaces  # noqa: E402


async def one(kinds: tuple[str, ...] | None, seconds: float, settle_s: float, seed: int, netns: bool) -> dict:
    wd = Path(tempfile.mkdtemp(prefix="bench-chaos-"))
    chaos = Chaos(wd, netns, seed)
    try:
        chaos.start()
        r = await chaos.run(seconds, kinds, settle_s)
    finally:
        chaos.close()
    print(f"  {'mixed' if kinds is None else kinds[0]:9s} {r.line()}", flush=True)
    doc = asdict(r)
    doc["faults"], doc["lost_by_last_fault"] = dict(r.faults), dict(r.lost_by_last_fault)
    return doc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=120.0, help="seconds of faults per run")
    ap.add_argument("--settle", type=float, default=90.0, help="the most seconds repair gets afterwards")
    ap.add_argument("--only", choices=["kill9", "sigstop", "restart", "partition", "wipe", "mixed"])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    netns = not cannot_make_namespaces()
    kinds = ["kill9", "sigstop", "restart", "wipe", *(["partition"] if netns else []), "mixed"]
    if args.only:
        kinds = [args.only]
    print(f"chaos, {'network namespaces' if netns else 'loopback'}, load average {os.getloadavg()}")
    runs = {}
    for k in kinds:
        runs[k] = asyncio.run(
            one(None if k == "mixed" else (k,), args.seconds, args.settle, args.seed, netns)
        )
    doc = {"netns": netns, "seconds": args.seconds, "loadavg": os.getloadavg(), "runs": runs}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
