"""The serving cases of issue 11 on one GPU, each beside a floor measured in the same run.
A Llama-3.1-8B-shaped model with random bf16 weights, a 32K-token prompt:

  cold             a fresh engine computes the prompt (floor: its matmul FLOPs at the measured
                   bf16 matmul peak)
  hbm_hit          the same engine again: its own prefix cache (floor: reading the weights once,
                   at the measured device copy bandwidth — the tail's compute)
  dram_hit         a fresh engine over an in-process ``local://`` store (pinned DRAM)
                   (floor: KV bytes / pinned host-to-device bandwidth + the tail floor)
  remote_hit       a fresh engine's *first request after start* against a ``kvstore serve``
                   daemon this script starts on loopback (floor: KV bytes / loopback socket
                   bandwidth over the connector's parallel connections + the tail floor)
  auto_remote_hit  the same with ``policy=auto`` (floor: the cold TTFT: never slower than cold)
  disk_hit         the same ``local://`` store reopened with DRAM off: its disk (LMDB, in the
                   OS page cache) (floor: as dram_hit's, a lower bound)
  *_fp8            cold, remote, DRAM and disk hits with ``--kv-cache-dtype fp8_e4m3`` (issue
                   15): blocks of half the bytes plus scales, stored by a cold fp8 engine
                   (floors as bf16's, on the fp8 bytes); ``x_bf16`` = its TTFT / the bf16
                   case's (target <= 0.6 at 32K for remote_hit_fp8)
  decode_b1/b32    decode tokens/s at batch 1 and 32 (floor: one weight read per step)
  prefill_32k      one cold prefill (floor: FLOPs at the matmul peak)

Writes a JSON list of rows ``{"case", "tokens", "ttft_ms", "hit_tokens", "floor_ms", "x_floor",
"tok_s"[, "x_bf16"]}`` to ``--json`` and each case's engine timeline (ms per phase) beside it
(``--timeline``); remote_hit's also has ``layer_groups``: per prefill step its wall time and,
per layer group its load arrived in, ``[first, stop, load_wait_ms, compute_ms]`` (the engine's
layer timing, engine/runner.py), printed as a ``layers:`` line too. ``--tiny`` runs the same
script on CPU with a tiny model and short prompts (a smoke check; its numbers mean nothing).
The same dtype x tier matrix on CPU with a real model, each hit beside a raw GET of its blocks:
bench/ttft.py.

    python bench/gpu_serving.py --json OUT/gpu_serving.json [--tokens 32768]
    python bench/gpu_serving.py --tiny --json /tmp/x.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import common
import torch
from gpu_engine import build, decode_run, llama31_8b, prefill_flops, tiny_config, ttft
from serving_floors import device_copy_bytes_per_s, h2d_bytes_per_s, loopback_bytes_per_s, matmul_peak_tflops

from connector.backends import Backend
from connector.flush import require_saved
from engine.config import EngineConfig
from engine.kv_cache import KVCache
from engine.sequence import SamplingParams
from engine.timeline import PHASES

LOAD_PARALLEL = 4  # the connector's parallel GET batches (= connections used); the floor uses as many


def _timeline_ms(aeng, before: dict[str, float]) -> dict[str, float]:
    tl = aeng.engine.timeline
    return {p: round((tl.total(p) - before.get(p, 0.0)) * 1000, 3) for p in PHASES}


def _snap(aeng) -> dict[str, float]:
    return {p: aeng.engine.timeline.total(p) for p in PHASES}


def _layer_groups_ms(aeng) -> list[dict]:
    """The engine's per-layer-group records so far (layer timing on), in ms."""
    return [
        {
            "tokens": s.tokens,
            "wall_ms": round(s.wall_s * 1000, 3),
            "groups": [
                [g.first, g.stop, round(g.load_wait_s * 1000, 3), round(g.compute_s * 1000, 3)]
                for g in s.groups
            ],
        }
        for s in aeng.engine.timeline.layer_steps()
    ]


