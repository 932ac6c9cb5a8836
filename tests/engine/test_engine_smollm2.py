"""Real weights: SmolLM2-135M-Instruct (from its GGUF, converted once per session) against
transformers on the same folder: logits, greedy text, chat template."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.llm import LLMEngine
from engine.sequence import SamplingParams

pytestmark = pytest.mark.heavy

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
]


@pytest.fixture(scope="module")
def smol(smol_dir):
    from transformers import AutoModelForCausalLM

    eng = LLMEngine(smol_dir, EngineConfig(num_pages=128, max_num_batched_tokens=512))
    hf = AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32).eval()
    yield eng, hf
    eng.check_integrity()


def test_engine_smollm2_paris(smol):
    eng, _ = smol
    [s] = eng.generate([eng.tokenizer.encode(PROMPTS[0])], SamplingParams(max_tokens=4, temperature=0))
    assert "Paris" in eng.text_of(s.request_id)


def test_engine_smollm2_greedy_and_logits_match_transformers(smol):
    eng, hf = smol
    ids = [eng.tokenizer.encode(p) for p in PROMPTS]
    eng.record_logits = {}
    seqs = eng.generate(ids, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))  # batched
    for p, s in zip(ids, seqs):
        with torch.no_grad():
            ref_ids = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
        assert s.output_tokens == ref_ids[0, len(p) :].tolist()
        with torch.no_grad():
            ref = hf(torch.tensor([s.tokens])).logits[0]
        for i, lg in enumerate(eng.record_logits[s.request_id]):
            r = ref[len(p) - 1 + i]
            assert float((lg - r).norm() / r.norm()) < 1e-4
    eng.record_logits = None


def test_engine_smollm2_chat_template_matches_transformers(smol, smol_dir):
    from transformers import AutoTokenizer

    eng, _ = smol
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    ref = AutoTokenizer.from_pretrained(smol_dir).apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=True
    )
    if isinstance(ref, dict) or hasattr(ref, "input_ids"):
        ref = ref["input_ids"]
    assert eng.tokenizer.apply_chat_template(msgs) == list(ref)


def test_engine_smollm2_prefix_hit_and_chunking_keep_greedy_text(smol):
    eng, _ = smol
    base = eng.tokenizer.encode("Here is a short story about a lighthouse keeper who finds a bottle. " * 3)
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    [cold] = eng.generate([base], sp)
    [warm] = eng.generate([base], sp)
    assert warm.num_cached_tokens > 0 and warm.output_tokens == cold.output_tokens
    chunked = LLMEngine(
        eng.model_dir, EngineConfig(num_pages=64, max_num_batched_tokens=13, enable_prefix_cache=False)
    )
    [c] = chunked.generate([base], sp)
    assert c.output_tokens == cold.output_tokens
    chunked.check_integrity()
