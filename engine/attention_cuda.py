"""CUDA attention backends. NOT exercised in this repository's CI (no GPU there): written
against the documented APIs of Triton and flash-attn and kept small on purpose.

- ``TritonAttention``: prefill via torch SDPA (the torch backend's path), decode via a Triton
  paged-attention kernel that reads K/V straight from the pages through the block table.
- ``FlashAttention``: prefill via ``flash_attn_varlen_func`` (fresh K/V, or K/V gathered from
  pages when a cached prefix exists); decode via ``flash_attn_with_kvcache`` with a block
  table when the page size is a multiple of 256 (flash-attn's paged-KV requirement),
  otherwise via the Triton kernel.
"""

from __future__ import annotations

import torch

from engine.attention import AttnMetadata, TorchAttention, _seq_slots, store_kv
from engine.errors import ConfigError


def _triton_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def paged_decode(
        Q, K, V, Out, BT, CL, scale,
        s_qb, s_qh, s_kp, s_ks, s_kh, s_btb, s_ob, s_oh,
        GROUP: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr,
    ):  # fmt: skip
        # One program per (sequence, query head): online softmax over the sequence's pages.
        b = tl.program_id(0)
        h = tl.program_id(1)
        kvh = h // GROUP
        ctx = tl.load(CL + b)
        d = tl.arange(0, D)
        offs = tl.arange(0, PAGE)
        q = tl.load(Q + b * s_qb + h * s_qh + d).to(tl.float32)
        m = tl.full([], float("-inf"), tl.float32)
        lse = tl.full([], 0.0, tl.float32)
        acc = tl.zeros([D], dtype=tl.float32)
        for i in range(0, tl.cdiv(ctx, PAGE)):
            page = tl.load(BT + b * s_btb + i).to(tl.int64)
            valid = i * PAGE + offs < ctx
            base = page * s_kp + offs[:, None] * s_ks + kvh * s_kh + d[None, :]
            k = tl.load(K + base, mask=valid[:, None], other=0.0).to(tl.float32)
            s = tl.sum(k * q[None, :], axis=1) * scale
            s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=0))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new)
            v = tl.load(V + base, mask=valid[:, None], other=0.0).to(tl.float32)
            lse = lse * alpha + tl.sum(p, axis=0)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            m = m_new
        tl.store(Out + b * s_ob + h * s_oh + d, (acc / lse).to(Out.dtype.element_ty))

    return paged_decode


class TritonAttention(TorchAttention):
    name = "triton"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim)
        if head_dim & (head_dim - 1):
            raise ConfigError(f"the Triton decode kernel needs a power-of-two head_dim, got {head_dim}")
        self._kernel = _triton_kernel()

    def _decode(
        self, q: torch.Tensor, kf: torch.Tensor, vf: torch.Tensor, meta: AttnMetadata
    ) -> torch.Tensor:
        b = q.shape[0]
        ps = meta.page_size
        k_cache = kf.view(-1, ps, self.num_kv_heads, self.head_dim)
        v_cache = vf.view(-1, ps, self.num_kv_heads, self.head_dim)
        q = q.contiguous()
        out = torch.empty_like(q)
        bt = meta.block_tables.contiguous()
        self._kernel[(b, self.num_heads)](
            q, k_cache, v_cache, out, bt, meta.context_lens_t, self.scale,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            bt.stride(0), out.stride(0), out.stride(1),
            GROUP=self.num_heads // self.num_kv_heads, PAGE=ps, D=self.head_dim,
        )  # fmt: skip
        return out


class FlashAttention(TritonAttention):
    name = "flash_attn"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        super().__init__(num_heads, num_kv_heads, head_dim)
        self._varlen, self._kvcache = flash_attn_varlen_func, flash_attn_with_kvcache

    def forward(self, q, k, v, k_cache, v_cache, meta: AttnMetadata) -> torch.Tensor:
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        kf = k_cache.view(-1, self.num_kv_heads, self.head_dim)
        vf = v_cache.view(-1, self.num_kv_heads, self.head_dim)
        nd = meta.num_leading_decodes()
        out = torch.empty_like(q)
        if nd:
            dm = meta if meta.is_decode_only else meta.decode_part()
            out[:nd] = self._decode(q[:nd], kf, vf, dm)
            if meta.is_decode_only:
                return out
        # Prefill chunks: K/V of sequence i are its fresh tokens when it has no cached prefix,
        # else gathered from its pages; one varlen call covers them all (bottom-right causal).
        ks, vs, cu_k = [], [], [0]
        start = nd
        for i in range(nd, len(meta.query_lens)):
            ql, cl = meta.query_lens[i], meta.context_lens[i]
            if ql == cl:
                ks.append(k[start : start + ql])
                vs.append(v[start : start + ql])
            else:
                slots = _seq_slots(meta, i, cl)
                ks.append(kf[slots])
                vs.append(vf[slots])
            cu_k.append(cu_k[-1] + cl)
            start += ql
        qp = q[nd:]
        cu_q = (meta.cu_query[nd:] - meta.cu_query[nd]).to(torch.int32)
        o = self._varlen(
            qp, torch.cat(ks), torch.cat(vs), cu_q, torch.tensor(cu_k, dtype=torch.int32, device=q.device),
            max(meta.query_lens[nd:]), max(meta.context_lens[nd:]), softmax_scale=self.scale, causal=True,
        )  # fmt: skip
        out[nd:] = o
        return out

    def _decode(self, q, kf, vf, meta: AttnMetadata) -> torch.Tensor:
        ps = meta.page_size
        if ps % 256:  # flash-attn's paged KV needs pages of a multiple of 256 tokens
            return super()._decode(q, kf, vf, meta)
        o = self._kvcache(
            q[:, None],  # [B, 1, H, D]
            kf.view(-1, ps, self.num_kv_heads, self.head_dim),
            vf.view(-1, ps, self.num_kv_heads, self.head_dim),
            cache_seqlens=meta.context_lens_t,
            block_table=meta.block_tables,
            softmax_scale=self.scale,
            causal=True,
        )
        return o[:, 0]


def make_cuda_backend(name: str, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype):
    """``auto``: flash-attn if it imports (and the dtype is fp16/bf16, all it computes in),
    else Triton, else torch; an explicit name that cannot be built raises ConfigError."""
    half = dtype in (torch.float16, torch.bfloat16)
    if name == "flash_attn" and not half:
        raise ConfigError(f"attention_backend 'flash_attn' needs float16 or bfloat16, got {dtype}")
    if name == "flash_attn" or (name == "auto" and half):
        try:
            return FlashAttention(num_heads, num_kv_heads, head_dim)
        except ImportError as exc:
            if name == "flash_attn":
                raise ConfigError(
                    f"attention_backend 'flash_attn' but flash_attn does not import: {exc}"
                ) from exc
    try:
        return TritonAttention(num_heads, num_kv_heads, head_dim)
    except ImportError as exc:
        if name == "triton":
            raise ConfigError(f"attention_backend 'triton' but triton does not import: {exc}") from exc
    return TorchAttention(num_heads, num_kv_heads, head_dim)