def _row(case, tokens, ttft_ms=None, hit=None, floor_ms=None, tok_s=None, x=None) -> dict:
    if x is None and ttft_ms is not None and floor_ms:
        x = ttft_ms / floor_ms
    r = dict(
        case=case, tokens=tokens, ttft_ms=ttft_ms, hit_tokens=hit, floor_ms=floor_ms, x_floor=x, tok_s=tok_s
    )
    print("measured:", json.dumps(r), flush=True)
    return r


async def _measure(aeng, prompt, timelines: dict, case: str) -> tuple[float, int]:
    before = _snap(aeng)
    secs, cached, _ = await ttft(aeng, prompt)
    timelines[case] = _timeline_ms(aeng, before)
    return secs * 1000, cached


def _kv_bytes(mc, kv_dtype: str, n: int, bt: int) -> int:
    """Bytes of the whole blocks of an ``n``-token prompt (fp8: plus its fp32 scales)."""
    if kv_dtype == "fp8_e4m3":
        scales = 4 * mc.num_layers * 2 * mc.num_kv_heads
        per_block = bt * KVCache.bytes_per_page(
            mc.num_layers, 1, mc.num_kv_heads, mc.head_dim, torch.float8_e4m3fn
        )
        return n // bt * (per_block + scales)
    return (
        n // bt * bt * KVCache.bytes_per_page(mc.num_layers, 1, mc.num_kv_heads, mc.head_dim, torch.bfloat16)
    )


