"""The engine end to end on each attention backend against the CPU torch backend: greedy
tokens equal and logits close. The Triton backend also runs here on CPU under Triton's
interpreter; CUDA and flash-attn cases skip with a reason where they cannot run."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.engine.interpret import HAS_CUDA, HAS_TRITON, kernels_run


def _engine_tokens(d: str, device: str, dtype: str, backend: str, engines: list, page_size: int = 16):
    """Greedy generation of three ragged prompts (chunked prefill mixes with decodes), then a
    prompt that shares 70 tokens with the third one: its prefill reads a cached prefix of 64
    tokens (4 pages) from the prefix cache."""
    from engine.config import EngineConfig
    from engine.llm import LLMEngine
    from engine.sequence import SamplingParams

    eng = LLMEngine(
        d,
        EngineConfig(
            num_pages=64 * 16 // page_size + 2,
            page_size=page_size,
            device=device,
            dtype=dtype,
            attention_backend=backend,
            max_num_batched_tokens=40,
        ),
    )
    engines.append(eng)
    assert eng.backend.name == backend
    eng.record_logits = {}
    g = torch.Generator().manual_seed(3)
    ps = [torch.randint(6, 262, (n,), generator=g).tolist() for n in (5, 37, 90)]
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    seqs = eng.generate(ps, sp)
    seqs += eng.generate([ps[2][:70] + torch.randint(6, 262, (20,), generator=g).tolist()], sp)
    assert seqs[-1].num_cached_tokens > 0, "the last prompt did not hit the prefix cache"
    return [s.output_tokens for s in seqs], [torch.stack(eng.record_logits[s.request_id]).cpu() for s in seqs]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.skipif(HAS_CUDA, reason="the CUDA variant is test_engine_cuda_backends_match_cpu")
@pytest.mark.skipif(kernels_run() is not None, reason=kernels_run() or "")
def test_engine_triton_interpreted_matches_torch(tiny_model_dir, engines):
    d = tiny_model_dir("llama-gqa4")
    ref_tokens, ref_logits = _engine_tokens(d, "cpu", "float32", "torch", engines)
    tokens, logits = _engine_tokens(d, "cpu", "float32", "triton", engines)
    assert tokens == ref_tokens
    for a, b in zip(logits, ref_logits):
        assert _rel(a, b) < 1e-5


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["torch", "triton", "flash_attn"])
def test_engine_cuda_backends_match_cpu(tiny_model_dir, engines, backend):
    if backend == "triton" and not HAS_TRITON:
        pytest.skip("triton is not installed")
    if backend == "flash_attn" and importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash-attn is not installed (it builds only from source with nvcc)")
    d = tiny_model_dir("llama-gqa4")
    ref_tokens, ref_logits = _engine_tokens(d, "cpu", "float32", "torch", engines)
    if backend != "flash_attn":  # flash-attn computes in half precision only
        tokens, logits = _engine_tokens(d, "cuda", "float32", backend, engines)
        assert tokens == ref_tokens
        for a, b in zip(logits, ref_logits):
            assert _rel(a, b) < 1e-3
    # flash-attn reads pages in place only when they hold a multiple of 256 tokens (else it
    # runs the Triton kernel): both page sizes for it.
    for ps in (16, 256) if backend == "flash_attn" else (16,):
        tokens, logits = _engine_tokens(d, "cuda", "bfloat16", backend, engines, ps)
        for a, b in zip(logits, ref_logits):
            assert _rel(a, b) < 5e-2  # bf16 tolerance
