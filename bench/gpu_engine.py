"""The engine alone on a lent GPU (not run in CI): a Llama-3.1-8B-shaped model with random
bf16 weights created on the GPU. Cold prefill at 2K / 8K / 32K tokens with achieved TFLOP/s
beside a measured bf16 matmul peak (its floor: the FLOPs at that peak), decode tokens/s at
batch 1 and 32 beside one read of the weights per step at the measured device copy bandwidth
(``x_floor``: a step's time over that), and transformers on the same weights. Prints a table;
``--json PATH`` writes the numbers. ``--tiny``: the same on CPU with a tiny model and short
prompts, without transformers (a smoke check; its numbers mean nothing). Also the model shapes
bench/ttft.py builds random engines of (``llama31_8b``, ``tiny_config``).

    python bench/gpu_engine.py --json gpu.json [--backend auto|torch|triton|flash_attn]
    python bench/gpu_engine.py --tiny --json /tmp/x.json
"""

from __future__ import annotations

import argparse
import time

import common
import torch
from serving_floors import device_copy_bytes_per_s, matmul_peak_tflops


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
    _sync()
    t0, steps = time.perf_counter(), eng.steps
    while eng.has_work():
        eng.step()
    _sync()
    return time.perf_counter() - t0, eng.steps - steps


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def weight_bytes(mc, elem: int) -> int:
    """Bytes of the model's weights at ``elem`` bytes a parameter (one decode step reads them once)."""
    h, kv, i = mc.hidden_size, mc.num_kv_heads * mc.head_dim, mc.intermediate_size
    return (mc.num_layers * (h * h * 2 + 2 * h * kv + 3 * h * i) + mc.vocab_size * h) * elem


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
    ap.add_argument("--tiny", action="store_true", help="a tiny model on CPU: check the script runs")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.tiny:
        args.prefill, args.batches, args.decode_prompt, args.decode_tokens = [256], [1, 4], 16, 8
        args.kv_cache, args.no_transformers = "256MiB", True
    elif not torch.cuda.is_available():
        raise SystemExit("bench/gpu_engine.py needs a CUDA device (--tiny: a smoke run on CPU)")

    from engine.config import EngineConfig
    from engine.llm import LLMEngine
    from engine.sequence import SamplingParams
    from kvstore.config import parse_size

    device, mc = ("cpu", tiny_config()) if args.tiny else ("cuda", llama31_8b())
    max_len = max(args.prefill) + 16
    cfg = EngineConfig(
        device=device, dtype="bfloat16", kv_cache_bytes=parse_size(args.kv_cache, "--kv-cache"), max_num_batched_tokens=max_len,
        max_num_seqs=max(args.batches), max_model_len=max_len + args.decode_tokens, attention_backend=args.backend,
    )  # fmt: skip
    eng = LLMEngine.from_random(mc, cfg)
    peak = matmul_peak_tflops(device, torch.bfloat16)
    step_floor = weight_bytes(mc, 2) / device_copy_bytes_per_s(device)  # one weight read
    g = torch.Generator().manual_seed(0)
    rows = []
    one = SamplingParams(max_tokens=1, temperature=0)
    eng.generate(
        [torch.randint(0, mc.vocab_size, (min(512, max_len),), generator=g).tolist()], one
    )  # warm up
    for n in args.prefill:
        prompt = torch.randint(0, mc.vocab_size, (n,), generator=g).tolist()
        eng.generate([prompt], one)  # warm-up at this shape
        _sync()
        t0 = time.perf_counter()
        eng.generate([prompt], one)  # no prefix cache (random engine): cold every time
        _sync()
        dt = time.perf_counter() - t0
        tf = prefill_flops(mc, n) / dt / 1e12
        rows.append(dict(metric=f"prefill {n}", tokens_per_s=n / dt, tflops=tf, x_floor=peak / tf))
    for b in args.batches:
        dt, steps = decode_run(eng, mc, b, args.decode_prompt, args.decode_tokens, g)
        x = dt / max(1, steps) / step_floor
        rows.append(
            dict(metric=f"decode batch {b}", tokens_per_s=b * (args.decode_tokens - 1) / dt, x_floor=x)
        )
    eng.check_integrity()
    if not args.no_transformers:
        try:
            compare_transformers(args, mc, eng, rows, g)
        except Exception as exc:  # the baseline is optional: report why it is missing
            print(f"transformers comparison failed: {exc!r}")
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"{'tiny' if args.tiny else 'Llama-3.1-8B'} shape, random bf16, backend {eng.backend.name}, {name}")
    print(
        f"bf16 matmul peak: {peak:.1f} TFLOP/s; decode step floor {step_floor * 1000:.2f} ms; load {common.loadavg()}"
    )
    head = ["metric", "tokens/s", "TFLOP/s", "x floor", "transformers tok/s", "ratio"]
    keys = ["metric", "tokens_per_s", "tflops", "x_floor", "transformers_tokens_per_s", "ratio"]
    print(common.md_table(head, [[r.get(k) for k in keys] for r in rows]))
    doc = dict(device=name, backend=eng.backend.name, peak_tflops=peak, step_floor_s=step_floor, rows=rows)
    common.write_json(args.json, doc)


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


if __name__ == "__main__":
    main()
