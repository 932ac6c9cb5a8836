"""The flash-attn backend: where the page size is a multiple of 256 tokens (flash-attn 2's
documented paged-KV requirement), every step is one ``flash_attn_varlen_func`` call over the
whole ragged batch with ``block_table``: K/V are read in place from the pages, causal aligned
lower-right (flash-attn >= 2.1), GQA native. Other page sizes, and pages in another dtype than
the model's (``--kv-cache-dtype``, fp8 included), run the Triton paged kernel.

NEVER RAN: flash-attn is not installed on the machines this was written and tested on (it
builds from source with nvcc); written against flash-attn 2.6's documented API.
"""

from __future__ import annotations

import torch

from engine.attention_meta import AttnMetadata, PagedAttention
from engine.attention_triton import TritonAttention
from engine.attention_triton import create as create_triton
from engine.errors import ConfigError


class FlashAttention(PagedAttention):
    name = "flash_attn"

    def __init__(self, varlen, fallback: TritonAttention) -> None:
        self._varlen, self._fallback = varlen, fallback
        self.num_heads, self.num_kv_heads, self.head_dim = (
            fallback.num_heads,
            fallback.num_kv_heads,
            fallback.head_dim,
        )
        self.scale = fallback.scale

    def attend(self, q, k, v, k_cache, v_cache, meta: AttnMetadata, k_scale, v_scale) -> torch.Tensor:
        """Pages in another dtype than the query's (fp8: flash-attn 2 has no fp8 KV path) go to
        the Triton kernel."""
        if meta.page_size % 256 or k_cache.dtype != q.dtype or k_scale is not None:
            return self._fallback.attend(q, k, v, k_cache, v_cache, meta, k_scale, v_scale)
        cu_k = meta.plans.get(self.name)
        if cu_k is None:  # once per step, shared by every layer
            cu_k = torch.zeros(len(meta.context_lens) + 1, dtype=torch.int32, device=q.device)
            torch.cumsum(meta.context_lens_t, 0, out=cu_k[1:])
            meta.plans[self.name] = cu_k
        return self._varlen(
            q, k_cache, v_cache, meta.cu_query, cu_k, meta.max_query_len, meta.max_context_len,
            softmax_scale=self.scale, causal=True, block_table=meta.block_tables,
        )  # fmt: skip


def create(
    device: str, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> FlashAttention:
    """CUDA and fp16/bf16 only (all flash-attn computes in), else ConfigError; ImportError
    without flash-attn or triton (the fallback for other page sizes)."""
    if not device.startswith("cuda"):
        raise ConfigError(f"attention_backend 'flash_attn' needs a CUDA device, got device {device!r}")
    if dtype not in (torch.float16, torch.bfloat16):
        raise ConfigError(f"attention_backend 'flash_attn' needs float16 or bfloat16, got {dtype}")
    from flash_attn import flash_attn_varlen_func

    return FlashAttention(
        flash_attn_varlen_func, create_triton(device, num_heads, num_kv_heads, head_dim, dtype)
    )
