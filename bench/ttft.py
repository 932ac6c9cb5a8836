"""Time to first token, cold vs hit, over a KV dtype x store matrix, each hit beside its floor
measured in the same run — the one TTFT bench, on CPU or a GPU (``--device cpu|cuda``; run on a
lent GPU by bench/gpu_run.sh).

The model: a Hugging Face folder (``--model``, default the bundled SmolLM2-135M) or random
weights of a named shape (``--random llama31_8b|tiny``). For each KV cache dtype
(``--kv-dtypes``, default bf16 and fp8_e4m3: fp8 blocks are about half the bytes) and prompt
length (``--lengths``), the columns (``--stores``, default all):
- cold: a warm engine with an empty store computes the whole prompt;
- engine cache: the same engine again (its own prefix cache: HBM on a GPU): only the tail
  after the last full block is computed — the *tail compute* of every hit below;
- local dram / local disk: a fresh engine loading from the in-process ``local://`` store's
  DRAM (pinned on a GPU), and from its LMDB (the store reopened with DRAM off);
- remote daemon: from a ``kvstore serve`` daemon on loopback holding the same blocks (copied
  byte for byte from the local store); remote auto: the same with ``policy=auto`` (its floor:
  the cold TTFT — never slower than computing); remote layers: the daemon's blocks copied
  into the pages one layer at a time (``layer_groups`` = the model's layers), with the
  engine's layer timing on (per prefill step, per group: ``[first, stop, load_wait_ms,
  compute_ms]`` in the row's ``layer_groups``).
A hit's floor = the slower of one raw batched GET of the same blocks from that tier and (on a
GPU) one pinned host-to-device copy of their bytes, plus the tail compute, each measured right
before that hit; a case runs ``--reps`` hits (fresh engines keep no prefix cache, so each loads
again) and its row has the medians (× floor: the median of each hit's own ratio), the first hit
apart and the engine timeline (lookup, queue, load, compute). Every hit's first token is
checked against the engine cache's (the same tail over the same KV); a mismatch is reported
and the exit status is 1. Targets: remote hit <= 1.15x its floor (issue 18); fp8 remote hit
<= 0.6x bf16's at 32K on a GPU (issue 15). Prints a table (and fp8 / bf16 per column), writes
JSON (``--json``, also on SIGTERM with the rows so far) and a PNG of the first dtype
(``--plot``). Not a test. Over ~350 lines: one matrix loop for CPU and GPU, its floors and its report together.

    python bench/ttft.py --json docs/results/ttft.json
    python bench/ttft.py --lengths 256 --reps 1                   # a smoke run of the matrix
    python bench/ttft.py --device cuda --random llama31_8b --lengths 32768 --kv-cache 12GiB \
        --chunk 8192 --url-opts 'block_tokens=256&load_parallel=4' --json OUT/ttft.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from statistics import median as _med

import common
import torch
from gpu_engine import llama31_8b, tiny_config
from serving_floors import h2d_bytes_per_s

from connector.backends import Backend
from connector.config import parse_connector_url
from connector.demo import DEFAULT_MODEL_DIR, ensure_model
from connector.flush import require_saved
from connector.store_connector import StoreConnector
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig, ModelConfig
from engine.kv_connector import ConnectorContext
from engine.llm import LLMEngine
from engine.sequence import SamplingParams
from kvstore.client.read import get_into
from kvstore.config import parse_size

ONE = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
PARTS = ("lookup", "queue", "load", "compute")  # engine timeline phases of one request
STORES = ("engine", "dram", "disk", "daemon", "auto", "layers")
TIERS = dict(engine="engine cache", dram="local dram", disk="local disk", daemon="remote daemon")
TIERS.update(auto="remote auto", layers="remote layers")


@dataclasses.dataclass(frozen=True)
class Run:
    """What every case of one run shares."""

    model: str | ModelConfig  # a folder, or the shape of random weights (seed 0)
    cfg: EngineConfig
    opts: str  # connector URL options of every case
    reps: int
    stores: tuple[str, ...]
    h2d: float  # pinned host-to-device bytes/s (0 on CPU)


def _engine(run: Run, kv_dtype: str, url: str, prefix_cache: bool, backend=None) -> AsyncEngine:
    """A warm-able engine of ``run.model`` with a connector on ``url`` (``backend``: a store
    shared with another engine). Random weights have no folder to fingerprint: the prefix cache
    and the connector get a fixed namespace name."""
    cfg = dataclasses.replace(run.cfg, kv_cache_dtype=kv_dtype, enable_prefix_cache=prefix_cache)
    name = None
    if isinstance(run.model, str):
        eng = LLMEngine(run.model, cfg)
    else:
        eng = LLMEngine.from_random(run.model, cfg, seed=0)
        name = f"random-{run.model.hidden_size}x{run.model.num_layers}-seed0"
        if prefix_cache:
            eng.bm.namespace = eng.namespace(cfg.page_size, fingerprint=name)

    def ns(bt: int):
        return eng.namespace(bt, fingerprint=name)

    ctx = ConnectorContext(cfg.page_size, eng.kv, ns, eng.model_dir or "", cfg.device, eng.transfer)
    return AsyncEngine(eng, StoreConnector(ctx, parse_connector_url(url), backend=backend))


async def _stop(e: AsyncEngine) -> None:
    await e.stop()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


async def _ttft(aeng: AsyncEngine, prompt: list[int]) -> tuple[float, int, int, dict[str, float]]:
    """TTFT, cached tokens, the first token, and the request's timeline phases (seconds)."""
    tl = aeng.engine.timeline
    before = {p: tl.total(p) for p in PARTS}
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    async for out in aeng.generate(prompt, ONE):
        dt = time.perf_counter() - t0
        return dt, out.cached_tokens, out.token_id, {p: tl.total(p) - before[p] for p in PARTS}
    raise RuntimeError("no output")


