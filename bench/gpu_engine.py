"""GPU benchmark for a lent device (not run in CI): a Llama-3.1-8B-shaped model with random
bf16 weights created on the GPU. Cold prefill at 2K / 8K / 32K tokens with achieved TFLOP/s
beside a measured bf16 matmul peak, and decode tokens/s at batch 1 and 32. Prints a table;
``--json PATH`` writes the numbers. Also the model shapes and engine helpers
bench/gpu_serving.py builds its engines with (``llama31_8b``, ``tiny_config``, ``build``, ``ttft``).

    python bench/gpu_engine.py --json gpu.json [--backend auto|torch|triton|flash_attn]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from serving_floors import matmul_peak_tflops


def llama31_8b():
    from engine.config import ModelConfig, RopeConfig

    return ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, max_position=131072,
        rope=RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                        high_freq_factor=4.0, original_max_position=8192),
    )  # fmt: skip


def tiny_config():
    """A tiny Llama for ``--tiny`` smoke runs on CPU."""
    from engine.config import ModelConfig, RopeConfig

    return ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5, max_position=8192, rope=RopeConfig(theta=1e4),
    )  # fmt: skip


def build(mc, cfg, url: str | None, backend=None, prefix_cache: bool = True):
    """An AsyncEngine over random weights of shape ``mc`` (seed 0), its connector on ``url``
    (``backend``: a store shared with another engine). Random weights have no folder to
    fingerprint: the engine's prefix cache and the connector get a fixed namespace name."""
    from connector.config import parse_connector_url
    from connector.store_connector import StoreConnector
    from engine.async_engine import AsyncEngine
    from engine.kv_connector import ConnectorContext
    from engine.llm import LLMEngine

    eng = LLMEngine.from_random(mc, cfg, seed=0)
    name = f"random-{mc.hidden_size}x{mc.num_layers}-seed0"

    def ns(bt: int):  # the engine's namespace (KV dtype, layout) under that name
        return eng.namespace(bt, fingerprint=name)

    if prefix_cache:
        eng.bm.namespace = ns(cfg.page_size)
    conn = None
    if url:
        ctx = ConnectorContext(cfg.page_size, eng.kv, ns, "", cfg.device, eng.transfer)
        conn = StoreConnector(ctx, parse_connector_url(url), backend=backend)
    return AsyncEngine(eng, conn)


async def ttft(aeng, prompt: list[int]) -> tuple[float, int, int]:
    """Seconds to the first token of ``prompt`` (one token generated), cached tokens, the token."""
    from engine.sequence import SamplingParams

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    async for out in aeng.generate(prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)):
        return time.perf_counter() - t0, out.cached_tokens, out.token_id
    raise RuntimeError("no output")


def decode_run(
    eng, mc, batch: int, prompt_len: int, new_tokens: int, g: torch.Generator
) -> tuple[float, int]:
    """Seconds and engine steps of decoding ``new_tokens`` for ``batch`` random prompts of
    ``prompt_len`` tokens at once, their prefills done (and synchronised) before the clock."""
    from engine.sequence import SamplingParams

    prompts = [torch.randint(0, mc.vocab_size, (prompt_len,), generator=g).tolist() for _ in range(batch)]
    sp = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    seqs = [eng.add_request(p, sp) for p in prompts]
    while any(s.num_computed < s.num_prompt for s in seqs):
        eng.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0, steps = time.perf_counter(), eng.steps
    while eng.has_work():
        eng.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0, eng.steps - steps


def prefill_flops(mc, n: int) -> float:
    """Matmul FLOPs of a causal prefill of n tokens (projections, MLP, attention, last-token head)."""
    h, kv = mc.hidden_size, mc.num_kv_heads * mc.head_dim
    per_tok = 2 * (h * h + 2 * h * kv + h * h + 3 * h * mc.intermediate_size)
    attn = 2 * n * n * mc.num_heads * mc.head_dim  # QK^T and PV, causal half, 2 FLOPs per MAC
    return mc.num_layers * (per_tok * n + attn) + 2 * h * mc.vocab_size


