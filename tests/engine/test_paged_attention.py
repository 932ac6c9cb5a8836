"""The Triton paged-attention kernel against the torch backend (the reference), on CPU under
Triton's interpreter (or on CUDA where there is one): ragged batches mixing decode tokens and
prefill chunks with cached prefixes, several page sizes, GQA ratios and head dims, block
tables with scattered pages, split-K, and per-KV-head scales."""

from __future__ import annotations

import pytest
import torch

from engine.attention_meta import build_metadata
from engine.attention_torch import TorchAttention
from tests.engine.interpret import HAS_CUDA, skip_unless_kernels_run
from tests.engine.pages import scattered_tables

pytestmark = skip_unless_kernels_run()


@pytest.fixture
def device():
    return "cuda" if HAS_CUDA else "cpu"


def make_case(device, dtype, heads, kv_heads, d, ps, batch, seed=0):
    """``batch``: (query_len, context_len) per sequence. Pages are a random permutation of the
    pool, so every sequence's pages are scattered; the pool is filled with random K/V, and the
    new tokens' K/V are what the pool holds at their slots (storing them is then a no-op)."""
    g = torch.Generator().manual_seed(seed)
    tables, num_pages = scattered_tables([c for _, c in batch], ps, 3, g)
    kc = torch.randn(num_pages, ps, kv_heads, d, generator=g).to(device, dtype)
    vc = torch.randn(num_pages, ps, kv_heads, d, generator=g).to(device, dtype)
    meta = build_metadata([q for q, _ in batch], [c for _, c in batch], tables, ps, device)
    t = sum(q for q, _ in batch)
    q = torch.randn(t, heads, d, generator=g).to(device, dtype)
    k_new = kc.view(-1, kv_heads, d)[meta.slot_mapping]
    v_new = vc.view(-1, kv_heads, d)[meta.slot_mapping]
    return q, k_new, v_new, kc, vc, meta, tables


def reference(q, k_new, v_new, kc, vc, meta, tables, heads, kv_heads, d):
    """The torch backend in fp32 on the same values."""
    f = torch.float32
    meta32 = build_metadata(meta.query_lens, meta.context_lens, tables, meta.page_size, "cpu")
    return TorchAttention(heads, kv_heads, d).forward(
        q.cpu().to(f), k_new.cpu().to(f), v_new.cpu().to(f), kc.cpu().to(f), vc.cpu().to(f), meta32
    )


def run_kernel(q, k_new, v_new, kc, vc, meta, heads, kv_heads, d, cfg=None):
    from engine.attention_triton import TritonAttention

    return TritonAttention(heads, kv_heads, d, cfg).forward(q, k_new, v_new, kc, vc, meta)


# Decodes first (the scheduler's order), then prefill chunks: a cached prefix that is not a
# multiple of any page size (37 + 5), a chunk without a prefix, a one-token prefix.
MIXED = [(1, 1), (1, 50), (1, 23), (5, 42), (9, 9), (3, 4)]


@pytest.mark.parametrize(
    "heads,kv_heads,d,ps",
    [(4, 4, 64, 16), (8, 2, 64, 5), (8, 1, 128, 8), (16, 2, 64, 32)],
    ids=["gqa1-d64-p16", "gqa4-d64-p5", "gqa8-d128-p8", "gqa8-d64-p32"],
)
def test_paged_kernel_matches_torch_fp32(device, heads, kv_heads, d, ps):
    from engine.triton_plan import PagedKernelConfig

    case = make_case(device, torch.float32, heads, kv_heads, d, ps, MIXED)
    ref = reference(*case, heads, kv_heads, d)
    # rows=16 keeps several query tiles per prefill chunk; no splits here (large floor).
    cfg = PagedKernelConfig(rows=16, block_n=16, target_programs=1, min_split_keys=16)
    got = run_kernel(*case[:6], heads, kv_heads, d, cfg)
    torch.testing.assert_close(got.cpu(), ref, rtol=1e-5, atol=1e-5)


