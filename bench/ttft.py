"""Time to first token, cold vs hit, per KV dtype and tier, beside each hit's floor —
SmolLM2-135M on CPU. (On a GPU: bench/gpu_serving.py, the same dtype x tier cases beside
hardware floors, run by bench/gpu_run.sh.)

For each KV cache dtype (``--kv-dtypes``, default bf16 and fp8_e4m3: fp8 blocks are about half
the bytes) and prompts of 1K, 4K and 8K tokens (``--lengths``):
- cold: a fresh engine with an empty store computes the whole prompt;
- hit from the engine's own prefix cache (HBM tier; on CPU, the same memory): only the tail
  after the last full block is computed — this is also the *tail compute* of every other hit;
- hit from the in-process store's DRAM, from its disk (a node with DRAM off), and from a
  ``kvstore serve`` daemon over loopback (holding the same blocks, copied byte for byte from
  the local store): a fresh engine whose prefix comes from that tier.
Each hit's floor = the seconds of one raw batched GET of the same blocks from that tier + the
tail compute, both measured right before that hit; each case runs ``--reps`` hits (the engine
keeps no prefix cache, so each loads again), and its row has the medians (× floor: the median of
each hit's own ratio), the first hit apart and the hit's engine timeline (lookup, load, compute).
Every hit's first token is checked against that dtype's cold run. Target (issue 18): remote hit
<= 1.15x its floor. Prints a table (and fp8 / bf16 per tier), writes JSON (``--json``) and a
PNG plot of the first dtype (``--plot``). Not a test.

    python bench/ttft.py --json docs/results/ttft.json
    python bench/ttft.py --lengths 256 --reps 1 --kv-dtypes bf16     # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import common
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
from kvstore.client.read import get_into

ONE = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def _engine(model_dir: str, url: str, kv_dtype: str, prefix_cache: bool, backend=None) -> AsyncEngine:
    cfg = EngineConfig(
        kv_cache_bytes=1 << 30,
        enable_prefix_cache=prefix_cache,
        max_num_batched_tokens=2048,
        kv_cache_dtype=kv_dtype,
    )
    eng = LLMEngine(model_dir, cfg)
    ctx = ConnectorContext(eng.config.page_size, eng.kv, eng.namespace, eng.model_dir, "cpu", eng.transfer)
    conn = StoreConnector(ctx, parse_connector_url(url), backend=backend) if url else None
    return AsyncEngine(eng, conn)


async def _warm(aeng: AsyncEngine) -> None:
    """A serving engine is warm: one short unrelated request first (first-forward costs,
    connections), so every TTFT below is a steady-state one."""
    async for _ in aeng.generate([5, 6, 7, 8, 9, 10, 11, 12, 13], ONE):
        pass


PARTS = ("lookup", "queue", "load", "compute")  # engine timeline phases of one request


async def _ttft(aeng: AsyncEngine, prompt: list[int]) -> tuple[float, int, int, dict[str, float]]:
    """TTFT, cached tokens, the first token, and the request's timeline phases (seconds)."""
    tl = aeng.engine.timeline
    before = {p: tl.total(p) for p in PARTS}
    t0 = time.perf_counter()
    async for out in aeng.generate(prompt, ONE):
        dt = time.perf_counter() - t0
        return dt, out.cached_tokens, out.token_id, {p: tl.total(p) - before[p] for p in PARTS}
    raise RuntimeError("no output")


async def _get_seconds(backend, keys, block_bytes: int) -> float:
    """Seconds of one batched GET of ``keys`` from ``backend`` into fresh-but-touched buffers."""
    bufs = [torch.zeros(block_bytes, dtype=torch.uint8).numpy() for _ in keys]
    await get_into(backend, keys, bufs, None, 60)  # warm (connections, page cache)
    t = time.perf_counter()
    res = await get_into(backend, keys, bufs, None, 60)
    dt = time.perf_counter() - t
    assert all(r.status.name == "HIT" for r in res), [r.status for r in res][:4]
    return dt


