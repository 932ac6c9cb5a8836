"""`make demo` (store edition): put KV blocks into a node, kill -9 it, restart, read back.

What it shows a new user, with nothing to configure: a node process stores blocks of a
synthetic model's KV (DRAM + LMDB disk, write-through with fsync) and acknowledges them as
durable; the process is killed without warning mid-stream; a fresh node rebuilds its index from
disk and serves every acknowledged block, each verified (checksum, token ids, parent key) and
compared byte for byte. Then the tier statistics. Everything lives in a temp dir, removed after.

Run: ``python -m kvstore.demo [--blocks N] [--block-mib M] [--keep DIR]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from rich.console import Console
from rich.table import Table

from kvstore.block import make_header
from kvstore.config import format_size, load_store_config
from kvstore.keys import Namespace
from kvstore.node.store import NodeStore
from kvstore.results import Expect, Status

BLOCK_TOKENS = 16


def _config(root: str):
    return load_store_config(
        None,
        {
            "node.name": "demo-node",
            "dram.capacity": "128MiB",
            "dram.slab_size": "8MiB",
            "disk.path": os.path.join(root, "disk"),
            "disk.capacity": "2GiB",
            "disk.sync": True,
        },
        env={},
    )


def _blocks(n: int, nbytes: int):
    """A synthetic prompt's blocks: deterministic tokens and payloads, chained keys."""
    ns = Namespace("demo-model-fingerprint", "bfloat16", BLOCK_TOKENS)
    tokens = [(i * 7919) % 32000 for i in range(n * BLOCK_TOKENS)]
    parent = ns.id
    for i, key in enumerate(ns.block_keys(tokens)):
        seed = i.to_bytes(4, "little")
        payload = (seed * (nbytes // 4 + 1))[:nbytes]
        payload = bytes(b ^ (j & 0xFF) for j, b in enumerate(payload[:4096])) + payload[4096:]
        toks = tokens[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS]
        h = make_header(
            key=key,
            parent=parent,
            namespace=ns.id,
            tokens=toks,
            dtype="bfloat16",
            shape=[nbytes // 2],
            payload=payload,
        )
        yield h, payload
        parent = key


async def _child(root: str, n: int, nbytes: int) -> None:
    node = await NodeStore.open(_config(root))
    batch: list = []
    for blk in _blocks(n, nbytes):
        batch.append(blk)
        if len(batch) == 4:
            for (h, _), r in zip(batch, await node.writer.put(batch)):
                if r.durable:
                    print(f"ACK {h.key.hex}", flush=True)
            batch.clear()
    print("DONE", flush=True)
    await asyncio.sleep(3600)


async def _restart_and_read(root: str, n: int, nbytes: int, acked: set[str], console: Console) -> bool:
    t0 = time.perf_counter()
    node = await NodeStore.open(_config(root))
    t_open = time.perf_counter() - t0
    try:
        want = [(h, p) for h, p in _blocks(n, nbytes) if h.key.hex in acked]
        bufs = [bytearray(nbytes) for _ in want]
        expect = [Expect(h.parent, h.token_bytes) for h, _ in want]
        rows = []
        for label in ("disk (cold, checksummed)", "dram (promoted)"):
            t = time.perf_counter()
            res = await node.reader.read([h.key for h, _ in want], bufs, expect)
            dt = time.perf_counter() - t
            hits = sum(r.status is Status.HIT for r in res)
            same = sum(bytes(b) == p for b, (_, p) in zip(bufs, want))
            rows.append((label, hits, same, len(want) * nbytes / dt / 1e9))
        console.print(f"restarted node: index rebuilt from LMDB in {t_open * 1000:.0f} ms")
        t = Table(title="read back after kill -9")
        for c in ("read", "hits", "byte-identical", "GB/s"):
            t.add_column(c)
        for label, hits, same, gbs in rows:
            t.add_row(label, f"{hits}/{len(want)}", f"{same}/{len(want)}", f"{gbs:.2f}")
        console.print(t)
        st = node.inspector.stats()
        t = Table(title="tiers")
        for c in ("tier", "capacity", "used", "blocks", "evictions"):
            t.add_column(c)
        for name, s in st["tiers"].items():
            t.add_row(
                name,
                format_size(s["capacity_bytes"]),
                format_size(s["used_bytes"]),
                str(s["blocks"]),
                str(s["evictions"]),
            )
        console.print(t)
        node.check()
        return all(h == len(want) and s == len(want) for _, h, s, _ in rows)
    finally:
        await node.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvstore.demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=96, help="blocks to write (default 96)")
    ap.add_argument("--block-mib", type=int, default=2, help="payload MiB per block (default 2)")
    ap.add_argument("--kill-after", type=int, default=64, help="kill the writer after this many acks")
    ap.add_argument("--keep", help="use this directory and keep it (default: a temp dir, removed)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    nbytes = a.block_mib << 20
    if a.child:
        asyncio.run(_child(a.child, a.blocks, nbytes))
        return 0
    console = Console()
    root = a.keep or tempfile.mkdtemp(prefix="tierkv-demo-")
    try:
        console.rule("tierkv storage node demo")
        console.print(
            f"writing {a.blocks} blocks of {a.block_mib} MiB ({BLOCK_TOKENS} tokens each) "
            "to a node process (DRAM 128 MiB + LMDB disk, write-through, fsync)"
        )
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvstore.demo",
                "--child",
                root,
                "--blocks",
                str(a.blocks),
                "--block-mib",
                str(a.block_mib),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        acked: set[str] = set()
        t0 = time.perf_counter()
        for line in proc.stdout:
            if line.startswith("ACK "):
                acked.add(line.split()[1])
            if len(acked) >= a.kill_after or line.startswith("DONE"):
                break
        dt = time.perf_counter() - t0
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        console.print(
            f"{len(acked)} blocks acknowledged durable in {dt:.1f} s; [bold red]kill -9[/] the node mid-stream"
        )
        ok = asyncio.run(_restart_and_read(root, a.blocks, nbytes, acked, console))
        console.print(
            "[bold green]every acknowledged block came back intact[/]"
            if ok
            else "[bold red]MISSING OR WRONG BLOCKS[/]"
        )
        return 0 if ok else 1
    finally:
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
