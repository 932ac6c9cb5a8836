"""Attention over the paged KV cache: the per-step metadata and the torch backend (CPU, and
the CUDA fallback). CUDA-only backends live in ``engine/attention_cuda.py``.

Cache layout (shared by every backend and by the connector's gather/scatter):
``k_cache, v_cache: [num_pages, page_size, kv_heads, head_dim]`` per layer; token ``j`` of a
sequence lives at slot ``page_table[j // page_size] * page_size + j % page_size``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

_CUDA_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass
class AttnMetadata:
    """Everything attention needs for one step. Sequences appear in batch order; their query
    tokens are concatenated. ``context_lens[i]`` counts cached + new tokens of sequence ``i``."""

    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V goes
    query_lens: list[int]
    context_lens: list[int]
    block_tables: torch.Tensor  # [B, max_pages] int32, padded with 0
    cu_query: torch.Tensor  # [B + 1] int32
    context_lens_t: torch.Tensor  # [B] int32
    max_query_len: int
    max_context_len: int
    page_size: int
    # Built lazily by the torch backend for the decode fast path (shared by all layers).
    _decode_slots: torch.Tensor | None = None
    _decode_mask: torch.Tensor | None = None

    _decode_meta: AttnMetadata | None = None

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    def num_leading_decodes(self) -> int:
        n = 0
        for q in self.query_lens:
            if q != 1:
                break
            n += 1
        return n

    def decode_part(self) -> AttnMetadata:
        """Metadata of the leading decode-only sequences (built once per step)."""
        if self._decode_meta is None:
            n = self.num_leading_decodes()
            cl = self.context_lens[:n]
            self._decode_meta = AttnMetadata(
                slot_mapping=self.slot_mapping[:n],
                query_lens=[1] * n,
                context_lens=cl,
                block_tables=self.block_tables[:n],
                cu_query=self.cu_query[: n + 1],
                context_lens_t=self.context_lens_t[:n],
                max_query_len=1,
                max_context_len=max(cl),
                page_size=self.page_size,
            )
        return self._decode_meta


def build_metadata(
    query_lens: list[int], context_lens: list[int], page_tables: list[list[int]], page_size: int, device: str
) -> AttnMetadata:
    """Build the metadata for a batch: sequence ``i`` computes tokens
    ``[context_lens[i] - query_lens[i], context_lens[i])`` using pages ``page_tables[i]``."""
    slots: list[int] = []
    for q, c, pt in zip(query_lens, context_lens, page_tables):
        for j in range(c - q, c):
            slots.append(pt[j // page_size] * page_size + j % page_size)
    width = max(len(pt) for pt in page_tables)
    bt = torch.zeros((len(page_tables), width), dtype=torch.int32)
    for i, pt in enumerate(page_tables):
        bt[i, : len(pt)] = torch.tensor(pt, dtype=torch.int32)
    cu = [0]
    for q in query_lens:
        cu.append(cu[-1] + q)
    return AttnMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_lens=list(query_lens),
        context_lens=list(context_lens),
        block_tables=bt.to(device),
        cu_query=torch.tensor(cu, dtype=torch.int32, device=device),
        context_lens_t=torch.tensor(context_lens, dtype=torch.int32, device=device),
        max_query_len=max(query_lens),
        max_context_len=max(context_lens),
        page_size=page_size,
    )


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """Write the new tokens' K/V ([T, kv_heads, head_dim]) into their cache slots."""
    kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slots, k)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slots, v)


def _seq_slots(meta: AttnMetadata, i: int, n: int) -> torch.Tensor:
    ps = meta.page_size
    pages = meta.block_tables[i, : (n + ps - 1) // ps].to(torch.int64)
    return (pages[:, None] * ps + torch.arange(ps, device=pages.device)[None, :]).reshape(-1)[:n]


class TorchAttention:
    """Plain torch attention: SDPA over K/V gathered from pages. Decode steps run as one
    padded, masked SDPA call for the whole batch; prefill chunks run one call per sequence
    (with no cached prefix the fresh K/V are used directly, causal)."""

    name = "torch"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttnMetadata,
    ) -> torch.Tensor:
        """q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim]. Returns [T, heads, head_dim]."""
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        kf = k_cache.view(-1, self.num_kv_heads, self.head_dim)
        vf = v_cache.view(-1, self.num_kv_heads, self.head_dim)
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
                ki, vi = k[start : start + ql], v[start : start + ql]
                mask, causal = None, ql > 1
            else:
                slots = _seq_slots(meta, i, cl)
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

    def _decode(
        self, q: torch.Tensor, kf: torch.Tensor, vf: torch.Tensor, meta: AttnMetadata
    ) -> torch.Tensor:
        if meta._decode_slots is None:  # once per step, shared by every layer
            n = meta.max_context_len
            b = len(meta.context_lens)
            ps = meta.page_size
            pages = meta.block_tables[:, : (n + ps - 1) // ps].to(torch.int64)
            slots = (pages[:, :, None] * ps + torch.arange(ps, device=q.device)).reshape(b, -1)[:, :n]
            mask = torch.arange(n, device=q.device)[None, :] < meta.context_lens_t[:, None].to(torch.int64)
            meta._decode_slots = slots.masked_fill(~mask, 0)
            meta._decode_mask = mask[:, None, None, :]
        slots = meta._decode_slots
        b, n = slots.shape
        ki = kf[slots.reshape(-1)].view(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        vi = vf[slots.reshape(-1)].view(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        o = self._sdpa(q[:, :, None, :], ki, vi, meta._decode_mask, False)  # q: [B, H, 1, D]
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


def make_backend(
    name: str, device: str, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
):
    """Pick an attention backend. ``auto``: flash-attn when it imports on CUDA (half precision
    only), else Triton paged decode on CUDA, else plain torch. An explicit name that cannot
    run raises ConfigError."""
    if device.startswith("cuda") and name in ("auto", "flash_attn", "triton"):
        from engine import attention_cuda

        return attention_cuda.make_cuda_backend(name, num_heads, num_kv_heads, head_dim, dtype)
    if name in ("flash_attn", "triton"):
        from engine.errors import ConfigError

        raise ConfigError(f"attention_backend {name!r} needs a CUDA device, got device {device!r}")
    return TorchAttention(num_heads, num_kv_heads, head_dim)