async def _copy_blocks(src, dst, keys, block_bytes: int) -> None:
    """Store in ``dst`` the blocks ``src`` holds under ``keys``, byte for byte (headers too):
    what a connector save of the same prompt would write, without computing it again."""
    bufs = [torch.empty(block_bytes, dtype=torch.uint8).numpy() for _ in keys]
    res = await get_into(src, keys, bufs, None, 60)
    assert all(r.status.name == "HIT" for r in res)
    report = await dst.put([(r.header, b) for r, b in zip(res, bufs)], 120)
    assert all(r.status.ok for r in report.results), [r.status for r in report.results][:4]


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


async def _hits(case, tier: str, n: int, reps: int, tok_cold: int, tail_of, get_of) -> dict:
    """``reps`` hits of ``case`` (an engine that loads the prompt each time), each beside a fresh
    tail sample (``tail_of()``) and a fresh batched GET of the same blocks (``get_of()``): per
    rep its ratio to its own floor; the row has the medians and the first hit apart."""
    samples = []
    for _ in range(reps):
        tail = await tail_of()
        get_s = await get_of()
        t, cached, tok, parts = await _ttft(case, case.prompt)
        assert tok == tok_cold and cached > 0, (tier, tok, tok_cold, cached)
        samples.append(dict(ttft=t, tail=tail, get=get_s, parts=parts, hit=cached))
    med = {k: _med([s[k] for s in samples]) for k in ("ttft", "tail", "get")}
    floor = med["get"] + med["tail"]
    return dict(
        tokens=n,
        tier=tier,
        ttft=med["ttft"],
        hit=samples[0]["hit"],
        floor=floor,
        get_s=med["get"],
        tail_s=med["tail"],
        bw=samples[0]["hit"] // case.connector.block_tokens * case.block_bytes / med["get"],
        vs_floor=_med([s["ttft"] / (s["get"] + s["tail"]) for s in samples]),
        first_ttft=samples[0]["ttft"],
        parts={p: _med([s["parts"][p] for s in samples]) for p in PARTS},
        reps=reps,
        samples=[{k: s[k] for k in ("ttft", "tail", "get", "parts")} for s in samples],
    )


async def bench_length(
    model_dir: str, n: int, kv_dtype: str, root: str, daemon_addr: str, reps: int
) -> list[dict]:
    vocab = 49152
    g = torch.Generator().manual_seed(n)
    prompt = torch.randint(100, vocab - 100, (n,), generator=g).tolist()
    rows = []
    opts = "lookup_deadline_s=30&load_deadline_s=60&policy=always"
    local = f"local://{root}/store-{kv_dtype}-{n}?{opts}"

    # cold, then the engine's own prefix cache (tail compute only)
    a = _engine(model_dir, local, kv_dtype, prefix_cache=True)
    await _warm(a)
    cold, cached, tok_cold, _ = await _ttft(a, prompt)
    assert cached == 0
    require_saved(await a.connector.flush(120), "ttft: local store")
    keys = a.connector.ns.block_keys(prompt)
    bb = a.connector.block_bytes

    async def tail() -> float:
        t, hit, tok, _ = await _ttft(a, prompt)
        assert tok == tok_cold and hit > 0
        return t

    tails = [await tail() for _ in range(reps)]
    rows.append(dict(tokens=n, tier="cold", ttft=cold, hit=0, floor=None))
    hit = (n - 1) // a.engine.config.page_size * a.engine.config.page_size  # all but the tail
    rows.append(dict(tokens=n, tier="engine cache", ttft=_med(tails), hit=hit, floor=_med(tails)))

    def case(url: str, backend=None) -> AsyncEngine:
        e = _engine(model_dir, url, kv_dtype, prefix_cache=False, backend=backend)
        e.prompt, e.block_bytes = prompt, bb
        return e

    # DRAM of the in-process store: a fresh engine sharing the store
    b = case(local, a.connector.backend)
    await _warm(b)
    rows.append(
        await _hits(
            b, "local dram", n, reps, tok_cold, tail, lambda: _get_seconds(a.connector.backend, keys, bb)
        )
    )
    b.connector.backend = Backend()
    await b.stop()

    # a daemon over loopback: the same blocks stored there, then a fresh engine loads
    e = case(f"kvstore://{daemon_addr}?{opts}")
    await e.start()
    await _copy_blocks(a.connector.backend, e.connector.backend, keys, bb)
    await _warm(e)
    rows.append(
        await _hits(
            e, "remote daemon", n, reps, tok_cold, tail, lambda: _get_seconds(e.connector.backend, keys, bb)
        )
    )
    await e.stop()
    await a.stop()

    # disk: the same store reopened with DRAM off (LMDB pages are in the OS page cache); its
    # tail samples are the engine cache's above (one process may open the store only once)
    c = case(local + "&dram_capacity=0")
    await _warm(c)
    it = iter(tails)
    rows.append(
        await _hits(
            c,
            "local disk",
            n,
            reps,
            tok_cold,
            lambda: _next(it),
            lambda: _get_seconds(c.connector.backend, keys, bb),
        )
    )
    await c.stop()
    for r in rows:
        r["kv_dtype"] = kv_dtype
        r["block_bytes"] = bb
        r["speedup"] = cold / r["ttft"]
        r.setdefault("vs_floor", r["ttft"] / r["floor"] if r["floor"] else None)
    return rows