async def _warm(aeng: AsyncEngine) -> None:
    """One short unrelated request first (first-forward costs, connections): every TTFT below
    is a steady-state one."""
    await _ttft(aeng, [5, 6, 7, 8, 9, 10, 11, 12, 13])


def _getter(backend, keys, bb: int):
    """An async callable: seconds of one batched GET of ``keys`` from ``backend`` into buffers
    touched once (before its first call, one GET warms connections and the page cache)."""
    bufs = [torch.zeros(bb, dtype=torch.uint8).numpy() for _ in keys]
    cold = [True]

    async def get() -> float:
        if cold:
            cold.pop()
            res = await get_into(backend, keys, bufs, None, 120)
            assert all(r.status.name == "HIT" for r in res), [r.status for r in res][:4]
        t = time.perf_counter()
        await get_into(backend, keys, bufs, None, 120)
        return time.perf_counter() - t

    return get


async def _copy_blocks(src, dst, keys, bb: int) -> None:
    """Store in ``dst`` the blocks ``src`` holds under ``keys``, byte for byte (headers too):
    what a connector save of the same prompt would write, without computing it again."""
    bufs = [torch.empty(bb, dtype=torch.uint8).numpy() for _ in keys]
    res = await get_into(src, keys, bufs, None, 120)
    assert all(r.status.name == "HIT" for r in res)
    report = await dst.put([(r.header, b) for r, b in zip(res, bufs)], 600)
    assert all(r.status.ok for r in report.results), [r.status for r in report.results][:4]


def _floor(p: dict[str, float]) -> float:
    """A hit's floor from its parts: the cold TTFT where that is the bound, else the slower of
    the raw GET and the host-to-device copy, plus the tail."""
    return p["cold"] if "cold" in p else p["tail"] + max(p["get"], p.get("h2d", 0.0))


