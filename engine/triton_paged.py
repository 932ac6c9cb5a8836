"""One Triton paged-attention kernel for every step: prefill chunks with or without a cached
prefix, decode tokens, and any mix of them in one ragged batch.

K/V are read in place from the page pool through the block table (no gather, no copy of the
cached context), so a 32K-token hit costs reading its K/V once per layer and nothing more.

Work split. The query tokens of each sequence are cut into tiles of ``block_m`` tokens; one
program handles one (tile, KV head, key split): its rows are the tile's tokens times the KV
head's group of query heads (GQA without expanding K/V: each K/V tile is loaded once for the
whole group). Keys are walked in tiles of ``block_n`` token positions; each position's page
comes from the block table, so any page size works and pages need not be contiguous. Causal
masking is aligned lower-right: query ``j`` of a chunk of ``q`` tokens in a context of ``c``
sees keys ``0 .. c - q + j``. The softmax is online, in fp32.

Split-K (flash-decoding). When tiles x KV heads would leave the GPU idle (decode, or a short
tail over a long prefix) the key range is cut into ``splits`` parts, each program writes a
partial output and its log-sum-exp, and :func:`merge_splits` combines them exactly.

Quantized K/V (for fp8 pages later): ``k_scale`` / ``v_scale`` are optional fp32 tensors of
one scale per KV head; scores are multiplied by ``k_scale`` and outputs by ``v_scale``, and K/V
tiles are cast to the dot products' operand type (the query's) before the dot products.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.attention_meta import AttnMetadata
from engine.errors import ConfigError
from engine.triton_plan import LaunchPlan, PagedKernelConfig, plan_decode, plan_step, pow2


def build_kernel():
    """Define the kernel. Called per backend instance, not at import: whether Triton compiles
    for the GPU or runs the CPU interpreter is decided when the function is decorated
    (``TRITON_INTERPRET=1`` at that moment). The interpreter finds ``tl`` among the module's
    globals, so it is imported at the top."""

    @triton.jit
    def paged_attn(
        Q, K, V, Out, Lse, BT, CTX, CUQ, TSEQ, TSTART, KS, VS,
        scale, split_len,
        s_qt, s_qh, s_kp, s_ks, s_kh, s_vp, s_vs, s_vh, s_bt, s_ot, s_oh, s_os, s_lt, s_lh,
        GROUP: tl.constexpr, GROUP_P2: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr,
        BLOCK_N: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr, D_P2: tl.constexpr,
        SPLIT: tl.constexpr, HAS_SCALE: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr,
    ):  # fmt: skip
        tile = tl.program_id(0)
        kvh = tl.program_id(1)
        sp = tl.program_id(2)
        b = tl.load(TSEQ + tile)
        m0 = tl.load(TSTART + tile)
        q0 = tl.load(CUQ + b)
        qlen = tl.load(CUQ + b + 1) - q0
        ctx = tl.load(CTX + b)
        prefix = ctx - qlen
        # Row r of this program: query token m0 + r // GROUP_P2 of the tile, head r % GROUP_P2
        # of the KV head's group (padded rows are masked).
        r = tl.arange(0, ROWS)
        mi = r // GROUP_P2
        g = r % GROUP_P2
        row_ok = (mi < BLOCK_M) & (g < GROUP) & (m0 + mi < qlen)
        tok = (q0 + m0 + mi).to(tl.int64)
        head = kvh * GROUP + g
        pos = prefix + m0 + mi  # the row's absolute position: it sees keys 0 .. pos
        d = tl.arange(0, D_P2)
        d_ok = d < D
        q = tl.load(
            Q + tok[:, None] * s_qt + head[:, None] * s_qh + d[None, :],
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        ).to(DOT_DTYPE)
        # Keys this program reads: up to the causal limit of its last row, within its split.
        lo = sp * split_len
        hi = tl.minimum(tl.minimum(ctx, prefix + m0 + BLOCK_M), lo + split_len)
        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, D_P2], tl.float32)
        qk_scale = scale
        if HAS_SCALE:
            qk_scale = scale * tl.load(KS + kvh)
        for start in range(lo, hi, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            n_ok = n < hi
            page = tl.load(BT + b * s_bt + n // PAGE, mask=n_ok, other=0).to(tl.int64)
            slot = n % PAGE
            kd_ok = n_ok[:, None] & d_ok[None, :]
            k = tl.load(
                K + (page * s_kp + slot * s_ks + kvh * s_kh)[:, None] + d[None, :], mask=kd_ok, other=0.0
            )
            s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PREC) * qk_scale
            ok = row_ok[:, None] & n_ok[None, :] & (n[None, :] <= pos[:, None])
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            # A row that has seen no key yet keeps m = -inf; exponentiate against 0 then, so
            # exp(-inf - -inf) never makes a NaN.
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_use)
            p = tl.exp(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(
                V + (page * s_vp + slot * s_vs + kvh * s_vh)[:, None] + d[None, :], mask=kd_ok, other=0.0
            )
            acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PREC)
            m_i = m_new
        if HAS_SCALE:
            acc = acc * tl.load(VS + kvh)
        seen = l_i > 0
        o = acc / tl.where(seen, l_i, 1.0)[:, None]
        o_ptr = Out + tok[:, None] * s_ot + head[:, None] * s_oh + d[None, :]
        if SPLIT:
            tl.store(o_ptr + sp * s_os, o, mask=row_ok[:, None] & d_ok[None, :])
            lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
            tl.store(Lse + tok * s_lt + head * s_lh + sp, lse, mask=row_ok)
        else:
            tl.store(o_ptr, o.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])

    return paged_attn


def merge_splits(part: torch.Tensor, lse: torch.Tensor, out: torch.Tensor) -> None:
    """Combine split-K partials: ``part [T, H, S, D]`` fp32 (each normalised over its keys),
    ``lse [T, H, S]`` (-inf for a split that saw no key) into ``out [T, H, D]``. Split 0 always
    holds key 0, so every row has a finite weight."""
    w = torch.softmax(lse, dim=-1)
    out.copy_(torch.einsum("ths,thsd->thd", w, part))


class PagedAttentionKernel:
    """The kernel bound to a model's head shape; :meth:`__call__` runs one layer."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, cfg: PagedKernelConfig) -> None:
        if num_heads % num_kv_heads:
            raise ConfigError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim, self.cfg = num_heads, num_kv_heads, head_dim, cfg
        self.group = num_heads // num_kv_heads
        self.scale = head_dim**-0.5
        self._fn = build_kernel()
        self._interpreted = triton.knobs.runtime.interpret

    def _dot_dtype(self, dtype: torch.dtype):
        """The dot products' operand type: the query dtype (bf16/fp16 on tensor cores, fp32
        as IEEE fp32), except bf16 under the interpreter, whose bf16 ``tl.dot`` is wrong
        (triton 3.9: numpy has no bf16); there the operands go up to fp32."""
        if dtype == torch.float32 or (dtype == torch.bfloat16 and self._interpreted):
            return tl.float32
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(
                f"the paged kernel computes in float32/float16/bfloat16, got query dtype {dtype}"
            )
        return tl.float16 if dtype == torch.float16 else tl.bfloat16

    @property
    def plan_key(self) -> tuple:
        """Where this kernel's plan lives in ``AttnMetadata.plans``."""
        return ("triton_paged", id(self))

    def plan(self, meta: AttnMetadata, device) -> LaunchPlan:
        """The step's plan: one put in ``meta.plans`` beforehand (a CUDA graph's fixed plan),
        else built on first use and kept there for the other layers."""
        plan = meta.plans.get(self.plan_key)
        if plan is None:
            plan = meta.plans[self.plan_key] = plan_step(
                meta, self.num_kv_heads, self.group, self.cfg, device
            )
        return plan

    def decode_plan(self, batch: int, max_context: int, device) -> LaunchPlan:
        return plan_decode(batch, self.num_kv_heads, max_context, self.cfg, device)

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttnMetadata,
        out: torch.Tensor,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of ``q [T, heads, D]`` over the pages ``k_cache, v_cache [pages, page_size,
        kv_heads, D]`` (the step's new K/V already stored) into ``out [T, heads, D]``."""
        if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or out.stride(-1) != 1:
            raise ValueError("q, k_cache, v_cache and out need a contiguous last (head_dim) axis")
        p = self.plan(meta, q.device)
        gp2 = pow2(self.group)
        rows = max(16, p.block_m * gp2)
        bt = meta.block_tables
        split = p.splits > 1
        t, h, d = q.shape
        if split:
            dst = torch.empty((t, h, p.splits, d), dtype=torch.float32, device=q.device)
            lse = torch.empty((t, h, p.splits), dtype=torch.float32, device=q.device)
        else:
            dst, lse = out, out  # Lse is unused without splits
        has_scale = k_scale is not None
        ks = k_scale if has_scale else q
        vs = v_scale if has_scale else q
        grid = (p.tile_seq.numel(), self.num_kv_heads, p.splits)
        self._fn[grid](
            q, k_cache, v_cache, dst, lse, bt, meta.context_lens_t, meta.cu_query, p.tile_seq, p.tile_start,
            ks, vs, self.scale, p.split_len,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), bt.stride(0),
            dst.stride(0), dst.stride(1), dst.stride(2) if split else 0,
            lse.stride(0) if split else 0, lse.stride(1) if split else 0,
            GROUP=self.group, GROUP_P2=gp2, BLOCK_M=p.block_m, ROWS=rows, BLOCK_N=self.cfg.block_n,
            PAGE=meta.page_size, D=d, D_P2=max(16, pow2(d)), SPLIT=split, HAS_SCALE=has_scale,
            DOT_DTYPE=self._dot_dtype(q.dtype), DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
            num_warps=self.cfg.num_warps, num_stages=self.cfg.num_stages,
        )  # fmt: skip
        if split:
            merge_splits(dst, lse, out)
        return out
