"""fp8 KV accuracy, measured: SmolLM2-135M-Instruct with its KV cache in the model's own dtype
(``auto``) against other KV dtypes (``bf16``, ``fp8_e4m3``), in one run, on the CPU.

- Greedy agreement: >= 50 chat prompts (written here), 64 new tokens each (``ignore_eos``),
  batched; per KV dtype the share of prompts whose 64 tokens equal ``auto``'s, the mean length
  of the common prefix and the share of equal tokens position by position.
- Perplexity of a fixed text shipped in the repo (``bench/data/fp8_text.txt``, written for
  the project, ~3,000 tokens), evaluated through the engine's own paged path in chunks (each
  chunk attends over the earlier chunks' pages, as a chunked prefill does), and the share of
  positions whose top-1 prediction equals ``auto``'s.

Prints a table and writes JSON (``--json``). A benchmark, not a test: nothing here asserts.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time

import torch

from connector.demo import DEFAULT_MODEL_DIR, ensure_model
from engine.attention_meta import build_metadata
from engine.config import EngineConfig
from engine.llm import LLMEngine
from engine.sequence import SamplingParams

TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "fp8_text.txt")

PROMPTS = [
    "What is the capital of France?",
    "Explain photosynthesis in two sentences.",
    "Write a haiku about autumn leaves.",
    "List three uses of a paperclip.",
    "What is 17 times 23?",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue?",
    "Give me a short recipe for pancakes.",
    "What does a compiler do?",
    "Name the planets of the solar system in order.",
    "Write a Python function that reverses a string.",
    "What is the difference between weather and climate?",
    "Summarise the plot of a detective story in three sentences.",
    "How do vaccines work?",
    "Suggest a name for a small bakery by the sea.",
    "What are prime numbers? Give five examples.",
    "Describe a cat to someone who has never seen one.",
    "What is the boiling point of water at sea level?",
    "Write a polite email declining a meeting invitation.",
    "Explain what a hash table is.",
    "What causes the seasons on Earth?",
    "Give three tips for learning a new language.",
    "Who wrote Romeo and Juliet?",
    "What is the Pythagorean theorem?",
    "Write a limerick about a forgetful robot.",
    "How does a bicycle stay upright?",
    "What is the largest ocean on Earth?",
    "Explain recursion to a ten-year-old.",
    "What should I pack for a weekend camping trip?",
    "Convert 100 degrees Fahrenheit to Celsius.",
    "What is the function of the heart?",
    "Write a SQL query that counts rows in a table named users.",
    "Why do leaves change colour in autumn?",
    "Describe the water cycle.",
    "What is a black hole?",
    "Give me a motivational quote and explain it.",
    "How many minutes are there in a week?",
    "What is the difference between a virus and a bacterium?",
    "Write the opening line of a fantasy novel.",
    "Explain how a lighthouse helps ships.",
    "What are the three states of matter?",
    "How do I make a cup of tea?",
    "What is machine learning?",
    "Name five fruits that are red.",
    "Why is exercise good for health?",
    "What is the speed of light?",
    "Write a short poem about the moon.",
    "What does DNA stand for?",
    "Give an example of a metaphor.",
    "How does a refrigerator keep food cold?",
    "What is an API?",
    "Plan a one-day trip to a museum.",
    "What is the square root of 144?",
    "Explain supply and demand briefly.",
    "Why do we have time zones?",
    "What is the tallest mountain in the world?",
]


def engine(model_dir: str, kv_dtype: str) -> LLMEngine:
    cfg = EngineConfig(kv_cache_dtype=kv_dtype, kv_cache_bytes=512 << 20, max_num_seqs=64, warm_up=False)
    return LLMEngine(model_dir, cfg)


@torch.inference_mode()
def text_logprobs(eng: LLMEngine, ids: list[int], chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position ``i`` (predicting ``ids[i + 1]``): its log-probability and the model's
    top-1 token. Runs on a fresh engine's pages 0.. (nothing else uses them yet)."""
    ps, dev = eng.config.page_size, eng.config.device
    pages = list(range(-(-len(ids) // ps)))
    if len(pages) > eng.kv.num_pages:
        raise SystemExit(f"the text needs {len(pages)} pages, the pool has {eng.kv.num_pages}")
    lps, tops = [], []
    for s in range(0, len(ids) - 1, chunk):
        e = min(s + chunk, len(ids) - 1)
        meta = build_metadata([e - s], [e], [pages[: -(-e // ps)]], ps, dev)
        logits = eng.model(
            torch.tensor(ids[s:e], device=dev),
            torch.arange(s, e, device=dev),
            eng.kv.layers(),
            meta,
            eng.backend,
            torch.arange(e - s, device=dev),
        ).float()
        lp = torch.log_softmax(logits, dim=-1)
        tgt = torch.tensor(ids[s + 1 : e + 1], device=dev)
        lps.append(lp.gather(1, tgt[:, None])[:, 0].cpu())
        tops.append(logits.argmax(-1).cpu())
    return torch.cat(lps), torch.cat(tops)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL_DIR)
    ap.add_argument("--kv-dtypes", default="auto,bf16,fp8_e4m3", help="the first is the reference")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=512, help="perplexity: tokens per chunk")
    ap.add_argument("--json", default="", help="write the results here")
    a = ap.parse_args()
    from rich.console import Console

    console = Console()
    model_dir = ensure_model(a.model, console)
    torch.manual_seed(0)
    with open(TEXT, encoding="utf-8") as f:
        text = f.read()
    dtypes = a.kv_dtypes.split(",")
    params = SamplingParams(max_tokens=a.tokens, temperature=0, ignore_eos=True)
    runs: dict[str, dict] = {}
    for d in dtypes:
        t0 = time.perf_counter()
        eng = engine(model_dir, d)
        tok = eng.tokenizer
        ids = tok.encode(text)
        lp, top = text_logprobs(eng, ids, a.chunk)
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS[: a.prompts]]
        seqs = eng.generate(prompts, params)
        eng.check_integrity()
        runs[d] = {
            "kv_dtype": str(eng.kv.dtype).removeprefix("torch."),
            "page_bytes": eng.kv.page_bytes,
            "lp": lp,
            "top": top,
            "outs": [list(s.output_tokens) for s in seqs],
            "seconds": time.perf_counter() - t0,
        }
        console.print(f"{d}: {runs[d]['seconds']:.1f} s")
    ref = runs[dtypes[0]]
    rows = []
    for d in dtypes:
        r = runs[d]
        ppl = math.exp(-float(r["lp"].mean()))
        pre = [common_prefix(x, y) for x, y in zip(r["outs"], ref["outs"])]
        pos = sum(sum(int(u == v) for u, v in zip(x, y)) for x, y in zip(r["outs"], ref["outs"]))
        total = sum(len(x) for x in ref["outs"])
        rows.append(
            {
                "kv_cache_dtype": d,
                "stored_dtype": r["kv_dtype"],
                "page_bytes": r["page_bytes"],
                "perplexity": ppl,
                "perplexity_delta_pct": 100 * (ppl / math.exp(-float(ref["lp"].mean())) - 1),
                "text_top1_agreement": float((r["top"] == ref["top"]).float().mean()),
                "prompts_identical": sum(int(p == a.tokens) for p in pre) / len(pre),
                "mean_common_prefix_tokens": sum(pre) / len(pre),
                "token_agreement": pos / total,
                "seconds": r["seconds"],
            }
        )
    hdr = f"{'kv dtype':<10} {'stored':<14} {'page B':>8} {'ppl':>8} {'Δppl %':>8} {'top1 =':>7} {'64/64 =':>8} {'prefix':>7} {'tok =':>7}"
    console.print(
        f"SmolLM2-135M-Instruct, text {len(ids)} tokens, {len(prompts)} prompts x {a.tokens} tokens, "
        f"reference {dtypes[0]}"
    )
    console.print(hdr, markup=False)
    for r in rows:
        console.print(
            f"{r['kv_cache_dtype']:<10} {r['stored_dtype']:<14} {r['page_bytes']:>8} {r['perplexity']:>8.3f} "
            f"{r['perplexity_delta_pct']:>+8.3f} {r['text_top1_agreement']:>7.1%} {r['prompts_identical']:>8.1%} "
            f"{r['mean_common_prefix_tokens']:>7.1f} {r['token_agreement']:>7.1%}",
            markup=False,
        )
    doc = {
        "model": "SmolLM2-135M-Instruct",
        "device": "cpu",
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "text_tokens": len(ids),
        "prompts": len(prompts),
        "new_tokens": a.tokens,
        "reference": dtypes[0],
        "rows": rows,
    }
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=2)


if __name__ == "__main__":
    main()