async def _hits(run: Run, e: AsyncEngine, prompt, store: str, ref: tuple, floor_of) -> dict:
    """``run.reps`` hits of engine ``e`` (which loads the prompt each time), each beside fresh
    floor samples (``floor_of()``: seconds by part, see :func:`_floor`): per rep its ratio to
    its own floor; the row has the medians and the first hit apart. ``ref``: (cold token,
    engine cache token): a hit's token must equal the second (the first when nothing was hit).
    ``e`` is warm (:func:`_warm`)."""
    samples, wrong = [], 0
    for _ in range(run.reps):
        floor = await floor_of()
        t, cached, tok, parts = await _ttft(e, prompt)
        wrong += tok != ref[1 if cached else 0]
        samples.append(dict(ttft=t, floor=floor, parts=parts, hit=cached))
    floors = [_floor(s["floor"]) for s in samples]
    row = dict(tier=TIERS[store], ttft=_med([s["ttft"] for s in samples]), hit=samples[0]["hit"])
    row.update(floor=_med(floors), first_ttft=samples[0]["ttft"], token_mismatches=wrong, reps=run.reps)
    row["vs_floor"] = _med([s["ttft"] / f for s, f in zip(samples, floors)])
    for k in samples[0]["floor"]:
        row[f"{k}_s"] = _med([s["floor"][k] for s in samples])
    if "get_s" in row:
        row["bw"] = row["hit"] // e.connector.block_tokens * e.connector.block_bytes / row["get_s"]
    row["parts"] = {p: _med([s["parts"][p] for s in samples]) for p in PARTS}
    row["samples"] = [dict(ttft=s["ttft"], **s["floor"]) for s in samples]
    if e.engine.runner.layer_timer is not None:
        row["layer_groups"] = [
            dict(tokens=s.tokens, wall_ms=round(s.wall_s * 1000, 3),
                 groups=[[g.first, g.stop, round(g.load_wait_s * 1000, 3), round(g.compute_s * 1000, 3)]
                         for g in s.groups])
            for s in e.engine.timeline.layer_steps()
        ]  # fmt: skip
    return row


