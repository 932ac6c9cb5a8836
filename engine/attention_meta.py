"""The per-step attention metadata every backend reads, and the K/V store into the pages.
Backends live in ``engine/attention_<name>.py``; ``engine/attention.py`` picks one.

Cache layout (shared by every backend and by the connector's gather/scatter):
``k_cache, v_cache: [num_pages, page_size, kv_heads, head_dim]`` per layer; token ``j`` of a
sequence lives at slot ``page_table[j // page_size] * page_size + j % page_size``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.kv_dtype import FP8_MAX


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
    _decode_meta: AttnMetadata | None = None
    # Per-step tensors a backend derives once and every layer reuses (its launch plan),
    # keyed by the backend; dropped with the metadata at the end of the step.
    plans: dict = field(default_factory=dict)

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
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write the new tokens' K/V ([T, kv_heads, head_dim]) into their cache slots, converted to
    the cache's dtype (fp8: divided by the per-KV-head scales and saturated, see
    engine/kv_dtype.py)."""
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        kv_heads, head_dim = x.shape[1], x.shape[2]
        q = quantize(x, scale, cache.dtype)
        if cache.element_size() == 1:  # index_copy_ has no fp8 kernels: move the bytes
            cache, q = cache.view(torch.uint8), q.view(torch.uint8)
        cache.view(-1, kv_heads, head_dim).index_copy_(0, slots, q)


def quantize(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``x [T, kv_heads, D]`` as stored in a cache of ``dtype`` (``scale [kv_heads]`` for fp8)."""
    if scale is None:
        return x.to(dtype)
    return (x.float() / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(dtype)


def seq_slots(meta: AttnMetadata, i: int, n: int) -> torch.Tensor:
    """Cache slots of the first ``n`` tokens of sequence ``i`` (int64, on the table's device)."""
    ps = meta.page_size
    pages = meta.block_tables[i, : (n + ps - 1) // ps].to(torch.int64)
    return (pages[:, None] * ps + torch.arange(ps, device=pages.device)[None, :]).reshape(-1)[:n]


class PagedAttention:
    """What every backend shares: ``forward`` stores the step's new K/V into their slots and
    returns the backend's :meth:`attend` over the pages."""

    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttnMetadata,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim]; ``k_scale``, ``v_scale``:
        per-KV-head scales of fp8 caches. Returns [T, heads, head_dim]."""
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        return self.attend(q, k, v, k_cache, v_cache, meta, k_scale, v_scale)

    def attend(self, q, k, v, k_cache, v_cache, meta: AttnMetadata, k_scale, v_scale) -> torch.Tensor:
        """:meth:`forward`'s attention, once ``k`` and ``v`` are in the pages."""
        raise NotImplementedError