def test_paged_kernel_split_k_matches_torch(device):
    """Split-K: a decode and a short tail over long contexts, cut into several key ranges
    (some of them past a sequence's end or beyond a row's causal limit)."""
    from engine.triton_plan import PagedKernelConfig, plan_step

    heads, kv_heads, d, ps = 8, 2, 64, 16
    batch = [(1, 200), (1, 7), (4, 150)]
    case = make_case(device, torch.float32, heads, kv_heads, d, ps, batch, seed=1)
    cfg = PagedKernelConfig(rows=16, block_n=16, target_programs=64, min_split_keys=32)
    assert plan_step(case[5], kv_heads, heads // kv_heads, cfg, device).splits > 1
    ref = reference(*case, heads, kv_heads, d)
    got = run_kernel(*case[:6], heads, kv_heads, d, cfg)
    torch.testing.assert_close(got.cpu(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_paged_kernel_half_precision(device, dtype):
    heads, kv_heads, d, ps = 8, 2, 64, 16
    case = make_case(device, dtype, heads, kv_heads, d, ps, MIXED, seed=2)
    ref = reference(*case, heads, kv_heads, d)
    got = run_kernel(*case[:6], heads, kv_heads, d)
    assert got.dtype == dtype
    torch.testing.assert_close(got.cpu().float(), ref, rtol=2e-2, atol=2e-2)


def test_paged_kernel_kv_scales(device):
    """Per-KV-head scales (the hook for quantized pages): pages holding K/s_k and V/s_v with
    scales s_k, s_v give the attention of the unscaled K/V."""
    from engine.triton_paged import PagedAttentionKernel
    from engine.triton_plan import PagedKernelConfig

    heads, kv_heads, d, ps = 8, 2, 64, 8
    q, k_new, v_new, kc, vc, meta, tables = make_case(device, torch.float32, heads, kv_heads, d, ps, MIXED)
    ref = reference(q, k_new, v_new, kc, vc, meta, tables, heads, kv_heads, d)
    ks = torch.tensor([0.5, 3.0], device=device)
    vs = torch.tensor([2.0, 0.25], device=device)
    kern = PagedAttentionKernel(heads, kv_heads, d, PagedKernelConfig())
    got = kern(q, kc / ks[:, None], vc / vs[:, None], meta, torch.empty_like(q), ks, vs)
    torch.testing.assert_close(got.cpu(), ref, rtol=1e-5, atol=1e-5)


def test_triton_backend_needs_cuda_or_interpreter(monkeypatch):
    from engine.attention import make_backend
    from engine.errors import ConfigError

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="TRITON_INTERPRET"):
        make_backend("triton", "cpu", 4, 2, 64, torch.float32)


def test_backend_registry_picks_and_refuses():
    from engine.attention import make_backend
    from engine.errors import ConfigError

    assert make_backend("auto", "cpu", 4, 2, 64, torch.float32).name == "torch"
    with pytest.raises(ConfigError, match="magic"):
        make_backend("magic", "cpu", 4, 2, 64, torch.float32)
    with pytest.raises(ConfigError, match="CUDA"):
        make_backend("flash_attn", "cpu", 4, 2, 64, torch.bfloat16)


def test_attention_imports_run_one_way():
    """The backends and the kernel never import the registry (engine/attention.py): it
    imports them, so there is no circle."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2] / "engine"
    files = sorted(root.glob("attention_*.py")) + [root / "triton_paged.py", root / "triton_plan.py"]
    assert len(files) >= 5
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            assert "engine.attention" not in names, f"{f.name} imports the registry"


def test_paged_kernel_fp8_pages(device):
    """float8_e4m3 pages with per-KV-head scales (issue 15's layout): the kernel equals the
    torch reference over the dequantized pages."""
    from engine.triton_paged import PagedAttentionKernel
    from engine.triton_plan import PagedKernelConfig

    heads, kv_heads, d, ps = 8, 2, 64, 16
    q, _, _, kc, vc, meta, tables = make_case(device, torch.float32, heads, kv_heads, d, ps, MIXED, seed=4)
    ks = kc.abs().amax(dim=(0, 1, 3)) / 448.0  # e4m3's largest normal
    vs = vc.abs().amax(dim=(0, 1, 3)) / 448.0
    k8 = (kc / ks[:, None]).to(torch.float8_e4m3fn)
    v8 = (vc / vs[:, None]).to(torch.float8_e4m3fn)
    kd, vd = k8.float() * ks[:, None], v8.float() * vs[:, None]
    kn = kd.view(-1, kv_heads, d)[meta.slot_mapping]
    vn = vd.view(-1, kv_heads, d)[meta.slot_mapping]
    ref = reference(q, kn, vn, kd, vd, meta, tables, heads, kv_heads, d)
    kern = PagedAttentionKernel(heads, kv_heads, d, PagedKernelConfig())
    got = kern(q, k8, v8, meta, torch.empty_like(q), ks, vs)
    torch.testing.assert_close(got.cpu(), ref, rtol=1e-5, atol=1e-5)
