"""Microbenchmark of one attention layer over a paged KV cache: the Triton paged kernel
(engine/triton_paged.py, K/V read in place) against the gather + SDPA path (the torch
backend: cached K/V gathered from the pages, GQA heads expanded on CUDA, SDPA), beside a floor:
reading the context's K/V bytes once at the HBM bandwidth a torch copy measures in the same run.

Cases per context length (8K and 32K tokens): ``decode_b1`` (one token), ``decode_b32``
(32 sequences, one token each), ``tail16`` (a 16-token prefill over the cached context: the
engine's prefix-cache hit). Shape of Llama-3.1-8B: 32 query heads, 8 KV heads, head_dim 128,
bf16, 16-token pages scattered over the pool. Prints a table; ``--json PATH`` writes the rows.

    python bench/paged_attention.py [--json PATH]          # a CUDA device
    python bench/paged_attention.py --tiny [--json PATH]   # CPU, Triton interpreter, small shapes

``--tiny`` only proves the script and the kernel run (interpreter timings mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class Shape:
    heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype
    contexts: tuple[int, ...]
    decode_batch: int
    tail: int


FULL = Shape(32, 8, 128, 16, torch.bfloat16, (8192, 32768), 32, 16)
TINY = Shape(8, 2, 64, 16, torch.float32, (96,), 3, 5)


@dataclass
class Row:
    case: str
    context: int
    kv_mib: float
    kernel_ms: float
    gather_sdpa_ms: float
    floor_ms: float
    kernel_x_floor: float
    speedup: float
    max_abs_diff: float


def timed(fn, device: str, reps: int) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` runs after a warm-up."""
    fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def hbm_bytes_per_ms(device: str, reps: int) -> float:
    """Bandwidth of a device copy of 1 GiB (read + write counted), bytes per millisecond."""
    n = (1 << 30) if device == "cuda" else (1 << 24)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src), device, reps)
    return 2 * n / ms


def make_case(shape: Shape, queries: list[int], contexts: list[int], device: str):
    """Pages for the sequences, scattered over a pool with a spare page between neighbours."""
    from engine.attention_meta import build_metadata

    ps = shape.page_size
    need = [-(-c // ps) for c in contexts]
    pool = 2 * sum(need) + 1
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(pool, generator=g).tolist()
    tables, off = [], 0
    for n in need:
        tables.append(perm[off : off + n])
        off += n
    kc = torch.randn(pool, ps, shape.kv_heads, shape.head_dim, dtype=shape.dtype, device=device)
    vc = torch.randn_like(kc)
    q = torch.randn(sum(queries), shape.heads, shape.head_dim, dtype=shape.dtype, device=device)
    meta = build_metadata(queries, contexts, tables, ps, device)
    k_new = kc.view(-1, shape.kv_heads, shape.head_dim)[meta.slot_mapping]
    v_new = vc.view(-1, shape.kv_heads, shape.head_dim)[meta.slot_mapping]
    return q, k_new, v_new, kc, vc, meta


def measure(name, shape: Shape, qs, cs, triton_be, torch_be, bw: float, device: str, reps: int) -> Row:
    """One case: both backends on the same pages; their largest difference is reported."""
    q, k, v, kc, vc, meta = make_case(shape, qs, cs, device)
    elem = torch.empty((), dtype=shape.dtype).element_size()
    kv_bytes = 2 * sum(cs) * shape.kv_heads * shape.head_dim * elem
    got = triton_be.forward(q, k, v, kc, vc, meta)
    ref = torch_be.forward(q, k, v, kc, vc, meta)
    diff = float((got.float() - ref.float()).abs().max())
    k_ms = timed(lambda: triton_be.forward(q, k, v, kc, vc, meta), device, reps)
    g_ms = timed(lambda: torch_be.forward(q, k, v, kc, vc, meta), device, reps)
    floor = kv_bytes / bw
    return Row(name, cs[0], kv_bytes / 2**20, k_ms, g_ms, floor, k_ms / floor, g_ms / k_ms, diff)


def run(shape: Shape, device: str, reps: int) -> list[Row]:
    from engine.attention_torch import TorchAttention
    from engine.attention_triton import create as create_triton

    triton_be = create_triton(device, shape.heads, shape.kv_heads, shape.head_dim, shape.dtype)
    torch_be = TorchAttention(shape.heads, shape.kv_heads, shape.head_dim)
    bw = hbm_bytes_per_ms(device, reps)
    rows = []
    for ctx in shape.contexts:
        cases = {
            "decode_b1": ([1], [ctx]),
            f"decode_b{shape.decode_batch}": ([1] * shape.decode_batch, [ctx] * shape.decode_batch),
            f"tail{shape.tail}": ([shape.tail], [ctx]),
        }
        for name, (qs, cs) in cases.items():
            rows.append(measure(name, shape, qs, cs, triton_be, torch_be, bw, device, reps))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="CPU, Triton interpreter, small shapes")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--reps", type=int, default=None)
    a = ap.parse_args(argv)
    if a.tiny:
        if "triton" in sys.modules:
            raise SystemExit("--tiny must set TRITON_INTERPRET=1 before triton is imported")
        os.environ["TRITON_INTERPRET"] = "1"
        shape, device, reps = TINY, "cpu", a.reps or 2
    else:
        if not torch.cuda.is_available():
            raise SystemExit("needs a CUDA device (or --tiny)")
        shape, device, reps = FULL, "cuda", a.reps or 20
    rows = run(shape, device, reps)
    print(f"{'case':<11} {'ctx':>6} {'KV MiB':>7} {'kernel ms':>10} {'gather+SDPA':>12} {'floor ms':>9} "
          f"{'x floor':>8} {'speedup':>8} {'max|diff|':>10}")  # fmt: skip
    for r in rows:
        print(f"{r.case:<11} {r.context:>6} {r.kv_mib:>7.1f} {r.kernel_ms:>10.3f} {r.gather_sdpa_ms:>12.3f} "
              f"{r.floor_ms:>9.3f} {r.kernel_x_floor:>8.2f} {r.speedup:>8.2f} {r.max_abs_diff:>10.2e}")  # fmt: skip
    if a.json:
        meta = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
                "torch": torch.__version__, "shape": {**asdict(shape), "dtype": str(shape.dtype)}}  # fmt: skip
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "rows": [asdict(r) for r in rows]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