async def hits(
    a, mc, cfg: EngineConfig, kv_dtype: str, n: int, floors: dict, rows: list, timelines: dict
) -> None:
    """One KV dtype's row of the matrix. A cold engine computes the prompt and saves it to a
    daemon (bf16: then hits its own HBM cache); fresh engines' first requests load it from the
    daemon (bf16: with policy always, then auto); then over an in-process ``local://`` store one
    engine computes and saves, a fresh one loads from pinned DRAM, and a third from the same
    store reopened with DRAM off (its disk). Cases of another dtype than bf16 are suffixed
    (``remote_hit_fp8``) and carry ``x_bf16``."""
    cfg = dataclasses.replace(cfg, kv_cache_dtype=kv_dtype)
    sfx = "" if kv_dtype == "bf16" else "_fp8"
    bf16 = {r["case"]: r["ttft_ms"] for r in rows}

    def add(case: str, ms: float, cached: int, floor_ms: float) -> None:
        rows.append(_row(case + sfx, n, ms, cached, floor_ms))
        if sfx:
            rows[-1]["x_bf16"] = ms / bf16[case] if bf16.get(case) else None

    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(100, mc.vocab_size - 100, (n,), generator=g).tolist()
    bt = a.block_tokens
    kv_bytes = _kv_bytes(mc, kv_dtype, n, bt)
    tail = floors["tail_ms"]
    opts = f"lookup_deadline_s=60&load_deadline_s=120&save_deadline_s=600&block_tokens={bt}&load_parallel={LOAD_PARALLEL}"
    opts += f"&save_queue_bytes={int(kv_bytes * 1.1)}"
    dram = int(kv_bytes * 1.25) + (256 << 20)
    root = tempfile.mkdtemp(prefix=f"tierkv-gpu-serving-{kv_dtype}-")
    slab = f"{max(4, kv_bytes // max(1, n // bt) // (1 << 20) + 1)}MiB"  # one block and its header
    with common.running_daemon(
        Path(root) / "daemon", dram={"capacity": str(dram), "slab_size": slab}, ready_s=120
    ) as d:
        remote = f"kvstore://{d.addr}?{opts}&replicas=1"
        e1 = build(mc, cfg, remote + "&policy=always", prefix_cache=not sfx)
        await e1.start()
        cold_ms, _ = await _measure(e1, prompt, timelines, "cold" + sfx)
        add("cold", cold_ms, 0, floors["prefill_ms"])
        require_saved(await e1.connector.flush(600), f"gpu_serving: {kv_dtype} saves to the daemon")
        if not sfx:
            hbm_ms, cached = await _measure(e1, prompt, timelines, "hbm_hit")
            add("hbm_hit", hbm_ms, cached, tail)
        await e1.stop()
        del e1
        _free()
        # fresh engines against the daemon: the first request after start must hit every block
        if "loopback_bytes_per_s" not in floors:
            floors["loopback_bytes_per_s"] = loopback_bytes_per_s(LOAD_PARALLEL, min(kv_bytes, 1 << 30))
        bw_net = floors["loopback_bytes_per_s"]
        for case, policy in (("remote_hit", "always"), ("auto_remote_hit", "auto"))[: 1 if sfx else 2]:
            e = build(mc, cfg, remote + f"&policy={policy}", prefix_cache=False)
            if case == "remote_hit" and not sfx:  # where its time goes, per layer group (no sync added)
                e.engine.runner.time_layers(True)
            await e.start()
            ms, cached = await _measure(e, prompt, timelines, case + sfx)
            if case == "remote_hit" and not sfx:
                layers = timelines[case]["layer_groups"] = _layer_groups_ms(e)
                print("layers:", json.dumps({"case": case, "steps": layers}), flush=True)
            add(case, ms, cached, cold_ms if policy == "auto" else kv_bytes / bw_net * 1000 + tail)
            await e.stop()
            del e
            _free()
    # pinned DRAM in this process (local://): one engine computes and saves, a fresh one loads
    local = f"local://{root}/local?{opts}&policy=always&dram_capacity={dram}&disk_capacity={2 * kv_bytes + (256 << 20)}"
    e1 = build(mc, cfg, local, prefix_cache=False)
    await e1.start()
    await ttft(e1, prompt)
    require_saved(await e1.connector.flush(600), f"gpu_serving: {kv_dtype} saves to local://")
    e2 = build(mc, cfg, local, backend=e1.connector.backend, prefix_cache=False)
    await e2.start()
    ms, cached = await _measure(e2, prompt, timelines, "dram_hit" + sfx)
    if "h2d_bytes_per_s" not in floors:
        floors["h2d_bytes_per_s"] = h2d_bytes_per_s(cfg.device) or floors["copy_bytes_per_s"]
    h2d_ms = kv_bytes / floors["h2d_bytes_per_s"] * 1000
    add("dram_hit", ms, cached, h2d_ms + tail)
    e2.connector.backend = Backend()  # the shared store is closed with e1
    await e2.stop()
    await e1.stop()
    del e1, e2
    _free()
    # its disk: the same store reopened with DRAM off (one process opens a store once at a time)
    e3 = build(mc, cfg, local.replace(f"dram_capacity={dram}", "dram_capacity=0"), prefix_cache=False)
    await e3.start()
    ms, cached = await _measure(e3, prompt, timelines, "disk_hit" + sfx)
    add("disk_hit", ms, cached, h2d_ms + tail)
    await e3.stop()
    del e3
    _free()


def engine_figures(a, mc, cfg: EngineConfig, n: int, floors: dict, rows: list) -> None:
    """Decode tokens/s at batch 1 and 32 and one cold prefill of ``n`` tokens."""
    from engine.llm import LLMEngine

    eng = LLMEngine.from_random(mc, cfg, seed=0)
    eng.warm_up()
    g = torch.Generator().manual_seed(2)
    for b in (1, 32):
        dt, steps = decode_run(eng, mc, b, a.decode_prompt, a.decode_tokens, g)
        step_ms = dt / max(1, steps) * 1000
        tok_s = b * (a.decode_tokens - 1) / dt
        rows.append(
            _row(f"decode_b{b}", b, None, None, floors["tail_ms"], tok_s, step_ms / floors["tail_ms"])
        )
    prompt = torch.randint(0, mc.vocab_size, (n,), generator=g).tolist()
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    eng.generate([prompt[: min(n, 512)]], one)  # no prefix cache (random engine): cold every time
    _sync()
    t0 = time.perf_counter()
    eng.generate([prompt], one)
    _sync()
    dt = time.perf_counter() - t0
    rows.append(_row("prefill_32k", n, dt * 1000, 0, floors["prefill_ms"], n / dt))
    del eng
    _free()


