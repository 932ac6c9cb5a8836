"""Decode steps on the static buffers of engine/decode_graphs.py: the same tokens and logits as
the ordinary path, padded buckets included. On CPU the buffers run eagerly under Triton's
interpreter (the path CUDA captures); on CUDA the graphs are captured and replayed."""

from __future__ import annotations

import pytest
import torch

from tests.engine.interpret import HAS_CUDA, skip_unless_kernels_run

pytestmark = skip_unless_kernels_run()


def _generate(d: str, device: str, backend: str, engines: list, graphs):
    """Five greedy prompts: decode steps of 5, 4, ... sequences as they finish at different
    lengths. ``graphs``: None (the runner's default), False (off) or a DecodeGraphConfig."""
    from engine.config import EngineConfig
    from engine.llm import LLMEngine
    from engine.runner import ModelRunner
    from engine.sequence import SamplingParams

    eng = LLMEngine(d, EngineConfig(num_pages=64, device=device, dtype="float32", attention_backend=backend))
    engines.append(eng)
    if graphs is not None:
        cfg = graphs or None
        eng.runner = ModelRunner(
            eng.model, eng.kv, eng.backend, device, eng.transfer, cfg, cuda_graphs=bool(graphs)
        )
    eng.record_logits = {}
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(6, 262, (n,), generator=g).tolist() for n in (3, 20, 7, 33, 12)]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (2, 9, 5, 7, 3)]
    seqs = eng.generate(prompts, params)
    logits = [torch.stack(eng.record_logits[s.request_id]).cpu() for s in seqs]
    return eng, [s.output_tokens for s in seqs], logits


@pytest.mark.skipif(HAS_CUDA, reason="the CUDA variant is test_decode_graphs_capture_on_cuda")
def test_decode_static_buffers_match_ordinary_path(tiny_model_dir, engines):
    from engine.decode_graphs import DecodeGraphConfig

    d = tiny_model_dir("llama-gqa4")
    _, ref_tokens, ref_logits = _generate(d, "cpu", "torch", engines, None)
    # max_batch 4: the first decode steps (5 sequences) take the ordinary path, later ones
    # the buckets 4, 2 and 1 (3 sequences pad to 4).
    cfg = DecodeGraphConfig(max_batch=4, max_context=128, capture=False)
    eng, tokens, logits = _generate(d, "cpu", "triton", engines, cfg)
    assert eng.runner.graphs.steps > 0
    assert eng.kv.data[:, :, eng.kv.scratch_page].abs().sum() > 0, "padding rows wrote elsewhere"
    assert tokens == ref_tokens
    for a, b in zip(logits, ref_logits):
        assert float((a - b).norm() / b.norm()) < 1e-5


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_decode_graphs_capture_on_cuda(tiny_model_dir, engines):
    d = tiny_model_dir("llama-gqa4")
    _, ref_tokens, ref_logits = _generate(d, "cuda", "triton", engines, False)
    eng, tokens, logits = _generate(d, "cuda", "triton", engines, None)
    assert eng.runner.graphs is not None and eng.runner.graphs.steps > 0
    assert eng.runner.graphs.capture_failures == 0
    assert tokens == ref_tokens
    for a, b in zip(logits, ref_logits):
        assert float((a - b).norm() / b.norm()) < 1e-4
