"""Logits parity with transformers (fp32, CPU) on random tiny models of several shapes."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.llm import LLMEngine
from engine.sequence import SamplingParams

PRESETS = [
    "llama-tiny",
    "llama-mha",
    "llama-gqa4",
    "llama-mqa",
    "llama3-rope",
    "llama-linear-rope",
    "qwen2-tiny",
]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def hf_logits(model_dir: str, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def check_parity(
    engine: LLMEngine, model_dir: str, prompt: list[int], n_new: int, tol: float = 1e-4
) -> list[int]:
    """Generate greedily, then compare the logits of the prefill and of every decode step with
    one transformers forward over prompt + generated tokens."""
    engine.record_logits = {}
    [seq] = engine.generate([prompt], SamplingParams(max_tokens=n_new, temperature=0, ignore_eos=True))
    got = engine.record_logits.pop(seq.request_id)
    assert len(got) == n_new
    ref = hf_logits(model_dir, seq.tokens)
    for i, lg in enumerate(got):
        r = ref[len(prompt) - 1 + i]
        assert rel_err(lg, r) < tol, f"step {i}: rel err {rel_err(lg, r):.2e}"
        assert int(lg.argmax()) == seq.output_tokens[i]
    return seq.output_tokens


@pytest.mark.parametrize("preset", PRESETS)
def test_engine_logits_match_transformers(preset, tiny_model_dir, engines):
    d = tiny_model_dir(preset)
    eng = LLMEngine(d, EngineConfig(page_size=16, num_pages=64))
    engines.append(eng)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(6, eng.model_config.vocab_size, (83,), generator=g).tolist()
    check_parity(eng, d, prompt, n_new=6)


def test_engine_config_shapes(tiny_model_dir):
    from engine.config import ModelConfig

    q = ModelConfig.from_dir(tiny_model_dir("qwen2-tiny"))
    assert q.qkv_bias and not q.o_bias and q.num_kv_heads == 2
    r = ModelConfig.from_dir(tiny_model_dir("llama3-rope"))
    assert r.rope.rope_type == "llama3" and r.rope.factor == 8.0
