"""Hit TTFT by KV dtype, in one run — SmolLM2-135M on CPU: the same prompt stored and hit with
the KV cache in bf16 and in fp8 (and the model's own fp32 for reference).

Per KV dtype and prompt length (``--lengths``): cold TTFT; a hit from the in-process store's
DRAM (``local://``, a fresh engine sharing the store); a hit from a ``kvstore serve`` daemon
over loopback (``kvstore://``, a fresh engine); the block payload bytes and the tier's
bandwidth measured in the same run (a raw batched GET of the same blocks). Every hit's first
token is checked against that dtype's cold run. Prints a table (with fp8 / bf16 ratios) and
writes JSON (``--json``). Not a test. Reuses bench/ttft.py's helpers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import tempfile

import torch
from ttft import _start_daemon, _tier_bandwidth, _ttft, _warm

from connector.backends import Backend
from connector.config import parse_connector_url
from connector.demo import DEFAULT_MODEL_DIR, ensure_model
from connector.flush import require_saved
from connector.store_connector import StoreConnector
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.kv_connector import ConnectorContext
from engine.llm import LLMEngine


def _engine(model_dir: str, url: str, kv_dtype: str, prefix_cache: bool, backend=None) -> AsyncEngine:
    cfg = EngineConfig(
        kv_cache_bytes=1 << 30,
        enable_prefix_cache=prefix_cache,
        max_num_batched_tokens=2048,
        kv_cache_dtype=kv_dtype,
    )
    eng = LLMEngine(model_dir, cfg)
    ctx = ConnectorContext(eng.config.page_size, eng.kv, eng.namespace, eng.model_dir, "cpu", eng.transfer)
    return AsyncEngine(eng, StoreConnector(ctx, parse_connector_url(url), backend=backend))


async def bench_one(model_dir: str, n: int, kv_dtype: str, root: str, daemon_addr: str) -> dict:
    g = torch.Generator().manual_seed(n)
    prompt = torch.randint(100, 49052, (n,), generator=g).tolist()
    q = "lookup_deadline_s=30&load_deadline_s=60&policy=always"
    local = f"local://{root}/store-{kv_dtype}-{n}?{q}"
    a = _engine(model_dir, local, kv_dtype, prefix_cache=False)
    await _warm(a)
    cold, cached, tok_cold = await _ttft(a, prompt)
    assert cached == 0
    require_saved(await a.connector.flush(120), "fp8_ttft: local store")
    block = a.connector.block_bytes
    dram_bw = await _tier_bandwidth(a.connector, prompt)
    b = _engine(model_dir, local, kv_dtype, prefix_cache=False, backend=a.connector.backend)
    await _warm(b)
    dram, cached_dram, tok = await _ttft(b, prompt)
    assert tok == tok_cold and cached_dram > 0, (tok, tok_cold, cached_dram)
    b.connector.backend = Backend()  # the shared one is closed with a
    await b.stop()
    await a.stop()

    remote = f"kvstore://{daemon_addr}?{q}"
    c = _engine(model_dir, remote, kv_dtype, prefix_cache=False)
    await _ttft(c, prompt)
    require_saved(await c.connector.flush(120), "fp8_ttft: daemon")
    net_bw = await _tier_bandwidth(c.connector, prompt)
    await c.stop()
    d = _engine(model_dir, remote, kv_dtype, prefix_cache=False)
    await _warm(d)
    rem, cached_rem, tok = await _ttft(d, prompt)
    assert tok == tok_cold and cached_rem > 0
    await d.stop()
    nblocks = cached_rem // 16
    return dict(
        tokens=n,
        kv_dtype=kv_dtype,
        block_bytes=block,
        hit_bytes=nblocks * block,
        cold=cold,
        local_dram_hit=dram,
        remote_hit=rem,
        hit_tokens=cached_rem,
        dram_bw=dram_bw,
        remote_bw=net_bw,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL_DIR)
    ap.add_argument("--lengths", default="2048,8000")
    ap.add_argument("--kv-dtypes", default="auto,bf16,fp8_e4m3")
    ap.add_argument("--json")
    a = ap.parse_args()
    from rich.console import Console

    model_dir = ensure_model(a.model, Console())
    root = tempfile.mkdtemp(prefix="tierkv-fp8-ttft-")
    daemon, addr = _start_daemon(root)
    rows: list[dict] = []
    try:
        for n in [int(x) for x in a.lengths.split(",")]:
            for kd in a.kv_dtypes.split(","):
                rows.append(asyncio.run(bench_one(model_dir, n, kd, root, addr)))
    finally:
        daemon.terminate()
        daemon.wait(30)
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"{'tokens':>6} {'kv dtype':9} {'block B':>8} {'hit MB':>7} {'cold ms':>8} {'dram hit':>9} "
        f"{'remote hit':>10} {'dram GB/s':>9} {'net GB/s':>8}"
    )
    for r in rows:
        print(
            f"{r['tokens']:>6} {r['kv_dtype']:9} {r['block_bytes']:>8} {r['hit_bytes'] / 1e6:7.1f} "
            f"{r['cold'] * 1e3:8.1f} {r['local_dram_hit'] * 1e3:9.1f} {r['remote_hit'] * 1e3:10.1f} "
            f"{r['dram_bw'] / 1e9:9.2f} {r['remote_bw'] / 1e9:8.2f}"
        )
    ratios = []
    for n in sorted({r["tokens"] for r in rows}):
        by = {r["kv_dtype"]: r for r in rows if r["tokens"] == n}
        if "fp8_e4m3" in by and "bf16" in by:
            f, b = by["fp8_e4m3"], by["bf16"]
            ratios.append(
                dict(
                    tokens=n,
                    block_bytes=f["block_bytes"] / b["block_bytes"],
                    local_dram_hit=f["local_dram_hit"] / b["local_dram_hit"],
                    remote_hit=f["remote_hit"] / b["remote_hit"],
                )
            )
    for r in ratios:
        print(
            f"fp8/bf16 at {r['tokens']} tokens: block bytes {r['block_bytes']:.3f}, "
            f"local dram hit {r['local_dram_hit']:.2f}, remote hit {r['remote_hit']:.2f}"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {
                    "cpus": os.cpu_count(),
                    "model": os.path.basename(model_dir),
                    "rows": rows,
                    "fp8_over_bf16": ratios,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