async def _next(it) -> float:
    return next(it)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["kv_dtype"] == rows[0]["kv_dtype"]]
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
    ax.set_title(f"SmolLM2-135M on CPU, {rows[0]['kv_dtype']} KV: TTFT cold vs hit (black: hit floor)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def fp8_over_bf16(rows: list[dict]) -> list[dict]:
    """Per prompt length and tier: fp8's block bytes and TTFT over bf16's (same run)."""
    by = {(r["kv_dtype"], r["tokens"], r["tier"]): r for r in rows}
    return [
        dict(tokens=n, tier=t, block_bytes=f["block_bytes"] / b["block_bytes"], ttft=f["ttft"] / b["ttft"])
        for (d, n, t), f in by.items()
        if d == "fp8_e4m3" and (b := by.get(("bf16", n, t)))
    ]


def print_table(rows: list[dict]) -> None:
    ms = lambda x: None if x is None else round(x * 1000, 1)  # noqa: E731
    head = ["kv dtype", "tokens", "tier", "TTFT ms", "hit", "speedup", "floor ms", "x floor"]
    head += ["GET ms", "tail ms", "lookup ms", "load ms", "compute ms", "1st ms"]
    out = []
    for r in rows:
        line = [r["kv_dtype"], r["tokens"], r["tier"], ms(r["ttft"]), r["hit"], round(r["speedup"], 1)]
        line += [ms(r["floor"]), None if r["vs_floor"] is None else round(r["vs_floor"], 2)]
        p = r.get("parts")
        line += [ms(r.get("get_s")), ms(r.get("tail_s"))] + [
            ms(p[k]) if p else None for k in PARTS if k != "queue"
        ]
        out.append([*line, ms(r.get("first_ttft"))])
    print(common.md_table(head, out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL_DIR)
    ap.add_argument("--lengths", default="1024,4096,8000")
    ap.add_argument("--kv-dtypes", default="bf16,fp8_e4m3", help="KV cache dtypes (auto: the model's)")
    ap.add_argument("--reps", type=int, default=3, help="hits per case (medians reported)")
    ap.add_argument("--json")
    ap.add_argument("--plot")
    a = ap.parse_args()
    from rich.console import Console

    model_dir = ensure_model(a.model, Console())
    load0 = common.loadavg()
    root = tempfile.mkdtemp(prefix="tierkv-ttft-")
    daemon = common.start_daemon(Path(root) / "daemon", dram={"capacity": "2GiB"})
    rows: list[dict] = []
    try:
        for kd in a.kv_dtypes.split(","):
            for n in [int(x) for x in a.lengths.split(",")]:
                rows += asyncio.run(bench_length(model_dir, n, kd, root, daemon.addr, a.reps))
    finally:
        daemon.stop()
        shutil.rmtree(root, ignore_errors=True)
    print(f"load average at start {load0}, at end {common.loadavg()}")
    print_table(rows)
    ratios = fp8_over_bf16(rows)
    for r in ratios:
        print(
            f"fp8/bf16 at {r['tokens']} tokens, {r['tier']}: block bytes {r['block_bytes']:.3f}, TTFT {r['ttft']:.2f}"
        )
    doc = dict(model=Path(model_dir).name, reps=a.reps, loadavg_start=load0, rows=rows, fp8_over_bf16=ratios)
    common.write_json(a.json, doc)
    if a.plot:
        plot(rows, a.plot)


if __name__ == "__main__":
    main()
