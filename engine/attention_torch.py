"""The torch attention backend: SDPA over K/V gathered from the pages. The CPU default and the
reference every other backend is tested against; also the CUDA fallback.

Decode steps run as one padded, masked SDPA call for the whole batch; prefill chunks run one
call per sequence (with no cached prefix the fresh K/V are used directly, causal).

Pages in another dtype than the query's (``--kv-cache-dtype``: fp8 with per-KV-head scales, or
bf16/fp16/fp32) are converted to the query dtype as they are gathered (fp8 scales go onto the
queries and the output), and a prefill without
a cached prefix then reads its own K/V back from the pages too: every step attends over the
values the pages hold, so a prefix-cache or connector hit sees exactly what the cold run saw.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from engine.attention_meta import AttnMetadata, PagedAttention, seq_slots

_CUDA_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class _Pages:
    """One layer's K or V pages as flat slots; indexing gathers slots converted to the compute
    dtype (fp8 scales are applied by the caller, on the queries and the output)."""

    def __init__(self, cache: torch.Tensor, dtype: torch.dtype, heads: int, head_dim: int) -> None:
        self.flat = cache.view(-1, heads, head_dim)
        self.dtype = dtype
        self.converts = cache.dtype != dtype

    def __getitem__(self, slots: torch.Tensor) -> torch.Tensor:
        x = self.flat[slots]
        return x.to(self.dtype) if self.converts else x


class TorchAttention(PagedAttention):
    """Plain torch attention (see the module docstring)."""

    name = "torch"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5

    def attend(self, q, k, v, k_cache, v_cache, meta: AttnMetadata, k_scale, v_scale) -> torch.Tensor:
        kf = _Pages(k_cache, q.dtype, self.num_kv_heads, self.head_dim)
        vf = _Pages(v_cache, q.dtype, self.num_kv_heads, self.head_dim)
        if k_scale is not None:
            # fp8: attend over the stored values as they convert, with the per-KV-head scales
            # moved onto the queries (scores = (q * k_scale) . k8) and the output (times
            # v_scale): one multiply of q and out instead of two of the whole context. The
            # scales are powers of two, so this is exact.
            group = self.num_heads // self.num_kv_heads
            q = q * k_scale.repeat_interleave(group).to(q.dtype)[:, None]
            out = self._attend(q, k, v, kf, vf, meta)
            return out.mul_(v_scale.repeat_interleave(group).to(out.dtype)[:, None])
        return self._attend(q, k, v, kf, vf, meta)

    def _attend(self, q, k, v, kf: _Pages, vf: _Pages, meta: AttnMetadata) -> torch.Tensor:
        if meta.is_decode_only:
            return self._decode(q, kf, vf, meta)
        out = torch.empty_like(q)
        # The scheduler puts decodes first: run them as one batched call, then the prefills.
        nd = meta.num_leading_decodes()
        if nd:
            out[:nd] = self._decode(q[:nd], kf, vf, meta.decode_part())
        start = nd
        for i, (ql, cl) in enumerate(zip(meta.query_lens, meta.context_lens)):
            if i < nd:
                continue
            qi = q[start : start + ql].transpose(0, 1)[None]  # [1, H, ql, D]
            if ql == cl:  # no cached prefix: attend to the fresh K/V, plain causal
                if kf.converts:  # ... as the pages hold them
                    slots = seq_slots(meta, i, cl)
                    ki, vi = kf[slots], vf[slots]
                else:
                    ki, vi = k[start : start + ql], v[start : start + ql]
                mask, causal = None, ql > 1
            else:
                slots = seq_slots(meta, i, cl)
                ki, vi = kf[slots], vf[slots]
                # query j (absolute position cl - ql + j) sees keys 0 .. cl - ql + j: causal
                # aligned bottom-right. On CUDA as a bias object the fused kernels take (no
                # [ql, cl] mask is built); on CPU an explicit mask (measured faster there).
                if q.is_cuda:
                    mask = causal_lower_right(ql, cl)
                else:
                    qpos = torch.arange(cl - ql, cl, device=q.device)[:, None]
                    mask = torch.arange(cl, device=q.device)[None, :] <= qpos
                causal = False
            o = self._sdpa(qi, ki.transpose(0, 1)[None], vi.transpose(0, 1)[None], mask, causal)
            out[start : start + ql] = o[0].transpose(0, 1)
            start += ql
        return out

    def _decode(self, q: torch.Tensor, kf: _Pages, vf: _Pages, meta: AttnMetadata) -> torch.Tensor:
        plan = meta.plans.get(self.name)
        if plan is None:  # once per step, shared by every layer
            n = meta.max_context_len
            b = len(meta.context_lens)
            ps = meta.page_size
            pages = meta.block_tables[:, : (n + ps - 1) // ps].to(torch.int64)
            slots = (pages[:, :, None] * ps + torch.arange(ps, device=q.device)).reshape(b, -1)[:, :n]
            mask = torch.arange(n, device=q.device)[None, :] < meta.context_lens_t[:, None].to(torch.int64)
            plan = meta.plans[self.name] = (slots.masked_fill(~mask, 0), mask[:, None, None, :])
        slots, mask = plan
        b, n = slots.shape
        ki = kf[slots.reshape(-1)].view(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        vi = vf[slots.reshape(-1)].view(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        o = self._sdpa(q[:, :, None, :], ki, vi, mask, False)  # q: [B, H, 1, D]
        return o[:, :, 0, :]

    def _sdpa(self, q, k, v, mask, causal: bool) -> torch.Tensor:
        """SDPA over [B, heads, L, D] tensors with GQA. On CPU ``enable_gqa`` (measured faster
        than expanding); on CUDA K/V heads are expanded so the flash kernel always applies
        (a math fallback at long context would materialise the full score matrix)."""
        group = self.num_heads // self.num_kv_heads
        if not q.is_cuda:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, scale=self.scale, enable_gqa=group > 1
            )
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        # Not cuDNN: it builds an execution plan per new shape (~2 ms a call on an H200), and
        # every request's context length is a new shape.
        with sdpa_kernel(_CUDA_SDPA):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=self.scale)


def create(
    device: str, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> TorchAttention:
    """Runs anywhere torch does."""
    return TorchAttention(num_heads, num_kv_heads, head_dim)