async def bench_length(run: Run, n: int, kv_dtype: str, root: Path, rows: list[dict]) -> None:
    """One prompt length of one KV dtype: every column of ``run.stores``, appended to ``rows``
    as it is measured."""

    def add(row: dict) -> None:
        row.update(kv_dtype=kv_dtype, tokens=n, block_bytes=bb, speedup=cold / row["ttft"])
        rows.append(row)
        print("measured:", {k: v for k, v in row.items() if k not in ("samples", "layer_groups")}, flush=True)

    # cold, then the engine's own prefix cache (tail compute only), over a local:// store that
    # holds what an engine's KV cache can (and a save queue as large)
    kvb = run.cfg.kv_cache_bytes
    opts = f"{run.opts}&save_queue_bytes={kvb}"
    local = f"local://{root}/store-{kv_dtype}-{n}?{opts}&disk_capacity={2 * kvb}&policy=always"
    a = _engine(run, kv_dtype, f"{local}&dram_capacity={kvb + (256 << 20)}", prefix_cache=True)
    vocab = a.engine.model_config.vocab_size
    prompt = torch.randint(100, vocab - 100, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    await _warm(a)
    cold, cached, tok_cold, parts = await _ttft(a, prompt)
    assert cached == 0
    require_saved(await a.connector.flush(600), f"ttft: {kv_dtype} saves to local://")
    keys, bb = a.connector.ns.block_keys(prompt), a.connector.block_bytes
    add(dict(tier="cold", ttft=cold, hit=0, floor=None, parts=parts))
    tails, toks = [], []
    for _ in range(run.reps):
        t, hit, tok, _ = await _ttft(a, prompt)
        assert hit > 0, hit
        tails.append(t)
        toks.append(tok)
    ref = (tok_cold, toks[0])
    if "engine" in run.stores:
        wrong = sum(t != toks[0] for t in toks) + (isinstance(run.model, str) and toks[0] != tok_cold)
        add(dict(tier=TIERS["engine"], ttft=_med(tails), hit=hit, floor=None, token_mismatches=wrong))

    async def live_tail() -> float:
        return (await _ttft(a, prompt))[0]

    async def case(store: str, url: str, shared=None, tail=live_tail, fill=None) -> None:
        """A fresh engine on ``url`` (``shared``: a's store) loads the prompt ``run.reps``
        times, each hit beside its floor's parts sampled right before it."""
        e = _engine(run, kv_dtype, url, False, shared)
        await e.start()
        if fill:  # the blocks a's store holds, stored in e's
            await _copy_blocks(a.connector.backend, e.connector.backend, keys, bb)
        await _warm(e)
        e.engine.runner.time_layers(store == "layers")  # the hits' steps only
        get = _getter(shared or e.connector.backend, keys, bb)

        async def floor() -> dict[str, float]:
            if store == "auto":  # whether to load is the engine's choice: never slower than cold
                return dict(cold=cold)
            p = dict(get=await get(), tail=await tail())
            return dict(p, h2d=len(keys) * bb / run.h2d) if run.h2d else p

        add(await _hits(run, e, prompt, store, ref, floor))
        if shared:
            e.connector.backend = Backend()  # the shared store is closed with a
        await _stop(e)

    if "dram" in run.stores:  # a fresh engine sharing the in-process store
        await case("dram", local, shared=a.connector.backend)
    remote = [s for s in ("daemon", "auto", "layers") if s in run.stores]
    if remote:  # a daemon over loopback holding the same blocks; fresh engines load from it
        slab = f"{max(4, bb // (1 << 20) + 1)}MiB"  # one block and its header
        cap = {"capacity": str(int(len(keys) * bb * 1.25) + (256 << 20)), "slab_size": slab}
        with common.running_daemon(root / f"daemon-{kv_dtype}-{n}", dram=cap, ready_s=120) as d:
            url = f"kvstore://{d.addr}?{opts}&replicas=1"
            for store in remote:
                policy = "auto" if store == "auto" else "always"
                layers = f"&layer_groups={a.engine.kv.num_layers}" if store == "layers" else ""
                await case(store, f"{url}&policy={policy}{layers}", fill=store == remote[0])
    await _stop(a)
    if "disk" in run.stores:  # the same store reopened with DRAM off (LMDB pages in the OS page
        # cache); its tails are the engine cache's above (one process opens a store once at a time)
        recorded = iter(tails)

        async def recorded_tail() -> float:
            return next(recorded)

        await case("disk", f"{local}&dram_capacity=0", tail=recorded_tail)


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["kv_dtype"] == rows[0]["kv_dtype"]]
    tiers = list(dict.fromkeys(r["tier"] for r in rows))
    lengths = sorted({r["tokens"] for r in rows})
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(tiers)
    for i, tier in enumerate(tiers):
        got = {r["tokens"]: r for r in rows if r["tier"] == tier}
        xs = [j + (i - len(tiers) / 2) * width for j, n in enumerate(lengths) if n in got]
        ax.bar(xs, [got[n]["ttft"] * 1000 for n in lengths if n in got], width, label=tier)
        fl = [(x, got[n]["floor"]) for x, n in zip(xs, [n for n in lengths if n in got]) if got[n]["floor"]]
        ax.scatter([x for x, _ in fl], [f * 1000 for _, f in fl], marker="_", s=300, color="black", zorder=3)
    ax.set_xticks(range(len(lengths)), [f"{n} tokens" for n in lengths])
    ax.set_ylabel("TTFT (ms, log)")
    ax.set_yscale("log")
    ax.set_title(f"{title}, {rows[0]['kv_dtype']} KV: TTFT cold vs hit (black: hit floor)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def fp8_over_bf16(rows: list[dict]) -> list[dict]:
    """Per prompt length and column: fp8's block bytes and TTFT over bf16's (same run)."""
    by = {(r["kv_dtype"], r["tokens"], r["tier"]): r for r in rows}
    return [
        dict(tokens=n, tier=t, block_bytes=f["block_bytes"] / b["block_bytes"], ttft=f["ttft"] / b["ttft"])
        for (d, n, t), f in by.items()
        if d == "fp8_e4m3" and (b := by.get(("bf16", n, t)))
    ]


def print_table(rows: list[dict]) -> None:
    ms = lambda x: None if x is None else round(x * 1000, 1)  # noqa: E731
    head = ["kv dtype", "tokens", "tier", "TTFT ms", "hit", "speedup", "floor ms", "x floor"]
    head += ["GET ms", "tail ms", "lookup ms", "load ms", "compute ms", "1st ms", "wrong tok"]
    out = []
    for r in rows:
        line = [r["kv_dtype"], r["tokens"], r["tier"], ms(r["ttft"]), r["hit"], round(r["speedup"], 1)]
        line += [ms(r["floor"]), round(r["vs_floor"], 2) if r.get("vs_floor") else None]
        p = r.get("parts")
        line += [ms(r.get("get_s")), ms(r.get("tail_s"))]
        line += [ms(p[k]) if p else None for k in PARTS if k != "queue"]
        out.append([*line, ms(r.get("first_ttft")), r.get("token_mismatches")])
    print(common.md_table(head, out))


def main() -> None:
    # bench/gpu_run.sh stops a step past its time limit with SIGTERM: unwind, so the rows
    # measured so far are still written (the finally below)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--model", default=DEFAULT_MODEL_DIR, help="a Hugging Face model folder")
    ap.add_argument("--random", choices=["llama31_8b", "tiny"], help="random weights of this shape instead")
    ap.add_argument("--lengths", default="1024,4096,8000")
    ap.add_argument("--kv-dtypes", default="bf16,fp8_e4m3", help="KV cache dtypes (auto: the model's)")
    ap.add_argument("--stores", default=",".join(STORES), help=f"columns, of {','.join(STORES)}")
    ap.add_argument("--reps", type=int, default=3, help="hits per case (medians reported)")
    ap.add_argument("--kv-cache", default="1GiB", help="each engine's KV cache")
    ap.add_argument("--chunk", type=int, default=2048, help="the engine's max batched tokens per step")
    ap.add_argument("--backend", default="auto", help="attention backend: auto|torch|triton|flash_attn")
    ap.add_argument("--url-opts", default="", help="more connector URL options, e.g. block_tokens=256")
    ap.add_argument("--json")
    ap.add_argument("--plot")
    a = ap.parse_args()
    stores = tuple(a.stores.split(","))
    if bad := [s for s in stores if s not in STORES]:
        ap.error(f"--stores: unknown {bad} (known: {','.join(STORES)})")
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("ttft: --device cuda, but torch sees no CUDA device")
    lengths = [int(x) for x in a.lengths.split(",")]
    if a.random:
        model = llama31_8b() if a.random == "llama31_8b" else tiny_config()
    else:
        from rich.console import Console

        model = ensure_model(a.model, Console())
    cfg = EngineConfig(
        device=a.device, kv_cache_bytes=parse_size(a.kv_cache, "--kv-cache"), max_num_batched_tokens=a.chunk,
        max_num_seqs=32, attention_backend=a.backend, max_model_len=max(lengths) + 64,
    )  # fmt: skip
    opts = "lookup_deadline_s=60&load_deadline_s=120&save_deadline_s=600" + (a.url_opts and "&" + a.url_opts)
    run = Run(model, cfg, opts, a.reps, stores, h2d_bytes_per_s(a.device))
    label = f"random {a.random}" if a.random else Path(model).name
    device_name = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    load0 = common.loadavg()
    root = Path(tempfile.mkdtemp(prefix="tierkv-ttft-"))
    rows: list[dict] = []
    try:
        for kd in a.kv_dtypes.split(","):
            for n in lengths:
                asyncio.run(bench_length(run, n, kd, root, rows))
    finally:  # what was measured is kept even when a later case fails
        shutil.rmtree(root, ignore_errors=True)
        print(f"{label} on {device_name}; load average at start {load0}, at end {common.loadavg()}")
        print_table(rows)
        ratios = fp8_over_bf16(rows)
        for r in ratios:
            print(f"fp8/bf16 at {r['tokens']} tokens, {r['tier']}: block bytes {r['block_bytes']:.3f}, TTFT {r['ttft']:.2f}")  # fmt: skip
        doc = dict(
            model=label,
            device=device_name,
            backend=a.backend,
            reps=a.reps,
            h2d_bytes_per_s=run.h2d,
            loadavg_start=load0,
        )
        common.write_json(a.json, dict(doc, rows=rows, fp8_over_bf16=ratios))
    if a.plot:
        plot(rows, a.plot, f"{label} on {device_name}")
    if wrong := sum(r.get("token_mismatches") or 0 for r in rows):
        raise SystemExit(f"ttft: {wrong} hit(s) gave another first token than the engine cache's")


if __name__ == "__main__":
    main()