def cfg_dtype(cfg: EngineConfig) -> torch.dtype:
    return getattr(torch, cfg.torch_dtype_name())


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _free() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> None:
    # bench/gpu_run.sh stops a step past its limit with SIGTERM: unwind, so the rows measured
    # so far are still written (the finally below)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--block-tokens", type=int, default=256)
    ap.add_argument("--decode-prompt", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument(
        "--kv-dtypes", default="bf16,fp8_e4m3", help="the hits' KV dtypes (the first: bf16's cases)"
    )
    ap.add_argument("--only", choices=["serving", "engine"], help="run one part only")
    ap.add_argument("--tiny", action="store_true", help="tiny model on CPU: check the script runs")
    ap.add_argument("--json", required=True, help="rows go here")
    ap.add_argument("--timeline", help="per-case engine timelines (default: beside --json)")
    a = ap.parse_args()
    if not a.tiny and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device (use --tiny to smoke-test on CPU)")
    mc = tiny_config() if a.tiny else llama31_8b()
    device = "cpu" if a.tiny else "cuda"
    n = min(a.tokens, 1024) if a.tiny else a.tokens
    if a.tiny:
        a.block_tokens, a.decode_prompt, a.decode_tokens = 64, 16, 8
    cfg = EngineConfig(
        device=device, kv_cache_bytes=(256 << 20) if a.tiny else (12 << 30), max_num_batched_tokens=8192,
        max_num_seqs=32, max_model_len=n + 64,
    )  # fmt: skip
    dtype = cfg_dtype(cfg)
    weight_bytes = _weight_bytes(mc, dtype)
    peak = matmul_peak_tflops(device, dtype)
    copy_bw = device_copy_bytes_per_s(device)
    floors = {
        "matmul_peak_tflops": peak,
        "copy_bytes_per_s": copy_bw,
        "weight_bytes": weight_bytes,
        "tail_ms": weight_bytes / copy_bw * 1000,  # one read of the weights: a short tail's floor
        "prefill_ms": prefill_flops(mc, n) / (peak * 1e12) * 1000,
    }
    print("floors:", json.dumps(floors), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
    rows: list[dict] = []
    timelines: dict[str, dict] = {}
    try:
        if a.only != "engine":
            for kv_dtype in a.kv_dtypes.split(","):
                asyncio.run(hits(a, mc, cfg, kv_dtype, n, floors, rows, timelines))
        if a.only in (None, "engine"):
            engine_figures(a, mc, cfg, n, floors, rows)
    finally:  # what was measured is kept even when a later case fails
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
        tpath = a.timeline or os.path.join(os.path.dirname(os.path.abspath(a.json)), "gpu_timeline.json")
        with open(tpath, "w") as f:
            device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
            json.dump({"device": device_name, "floors": floors, "timeline_ms": timelines}, f, indent=1)
    print(f"{'case':16} {'tokens':>7} {'TTFT ms':>9} {'hit':>7} {'floor ms':>9} {'x floor':>8} {'tok/s':>9}")
    for r in rows:
        print(f"{r['case']:16} {r['tokens']:>7} {_f(r['ttft_ms']):>9} {_f(r['hit_tokens'], 0):>7} "
              f"{_f(r['floor_ms']):>9} {_f(r['x_floor'], 2):>8} {_f(r['tok_s']):>9}")  # fmt: skip


def _weight_bytes(mc, dtype: torch.dtype) -> int:
    h, kv, i = mc.hidden_size, mc.num_kv_heads * mc.head_dim, mc.intermediate_size
    per_layer = h * h * 2 + 2 * h * kv + 3 * h * i
    return (mc.num_layers * per_layer + mc.vocab_size * h) * torch.empty((), dtype=dtype).element_size()


def _f(v, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


if __name__ == "__main__":
    main()
