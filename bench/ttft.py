"""Time to first token, cold vs hit, per tier, beside each hit's floor — SmolLM2-135M on CPU.

For prompts of 1K, 4K and 8K tokens (``--lengths``):
- cold: a fresh engine with an empty store computes the whole prompt;
- hit from the engine's own prefix cache (HBM tier; on CPU, the same memory): only the tail
  after the last full block is computed — this is also the *tail compute* of every other hit;
- hit from the in-process store's DRAM, from its disk (a node with DRAM off), and from a
  ``kvstore serve`` daemon over loopback: a fresh engine whose prefix comes from that tier.
Each hit's floor = payload bytes / that tier's bandwidth measured in the same run (a raw
batched GET of the same blocks) + the tail compute. Target: hit TTFT within 1.5x of its floor.
Prints a table, writes JSON (``--json``) and a PNG plot (``--plot``). Not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

from connector.backends import Backend
from connector.config import parse_connector_url
from connector.demo import DEFAULT_MODEL_DIR, ensure_model
from connector.flush import require_saved
from connector.store_connector import StoreConnector
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.kv_connector import ConnectorContext
from engine.llm import LLMEngine
from engine.sequence import SamplingParams

ONE = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def _cfg(prefix_cache: bool) -> EngineConfig:
    return EngineConfig(kv_cache_bytes=1 << 30, enable_prefix_cache=prefix_cache, max_num_batched_tokens=2048)


def _engine(model_dir: str, url: str, prefix_cache: bool, backend=None) -> AsyncEngine:
    eng = LLMEngine(model_dir, _cfg(prefix_cache))
    ctx = ConnectorContext(eng.config.page_size, eng.kv, eng.namespace, eng.model_dir, "cpu", eng.transfer)
    conn = StoreConnector(ctx, parse_connector_url(url), backend=backend) if url else None
    return AsyncEngine(eng, conn)


async def _warm(aeng: AsyncEngine) -> None:
    """A serving engine is warm: one short unrelated request first (first-forward costs,
    connections), so every TTFT below is a steady-state one."""
    async for _ in aeng.generate([5, 6, 7, 8, 9, 10, 11, 12, 13], ONE):
        pass


async def _ttft(aeng: AsyncEngine, prompt: list[int]) -> tuple[float, int, int]:
    t0 = time.perf_counter()
    async for out in aeng.generate(prompt, ONE):
        return time.perf_counter() - t0, out.cached_tokens, out.token_id
    raise RuntimeError("no output")


async def _tier_bandwidth(conn: StoreConnector, prompt: list[int]) -> float:
    """Bytes/s of one batched GET of the prompt's blocks from the connector's backend."""
    keys = conn.ns.block_keys(prompt)
    bufs = [torch.empty(conn.block_bytes, dtype=torch.uint8).numpy() for _ in keys]
    await conn.backend.get_into(keys, bufs, None, 60)  # warm (connections, page cache)
    t = time.perf_counter()
    res = await conn.backend.get_into(keys, bufs, None, 60)
    dt = time.perf_counter() - t
    assert all(r.status.name == "HIT" for r in res), [r.status for r in res][:4]
    return len(keys) * conn.block_bytes / dt


def _start_daemon(root: str) -> tuple[subprocess.Popen, str]:
    ports = os.path.join(root, "ports.json")
    cfg = os.path.join(root, "node.toml")
    with open(cfg, "w") as f:
        f.write(f'[dram]\ncapacity = "2GiB"\n[disk]\nenabled = false\n[server]\nport_file = "{ports}"\n')
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore.cli", "serve", "--config", cfg], stdout=subprocess.DEVNULL
    )
    while not os.path.exists(ports):
        if proc.poll() is not None:
            raise SystemExit("daemon failed to start")
        time.sleep(0.05)
    with open(ports) as f:
        return proc, f"127.0.0.1:{json.load(f)['data_port']}"


async def bench_length(model_dir: str, n: int, root: str, daemon_addr: str) -> list[dict]:
    vocab = 49152
    g = torch.Generator().manual_seed(n)
    prompt = torch.randint(100, vocab - 100, (n,), generator=g).tolist()
    rows = []
    local = f"local://{root}/store-{n}?lookup_deadline_s=30&load_deadline_s=60&policy=always"

    # cold, then the engine's own prefix cache (tail compute only)
    a = _engine(model_dir, local, prefix_cache=True)
    await _warm(a)
    cold, cached, tok_cold = await _ttft(a, prompt)
    assert cached == 0
    require_saved(await a.connector.flush(120), "ttft: local store")
    hbm, cached_hbm, tok = await _ttft(a, prompt)
    assert tok == tok_cold
    rows.append(dict(tokens=n, tier="cold", ttft=cold, hit=0, floor=None))
    rows.append(dict(tokens=n, tier="engine cache", ttft=hbm, hit=cached_hbm, floor=hbm))
    tail = hbm

    # DRAM of the in-process store: a fresh engine sharing the store
    bw = await _tier_bandwidth(a.connector, prompt)
    b = _engine(model_dir, local, prefix_cache=False, backend=a.connector.backend)
    await _warm(b)
    t, cached, tok = await _ttft(b, prompt)
    assert tok == tok_cold and cached > 0
    nbytes = cached // a.connector.block_tokens * a.connector.block_bytes
    rows.append(dict(tokens=n, tier="local dram", ttft=t, hit=cached, floor=nbytes / bw + tail, bw=bw))
    b.connector.backend = Backend()
    await b.stop()
    await a.stop()

    # disk: the same store reopened with DRAM off (LMDB pages are in the OS page cache)
    disk_url = local + "&dram_capacity=0"
    c = _engine(model_dir, disk_url, prefix_cache=False)
    await _warm(c)
    bw = await _tier_bandwidth(c.connector, prompt)
    t, cached, tok = await _ttft(c, prompt)
    assert tok == tok_cold and cached > 0
    rows.append(dict(tokens=n, tier="local disk", ttft=t, hit=cached, floor=nbytes / bw + tail, bw=bw))
    await c.stop()

    # a daemon over loopback: store, then a fresh engine loads
    remote = f"kvstore://{daemon_addr}?lookup_deadline_s=30&load_deadline_s=60&policy=always"
    d = _engine(model_dir, remote, prefix_cache=False)
    await _ttft(d, prompt)
    require_saved(await d.connector.flush(120), "ttft: daemon")
    bw = await _tier_bandwidth(d.connector, prompt)
    await d.stop()
    e = _engine(model_dir, remote, prefix_cache=False)
    await _warm(e)
    t, cached, tok = await _ttft(e, prompt)
    assert tok == tok_cold and cached > 0
    rows.append(dict(tokens=n, tier="remote daemon", ttft=t, hit=cached, floor=nbytes / bw + tail, bw=bw))
    await e.stop()
    for r in rows:
        r["speedup"] = cold / r["ttft"]
        r["vs_floor"] = r["ttft"] / r["floor"] if r["floor"] else None
    return rows


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tiers = ["cold", "engine cache", "local dram", "local disk", "remote daemon"]
    lengths = sorted({r["tokens"] for r in rows})
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.16
    for i, tier in enumerate(tiers):
        ys = [next(r["ttft"] for r in rows if r["tokens"] == n and r["tier"] == tier) * 1000 for n in lengths]
        xs = [j + (i - 2) * width for j in range(len(lengths))]
        ax.bar(xs, ys, width, label=tier)
        floors = [next(r["floor"] for r in rows if r["tokens"] == n and r["tier"] == tier) for n in lengths]
        if all(f is not None for f in floors) and tier != "engine cache":
            ax.scatter(xs, [f * 1000 for f in floors], marker="_", s=300, color="black", zorder=3)
    ax.set_xticks(range(len(lengths)), [f"{n} tokens" for n in lengths])
    ax.set_ylabel("TTFT (ms, log)")
    ax.set_yscale("log")
    ax.set_title("SmolLM2-135M on CPU: time to first token, cold vs hit (black: hit floor)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL_DIR)
    ap.add_argument("--lengths", default="1024,4096,8000")
    ap.add_argument("--json")
    ap.add_argument("--plot")
    a = ap.parse_args()
    from rich.console import Console

    model_dir = ensure_model(a.model, Console())
    root = tempfile.mkdtemp(prefix="tierkv-ttft-")
    daemon, addr = _start_daemon(root)
    rows: list[dict] = []
    try:
        for n in [int(x) for x in a.lengths.split(",")]:
            rows += asyncio.run(bench_length(model_dir, n, root, addr))
    finally:
        daemon.terminate()
        daemon.wait(30)
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"{'tokens':>6} {'tier':14} {'TTFT ms':>9} {'hit':>6} {'speedup':>8} {'floor ms':>9} {'x floor':>8} {'tier GB/s':>9}"
    )
    for r in rows:
        floor = f"{r['floor'] * 1000:9.1f}" if r["floor"] else f"{'-':>9}"
        vs = f"{r['vs_floor']:8.2f}" if r["vs_floor"] else f"{'-':>8}"
        bw = f"{r['bw'] / 1e9:9.2f}" if r.get("bw") else f"{'-':>9}"
        print(
            f"{r['tokens']:>6} {r['tier']:14} {r['ttft'] * 1000:9.1f} {r['hit']:>6} {r['speedup']:8.1f} {floor} {vs} {bw}"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {"cpus": os.cpu_count(), "model": os.path.basename(model_dir), "rows": rows}, f, indent=1
            )
    if a.plot:
        plot(rows, a.plot)


if __name__ == "__main__":
    main()
