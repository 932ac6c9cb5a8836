"""CUDA backends. The Triton decode kernel also runs on CPU under Triton's interpreter
(TRITON_INTERPRET=1, when triton is importable); everything else needs a CUDA device and
skips with a reason elsewhere."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from engine.attention import TorchAttention, build_metadata

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def random_decode_case(device: str, dtype: torch.dtype, heads=8, kv_heads=2, d=64, ps=16):
    g = torch.Generator().manual_seed(0)
    ctx = [1, 17, 40, 95]
    pages = list(range(40))
    perm = torch.randperm(40, generator=g).tolist()
    tables, off = [], 0
    for c in ctx:
        n = -(-c // ps)
        tables.append(perm[off : off + n])
        off += n
    k_cache = torch.randn(len(pages), ps, kv_heads, d, generator=g).to(device, dtype)
    v_cache = torch.randn(len(pages), ps, kv_heads, d, generator=g).to(device, dtype)
    q = torch.randn(len(ctx), heads, d, generator=g).to(device, dtype)
    meta = build_metadata([1] * len(ctx), ctx, tables, ps, device)
    return q, k_cache, v_cache, meta, (heads, kv_heads, d)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(
    not (HAS_CUDA or INTERPRET), reason="needs CUDA, or TRITON_INTERPRET=1 to run the kernel on CPU"
)
def test_engine_triton_paged_decode_matches_torch():
    from engine.attention_cuda import TritonAttention

    device = "cuda" if HAS_CUDA and not INTERPRET else "cpu"
    q, kc, vc, meta, shape = random_decode_case(device, torch.float32)
    ref = TorchAttention(*shape)._decode(q, kc.view(-1, *kc.shape[2:]), vc.view(-1, *vc.shape[2:]), meta)
    meta2 = build_metadata(
        meta.query_lens,
        meta.context_lens,
        [list(map(int, r)) for r in meta.block_tables.tolist()],
        16,
        device,
    )
    got = TritonAttention(*shape)._decode(q, kc.view(-1, *kc.shape[2:]), vc.view(-1, *vc.shape[2:]), meta2)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def _engine_tokens(d: str, device: str, dtype: str, backend: str):
    from engine.config import EngineConfig
    from engine.llm import LLMEngine
    from engine.sequence import SamplingParams

    eng = LLMEngine(
        d,
        EngineConfig(
            num_pages=64, device=device, dtype=dtype, attention_backend=backend, max_num_batched_tokens=40
        ),
    )
    eng.record_logits = {}
    g = torch.Generator().manual_seed(3)
    ps = [torch.randint(6, 262, (n,), generator=g).tolist() for n in (5, 37, 90)]
    seqs = eng.generate(ps, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    eng.check_integrity()
    return [s.output_tokens for s in seqs], [torch.stack(eng.record_logits[s.request_id]).cpu() for s in seqs]


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["torch", "triton", "flash_attn"])
def test_engine_cuda_backends_match_cpu(tiny_model_dir, backend):
    if backend == "triton" and not HAS_TRITON:
        pytest.skip("triton is not installed")
    if backend == "flash_attn" and importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash-attn is not installed (it builds only from source with nvcc)")
    d = tiny_model_dir("llama-gqa4")
    ref_tokens, ref_logits = _engine_tokens(d, "cpu", "float32", "torch")
    if backend != "flash_attn":  # flash-attn computes in half precision only
        tokens, logits = _engine_tokens(d, "cuda", "float32", backend)
        assert tokens == ref_tokens
        for a, b in zip(logits, ref_logits):
            assert float((a - b).norm() / b.norm()) < 1e-3
    tokens, logits = _engine_tokens(d, "cuda", "bfloat16", backend)
    for a, b in zip(logits, ref_logits):
        assert float((a - b).norm() / b.norm()) < 5e-2  # bf16 tolerance
