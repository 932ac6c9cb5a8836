"""Soak a real `kvstore serve` daemon on loopback with several models' block sizes at once.

A cache workload: each step picks a model (block size) and a block of its working set (skewed:
most reads go to a hot part), GETs it and PUTs it on a miss. The working set is larger than
DRAM, so DRAM and disk both evict. The models' popularity rotates every third of the run, so
the mix of block sizes changes and DRAM memory must move between size classes.

Every ``--every`` seconds it samples the daemon's /v1/stats and prints: DRAM fill (payload
bytes / capacity), DRAM waste (slack in slots + free slots of assigned spans), the LMDB file
size, disk bytes used, and DRAM vs disk hits since the last sample. Bounded by ``--seconds``.

    python bench/soak.py --seconds 240 --json .bench/soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

KiB, MiB = 1 << 10, 1 << 20
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import common  # noqa: E402

from kvstore.config import parse_size  # noqa: E402


def _start_daemon(tmp: Path, a) -> common.Daemon:
    return common.start_daemon(
        tmp,
        use_disk=True,
        dram={"capacity": a.dram, "slab_size": a.slab},
        disk={"capacity": a.disk, "sync": a.sync, "map_size": a.disk_map},
        server={"max_frame": 2 * a.slab + MiB},
    )


class Model:
    """One model: a block size, a namespace and a working set of chained block keys."""

    def __init__(self, i: int, size: int, ws_bytes: int) -> None:
        from kvstore.keys import Namespace

        self.size = size
        self.ns = Namespace(f"soak-model-{i}", "uint8", 16)
        n = max(8, ws_bytes // size)
        self.keys = self.ns.block_keys(list(range(16 * n)))
        self.base = bytearray(random.Random(i).randbytes(size))

    def block(self, j: int):
        from kvstore.block import make_header

        payload = bytearray(self.base)
        payload[:8] = j.to_bytes(8, "little")  # a distinct payload (and checksum) per block
        parent = self.ns.id if j == 0 else self.keys[j - 1]
        h = make_header(
            key=self.keys[j],
            parent=parent,
            namespace=self.ns.id,
            tokens=list(range(16 * j, 16 * j + 16)),
            dtype="uint8",
            shape=[self.size],
            payload=payload,
        )
        return h, payload

    def pick(self, rnd: random.Random) -> int:
        n = len(self.keys)
        hot = max(1, n // 5)
        return rnd.randrange(hot) if rnd.random() < 0.8 else rnd.randrange(n)


def _stats(admin: str) -> dict:
    with urllib.request.urlopen(f"{admin}/v1/stats", timeout=10) as r:
        return json.loads(r.read())


def _sample(raw: dict, t: float, prev: dict) -> dict:
    node, tiers = raw.get("node", {}), raw.get("tiers", {})
    d, k = tiers.get("dram", {}), tiers.get("disk", {})
    cap = d.get("capacity_bytes") or 1
    return {
        "t_s": round(t, 1),
        "dram_fill": round(d.get("payload_bytes", 0) / cap, 4),
        "dram_waste_bytes": d.get("waste_bytes"),
        "dram_blocks": d.get("blocks"),
        "slab_moves": d.get("slab_moves"),
        "disk_file_bytes": k.get("file_bytes"),
        "disk_used_bytes": k.get("used_bytes"),
        "disk_map_full_evictions": k.get("map_full_evictions"),
        "disk_write_errors": k.get("write_errors"),
        "dram_hits": node.get("hits_dram", 0) - prev.get("hits_dram", 0),
        "disk_hits": node.get("hits_disk", 0) - prev.get("hits_disk", 0),
    }


async def _soak(a, addr: str, admin: str) -> list[dict]:
    from kvstore.client.config import ClientConfig
    from kvstore.client.node import NodeClient
    from kvstore.client.read import get_into
    from kvstore.results import Status

    ws = a.working_set // len(a.sizes)
    models = [Model(i, s, ws) for i, s in enumerate(a.sizes)]
    c = NodeClient(addr, ClientConfig(namespaces=tuple(m.ns for m in models), pool_size=1, op_timeout_s=60))
    rnd = random.Random(7)
    bufs = {s: bytearray(s) for s in a.sizes}
    samples: list[dict] = []
    t0 = time.monotonic()
    next_sample, prev = t0 + a.every, {}
    ops = misses = 0
    while (now := time.monotonic()) < t0 + a.seconds:
        third = min(2, int(3 * (now - t0) / a.seconds))
        # popularity rotates by thirds: the first models lead, then the middle, then the last
        weights = [
            1.0 + 4.0 * (((i - third * len(models) // 3) % len(models)) < 2) for i in range(len(models))
        ]
        m = rnd.choices(models, weights)[0]
        j = m.pick(rnd)
        [g] = await get_into(c, [m.keys[j]], [bufs[m.size]])
        ops += 1
        if g.status is not Status.HIT:
            misses += 1
            await c.put([m.block(j)])
        if now >= next_sample:
            raw = _stats(admin)
            s = _sample(raw, now - t0, prev)
            s.update(ops=ops, misses=misses)
            prev = raw.get("node", {})
            samples.append(s)
            print(_row(s), flush=True)
            next_sample += a.every
    await c.close()
    return samples


def _mib(v) -> str:
    return "-" if v is None else f"{v / MiB:.1f}MiB"


def _row(s: dict) -> str:
    # fields a node does not report (an older one) print as "-"
    return (
        f"t={s['t_s']:7.1f}s dram_fill={100 * s['dram_fill']:5.1f}% waste={_mib(s['dram_waste_bytes'])} "
        f"moves={s['slab_moves']} disk_file={_mib(s['disk_file_bytes'])} "
        f"disk_used={_mib(s['disk_used_bytes'])} hits dram/disk={s['dram_hits']}/{s['disk_hits']} "
        f"map_full_evictions={s['disk_map_full_evictions']} write_errors={s['disk_write_errors']}"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=180.0, help="length of the soak (default 180)")
    p.add_argument("--every", type=float, default=10.0, help="seconds between samples")
    p.add_argument("--dram", type=parse_size, default=parse_size("256MiB"))
    p.add_argument("--slab", type=parse_size, default=parse_size("32MiB"))
    p.add_argument("--disk", type=parse_size, default=parse_size("512MiB"))
    p.add_argument("--disk-map", type=parse_size, default=0, help="LMDB map size (0: derived from --disk)")
    p.add_argument("--working-set", type=parse_size, default=parse_size("1GiB"))
    p.add_argument(
        "--sizes",
        type=lambda v: [parse_size(x) for x in v.split(",")],
        default=[64 * KiB, 96 * KiB, 256 * KiB, 1 * MiB, 1536 * KiB, 4 * MiB],
        help="block sizes, one model each (comma-separated sizes)",
    )
    p.add_argument("--sync", action="store_true", help="fsync every disk commit (default off)")
    p.add_argument("--json", help="write the samples here")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="tierkv-soak-") as d:
        daemon = _start_daemon(Path(d), a)
        try:
            samples = asyncio.run(_soak(a, daemon.addr, daemon.admin))
        finally:
            daemon.stop()
    common.write_json(a.json, {"args": {k: v for k, v in vars(a).items()}, "samples": samples})
    warm = samples[len(samples) // 3 :] or samples
    files = [s["disk_file_bytes"] for s in warm if s["disk_file_bytes"] is not None]
    print(
        f"after warm-up: dram_fill min {100 * min(s['dram_fill'] for s in warm):.1f}% "
        f"max {100 * max(s['dram_fill'] for s in warm):.1f}%; "
        f"disk_file {_mib(files[0] if files else None)} -> {_mib(max(files) if files else None)}; "
        f"hits dram/disk {sum(s['dram_hits'] for s in samples)}/{sum(s['disk_hits'] for s in samples)}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
