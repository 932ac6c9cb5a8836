"""vLLM's KV tensors as the connector's loader and saver see pages: what the bundled engine's
``ctx.kv`` and ``ctx.transfer`` give them (engine/kv_transfer.py), for vLLM's layout.

A block is page ``b`` of every attention layer: ``layer[b]`` of each per-layer tensor
(vLLM's ``[num_blocks, H, N, C]`` view, whatever its strides), stacked as ``[layers, H, N, C]``.
A batch moves with one indexed copy per layer, never one per block; the bytes inside a page
are not interpreted. The scheduler side holds no tensors (``tensors`` empty): it only looks up.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from connector.vllm_format import PageFormat


class VllmPages:
    """``tensors``: the per-layer KV tensors in layer order (one per distinct tensor)."""

    def __init__(self, fmt: PageFormat, tensors: Sequence[torch.Tensor] = ()) -> None:
        self.fmt = fmt
        self.tensors = list(tensors)
        self.dtype = fmt.dtype
        self.cuda = bool(self.tensors) and self.tensors[0].is_cuda
        self.page_bytes = fmt.block_bytes

    # ---- the loader's and saver's view (ctx.kv, ctx.transfer) -------------------------------
    def block_shape(self, pages_per_block: int) -> tuple[int, ...]:
        if pages_per_block != 1:
            raise ValueError("with vLLM one tierkv block is one vLLM block")
        return self.fmt.block_shape

    def auto_groups(self, pages_per_block: int) -> int:
        return 1  # copies are one indexed copy per layer already

    def last_pending(self) -> None:
        return None  # copies are synchronous on the calling thread

    def scatter_stacked(self, pages: Sequence[Sequence[int]], stacked: torch.Tensor, groups: int = 1) -> None:
        """Copy ``stacked`` (``[n, layers, *page]``) into blocks ``pages[i][0]``."""
        idx = self._index([p[0] for p in pages])
        src = stacked.to(idx.device, non_blocking=True) if self.cuda else stacked
        for layer, tensor in enumerate(self.tensors):
            tensor.index_copy_(0, idx, src[:, layer])

    def scatter(self, blocks: Sequence[tuple[Sequence[int], torch.Tensor]], groups: int = 1) -> None:
        """Copy each ``(pages, block)`` (``block``: ``[layers, *page]``) into its page."""
        if blocks:
            self.scatter_stacked([p for p, _ in blocks], torch.stack([b for _, b in blocks]), groups)

    def gather(self, pages: Sequence[int]) -> torch.Tensor:
        """Block ``pages[0]`` copied out as ``[layers, *page]`` (host memory)."""
        return torch.stack([t[pages[0]] for t in self.tensors]).cpu()

    # ---- vLLM's per-layer saves ----------------------------------------------------------------
    def copy_layer(self, layer: int, block_ids: torch.Tensor, out: torch.Tensor) -> None:
        """``out[:, layer] = layer's pages block_ids`` (``out``: ``[n, layers, *page]``)."""
        out[:, layer].copy_(self.tensors[layer].index_select(0, block_ids.to(self.tensors[layer].device)))

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        n = self.tensors[0].shape[0]
        if any(not 0 <= b < n for b in block_ids):
            raise IndexError(f"block ids {list(block_ids)} past vLLM's {n} blocks")
        return torch.tensor(block_ids, dtype=torch.long, device=self.tensors[0].device)
