"""fp8 (and other non-model-dtype) KV pages below the engine: the block payload carrying its
scales, quantised stores, every backend reading the pages as stored, and the calibration."""

from __future__ import annotations

import pytest
import torch

from engine.attention_meta import build_metadata, store_kv
from engine.attention_torch import TorchAttention
from engine.errors import ConfigError
from engine.kv_cache import KVCache
from engine.kv_dtype import FP8_MAX, FP8_TARGET, layout_name, pow2_scales, storage_dtype
from tests.engine.interpret import HAS_CUDA, skip_unless_kernels_run
from tests.engine.pages import scattered_tables

F8 = torch.float8_e4m3fn
L, PAGES, PS, H, D = 3, 10, 4, 2, 8


def scales(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return 2.0 ** torch.randint(-6, 2, (L, 2, H), generator=g).float()


def filled(dtype=F8, sc=None, seed=0) -> KVCache:
    kv = KVCache(
        L, PAGES, PS, H, D, dtype, "cpu", sc if sc is not None else (scales() if dtype == F8 else None)
    )
    g = torch.Generator().manual_seed(seed)
    kv.data.copy_((torch.randn(kv.data.shape, generator=g) * 50).to(dtype))
    return kv


def test_fp8_block_carries_its_scales_and_half_the_bytes():
    kv = filled()
    pages = [7, 2, 5]
    buf = kv.gather_block(pages)
    t = len(pages) * PS
    assert buf.dtype == F8 and tuple(buf.shape) == (L, 2, H, t * D + 4) == kv.block_shape(3)
    bf16 = KVCache(L, PAGES, PS, H, D, torch.bfloat16, "cpu")
    # exactly half of the bf16 block's bytes, plus one fp32 scale per (layer, k/v, head)
    assert kv.block_bytes(3) == bf16.block_bytes(3) // 2 + 4 * L * 2 * H == buf.numel()
    # each (layer, k/v, head) row ends in that head's fp32 scale
    assert torch.equal(
        buf.view(torch.uint8)[..., -4:].contiguous().view(torch.float32).reshape(L, 2, H), kv.scales
    )
    # head h of (layer, k/v) holds that head's [tokens, D] bytes
    u = buf.view(torch.uint8)
    want = kv.data.view(torch.uint8)[1, 0, pages][:, :, 1].reshape(-1)  # layer 1, K, head 1
    assert torch.equal(u[1, 0, 1, : t * D], want)
    # into another cache with the same scales: the pages come back bit for bit
    other = KVCache(L, PAGES, PS, H, D, F8, "cpu", kv.scales)
    other.scatter_block([1, 3, 4], buf)
    assert torch.equal(other.data.view(torch.uint8)[:, :, [1, 3, 4]], kv.data.view(torch.uint8)[:, :, pages])
    # staged scatter of several blocks (the CUDA transfer path, here on the CPU)
    staged = KVCache(L, PAGES, PS, H, D, F8, "cpu", kv.scales)
    staged.scatter_staged(range(1, 3), torch.tensor([[1, 3, 4], [6, 8, 9]]), torch.stack([buf, buf])[:, 1:3])
    assert torch.equal(
        staged.data.view(torch.uint8)[1:3][:, :, [6, 8, 9]], kv.data.view(torch.uint8)[1:3][:, :, pages]
    )
    assert not staged.data.view(torch.uint8)[0].any()


def test_fp8_block_with_other_scales_is_refused_before_any_copy():
    kv = filled()
    buf = kv.gather_block([0, 1])
    other = KVCache(L, PAGES, PS, H, D, F8, "cpu", kv.scales * 2)
    with pytest.raises(ValueError, match="scales differ"):
        other.check_block([2, 3], buf)
    with pytest.raises(ValueError, match="scales differ"):
        other.scatter_block([2, 3], buf)
    assert not other.data.view(torch.uint8).any()


def test_scales_required_exactly_for_fp8():
    with pytest.raises(ConfigError):
        KVCache(L, PAGES, PS, H, D, F8, "cpu")
    with pytest.raises(ConfigError):
        KVCache(L, PAGES, PS, H, D, torch.bfloat16, "cpu", scales())
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        storage_dtype("fp8", torch.float32)
    assert storage_dtype("auto", torch.float16) == torch.float16
    assert storage_dtype("fp8_e4m3", torch.bfloat16) == F8


def test_store_kv_quantises_with_per_head_scales_and_saturates():
    kv = KVCache(1, 4, PS, H, D, F8, "cpu", torch.tensor([[[0.5, 4.0], [1.0, 0.25]]]))
    k = torch.randn(5, H, D) * 20
    k[0, 0, 0] = 1e4  # beyond 448 * 0.5: saturates to the largest finite value
    v = torch.randn(5, H, D)
    kc, vc, ks, vs = kv.layers()[0]
    slots = torch.tensor([0, 1, 2, 9, 10])
    store_kv(k, v, kc, vc, slots, ks, vs)
    got = kc.reshape(-1, H, D)[slots].float()
    assert got[0, 0, 0] == FP8_MAX
    want = (k / ks[:, None]).clamp(-FP8_MAX, FP8_MAX).to(F8).float()
    assert torch.equal(got, want)
    assert torch.equal(vc.reshape(-1, H, D)[slots].float(), (v / vs[:, None]).to(F8).float())


def _case(dtype_store, sc, heads=8, kv_heads=2, d=64, ps=16, seed=3):
    """A mixed batch over a pool already holding (quantised) K/V, fresh K/V for the step's
    tokens, and the fp32 pages as the reader must see them."""
    batch = [(1, 1), (1, 50), (1, 23), (5, 42), (9, 9), (3, 4)]  # decodes, prefix, no prefix
    g = torch.Generator().manual_seed(seed)
    tables, n_pages = scattered_tables([c for _, c in batch], ps, 2, g)
    meta = build_metadata([q for q, _ in batch], [c for _, c in batch], tables, ps, "cpu")
    kv = KVCache(1, n_pages, ps, kv_heads, d, dtype_store, "cpu", sc)
    kc, vc, ks, vs = kv.layers()[0]
    all_slots = torch.arange(n_pages * ps)
    store_kv(
        torch.randn(n_pages * ps, kv_heads, d, generator=g) * 3,
        torch.randn(n_pages * ps, kv_heads, d, generator=g),
        kc, vc, all_slots, ks, vs,
    )  # fmt: skip
    t = sum(q for q, _ in batch)
    q = torch.randn(t, heads, d, generator=g)
    k_new = torch.randn(t, kv_heads, d, generator=g) * 3
    v_new = torch.randn(t, kv_heads, d, generator=g)
    return q, k_new, v_new, kv, meta, tables


def _reference(q, k_new, v_new, kv, meta, tables, heads):
    """fp32 attention over what the pages hold after storing the step's K/V, dequantised."""
    kc, vc, ks, vs = kv.layers()[0]
    k2, v2 = kc.clone(), vc.clone()
    store_kv(k_new, v_new, k2, v2, meta.slot_mapping, ks, vs)
    kd = k2.float() * (ks[:, None] if ks is not None else 1)
    vd = v2.float() * (vs[:, None] if vs is not None else 1)
    kn = kd.view(-1, *kd.shape[2:])[meta.slot_mapping]
    vn = vd.view(-1, *vd.shape[2:])[meta.slot_mapping]
    meta32 = build_metadata(meta.query_lens, meta.context_lens, tables, meta.page_size, "cpu")
    return TorchAttention(heads, kv.num_kv_heads, kv.head_dim).forward(q, kn, vn, kd, vd, meta32)


@pytest.mark.parametrize("store", ["fp8", "bf16"])
def test_torch_backend_reads_pages_as_stored(store):
    """Decodes, a prefill over a cached prefix and prefills without one all attend over the
    stored (fp8: dequantised) values, never the fresh fp32 K/V: what a later hit reads."""
    sc = torch.tensor([[[0.25, 0.5], [0.125, 0.5]]]) if store == "fp8" else None
    dt = F8 if store == "fp8" else torch.bfloat16
    q, k_new, v_new, kv, meta, tables = _case(dt, sc)
    ref = _reference(q, k_new, v_new, kv, meta, tables, 8)
    kc, vc, ks, vs = kv.layers()[0]
    got = TorchAttention(8, 2, 64).forward(q, k_new, v_new, kc, vc, meta, ks, vs)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # and it is not the attention over the fresh values (the test can tell the difference)
    fresh = KVCache(1, kv.num_pages, kv.page_size, 2, 64, torch.float32, "cpu")
    fk, fv, _, _ = fresh.layers()[0]
    fk.copy_(kc.float() * (ks[:, None] if ks is not None else 1))
    fv.copy_(vc.float() * (vs[:, None] if vs is not None else 1))
    plain = TorchAttention(8, 2, 64).forward(q, k_new, v_new, fk, fv, meta)
    assert not torch.allclose(plain, ref, rtol=1e-3, atol=1e-3)


@skip_unless_kernels_run()
@pytest.mark.parametrize("store", ["fp8", "bf16"])
def test_triton_backend_equals_torch_on_converted_pages(store):
    from engine.attention_flash import FlashAttention
    from engine.attention_triton import TritonAttention
    from engine.triton_plan import PagedKernelConfig

    dev = "cuda" if HAS_CUDA else "cpu"
    sc = torch.tensor([[[0.25, 0.5], [0.125, 0.5]]]) if store == "fp8" else None
    dt = F8 if store == "fp8" else torch.bfloat16
    q, k_new, v_new, kv, meta, tables = _case(dt, sc)
    ref = _reference(q, k_new, v_new, kv, meta, tables, 8)
    kc, vc, ks, vs = (x.to(dev) if x is not None else None for x in kv.layers()[0])
    meta_d = build_metadata(meta.query_lens, meta.context_lens, tables, meta.page_size, dev)
    tri = TritonAttention(
        8, 2, 64, PagedKernelConfig(rows=16, block_n=16, target_programs=64, min_split_keys=16)
    )
    got = tri.forward(q.to(dev), k_new.to(dev), v_new.to(dev), kc, vc, meta_d, ks, vs)
    torch.testing.assert_close(got.cpu(), ref, rtol=1e-4, atol=1e-4)
    # flash-attn's backend hands converted pages to the same kernel (no flash-attn call)
    fl = FlashAttention(None, tri)
    kc2, vc2 = kc.clone(), vc.clone()
    got2 = fl.forward(q.to(dev), k_new.to(dev), v_new.to(dev), kc2, vc2, meta_d, ks, vs)
    torch.testing.assert_close(got2.cpu(), ref, rtol=1e-4, atol=1e-4)


def test_pow2_scales_and_layout_names():
    amax = torch.tensor([0.0, 1.0, 224.0, 225.0, 3000.0, float("inf")])
    s = pow2_scales(amax)
    assert s.tolist() == [1.0, 2.0**-7, 1.0, 2.0, 16.0, 1.0]
    assert bool(((amax[1:5] / s[1:5]) <= FP8_TARGET).all())
    assert layout_name(torch.float32, torch.float32, None) == "LKTHD"  # auto: today's namespace
    a = layout_name(F8, torch.float32, scales(0))
    assert a.startswith("LKH(TD+f32scale);compute=float32;scales=")
    assert a != layout_name(F8, torch.float32, scales(1)) != layout_name(F8, torch.bfloat16, scales(1))
    assert layout_name(torch.bfloat16, torch.float32, None) == "LKTHD;compute=float32"