def transformers_twin(mc, engine_model, device: str = "cuda", dtype: torch.dtype = torch.bfloat16):
    """transformers' LlamaForCausalLM of the same shape holding the engine's weights (copied),
    or None with the reason when transformers is unavailable or too old."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as exc:
        return None, f"transformers not importable: {exc}"
    rope = {
        "rope_type": "llama3", "rope_theta": mc.rope.theta, "factor": mc.rope.factor,
        "low_freq_factor": mc.rope.low_freq_factor, "high_freq_factor": mc.rope.high_freq_factor,
        "original_max_position_embeddings": mc.rope.original_max_position,
    }  # fmt: skip
    cfg = LlamaConfig(
        vocab_size=mc.vocab_size, hidden_size=mc.hidden_size, intermediate_size=mc.intermediate_size,
        num_hidden_layers=mc.num_layers, num_attention_heads=mc.num_heads, num_key_value_heads=mc.num_kv_heads,
        head_dim=mc.head_dim, rms_norm_eps=mc.rms_norm_eps, max_position_embeddings=mc.max_position,
        rope_theta=mc.rope.theta, rope_scaling=rope, rope_parameters=rope, attn_implementation="sdpa",
    )  # fmt: skip
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            hf = LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(prev)
    missing = hf.load_state_dict(engine_model.state_dict(), strict=False).missing_keys
    if [k for k in missing if "rotary" not in k]:
        return None, f"weights did not map: {missing[:3]}"
    return hf, ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--decode-prompt", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--kv-cache", default="24GiB")
    ap.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu_engine.py needs a CUDA device")

    from engine.config import EngineConfig
    from engine.llm import LLMEngine
    from engine.sequence import SamplingParams
    from kvstore.config import parse_size

    mc = llama31_8b()
    max_len = max(args.prefill) + 16
    cfg = EngineConfig(
        device="cuda", dtype="bfloat16", kv_cache_bytes=parse_size(args.kv_cache, "--kv-cache"), max_num_batched_tokens=max_len,
        max_num_seqs=max(args.batches), max_model_len=max_len + args.decode_tokens, attention_backend=args.backend,
    )  # fmt: skip
    eng = LLMEngine.from_random(mc, cfg)
    peak = matmul_peak_tflops("cuda", torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    rows = []
    one = SamplingParams(max_tokens=1, temperature=0)
    eng.generate([torch.randint(0, mc.vocab_size, (512,), generator=g).tolist()], one)  # warm up
    for n in args.prefill:
        prompt = torch.randint(0, mc.vocab_size, (n,), generator=g).tolist()
        eng.generate([prompt], one)  # warm-up at this shape
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        eng.generate([prompt], one)  # no prefix cache (random engine): cold every time
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        tf = prefill_flops(mc, n) / dt / 1e12
        rows.append(
            {"metric": f"prefill {n}", "tokens_per_s": n / dt, "tflops": tf, "pct_peak": 100 * tf / peak}
        )
    for b in args.batches:
        dt, _ = decode_run(eng, mc, b, args.decode_prompt, args.decode_tokens, g)
        rows.append({"metric": f"decode batch {b}", "tokens_per_s": b * (args.decode_tokens - 1) / dt})
    eng.check_integrity()
    if not args.no_transformers:
        try:
            compare_transformers(args, mc, eng, rows, g)
        except Exception as exc:  # the baseline is optional: report why it is missing
            print(f"transformers comparison failed: {exc!r}")
    print_table(args, eng, peak, rows)


def compare_transformers(args, mc, eng, rows: list[dict], g: torch.Generator) -> None:
    """Add transformers' tokens/s (same shape, same weights) and our ratio to each row."""
    hf, why = transformers_twin(mc, eng.model)
    if hf is None:
        print(f"transformers comparison skipped: {why}")
        return
    for r in rows:
        kind, n = r["metric"].split()[0], int(r["metric"].split()[-1])
        if kind == "prefill":
            ids = torch.randint(0, mc.vocab_size, (1, n), generator=g).cuda()
            with torch.inference_mode():
                hf(ids, logits_to_keep=1)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                hf(ids, logits_to_keep=1)
                torch.cuda.synchronize()
            r["transformers_tokens_per_s"] = n / (time.perf_counter() - t0)
        else:
            ids = torch.randint(0, mc.vocab_size, (n, args.decode_prompt), generator=g).cuda()
            k = args.decode_tokens
            with torch.inference_mode():
                kw = dict(attention_mask=torch.ones_like(ids), do_sample=False)
                hf.generate(ids, max_new_tokens=2, min_new_tokens=2, **kw)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                hf.generate(ids, max_new_tokens=k, min_new_tokens=k, **kw)
                torch.cuda.synchronize()
            # end-to-end generate (prefill included): a conservative baseline
            r["transformers_tokens_per_s"] = n * k / (time.perf_counter() - t0)
        r["ratio"] = r["tokens_per_s"] / r["transformers_tokens_per_s"]
    del hf


def print_table(args, eng, peak: float, rows: list[dict]) -> None:
    print(f"Llama-3.1-8B shape, random bf16, backend {eng.backend.name}, {torch.cuda.get_device_name()}")
    print(f"bf16 matmul peak (8192^3): {peak:.1f} TFLOP/s")
    print(
        f"| {'metric':<18} | {'tokens/s':>10} | {'TFLOP/s':>8} | {'% peak':>7} | {'transformers tok/s':>18} | {'ratio':>6} |"
    )
    print(f"|{'-' * 20}|{'-' * 12}|{'-' * 10}|{'-' * 9}|{'-' * 20}|{'-' * 8}|")
    for r in rows:
        tf = f"{r['tflops']:.1f}" if "tflops" in r else "-"
        pct = f"{r['pct_peak']:.0f}%" if "pct_peak" in r else "-"
        ht = f"{r['transformers_tokens_per_s']:.1f}" if "transformers_tokens_per_s" in r else "-"
        ra = f"{r['ratio']:.2f}x" if "ratio" in r else "-"
        print(f"| {r['metric']:<18} | {r['tokens_per_s']:>10.1f} | {tf:>8} | {pct:>7} | {ht:>18} | {ra:>6} |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "device": torch.cuda.get_device_name(),
                    "backend": eng.backend.name,
                    "peak_tflops": peak,
                    "rows": rows,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
