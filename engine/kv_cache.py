"""The KV cache tensors and the page <-> block-buffer copies the connector uses.

One tensor ``data: [layers, 2 (k, v), num_pages + 1, page_size, kv_heads, head_dim]`` (the
last page is scratch, see ``scratch_page``). Layer
``l``'s caches are the views ``data[l, 0]`` / ``data[l, 1]`` (``[num_pages, page_size,
kv_heads, head_dim]``, the layout flash-attn's paged API expects). A block of ``n`` pages
moves as one contiguous buffer ``[layers, 2, n * page_size, kv_heads, head_dim]`` (the
store's block payload layout).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.errors import ConfigError


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device,
    ) -> None:
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        # One page more than the pool: the scratch page (index ``num_pages``), never handed
        # out, where the padding rows of a fixed-size decode batch (CUDA graphs) write their K/V.
        self.scratch_page = num_pages
        self.data = torch.zeros(
            (num_layers, 2, num_pages + 1, page_size, num_kv_heads, head_dim), dtype=dtype, device=device
        )

    @staticmethod
    def bytes_per_page(
        num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return (
            num_layers * 2 * page_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        )

    @property
    def page_bytes(self) -> int:
        """Bytes of one page over all layers (K and V)."""
        return self.bytes_per_page(
            self.num_layers, self.page_size, self.num_kv_heads, self.head_dim, self.dtype
        )

    @classmethod
    def pages_for_budget(cls, budget_bytes: int, **shape) -> int:
        """How many pages fit in ``budget_bytes`` beside the scratch page; ConfigError if
        fewer than 2."""
        n = budget_bytes // cls.bytes_per_page(**shape) - 1
        if n < 2:
            raise ConfigError(f"kv_cache_bytes {budget_bytes} holds only {n} pages; raise it")
        return int(n)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i, 0], self.data[i, 1]

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [self.layer(i) for i in range(self.num_layers)]

    def block_shape(self, num_pages: int) -> tuple[int, ...]:
        return (self.num_layers, 2, num_pages * self.page_size, self.num_kv_heads, self.head_dim)

    def check_block(self, page_ids: Sequence[int], buf: torch.Tensor) -> None:
        """Raise ValueError / IndexError unless ``buf`` is a block buffer for ``page_ids``."""
        if not page_ids:
            raise ValueError("page_ids must not be empty")
        if tuple(buf.shape) != self.block_shape(len(page_ids)):
            raise ValueError(f"buffer shape {tuple(buf.shape)} != {self.block_shape(len(page_ids))}")
        if min(page_ids) < 0 or max(page_ids) >= self.num_pages:
            raise IndexError(f"page ids {list(page_ids)} out of range [0, {self.num_pages})")

    def device_index(self, page_ids: Sequence[int]) -> torch.Tensor:
        """``page_ids`` validated, as an int64 tensor on the cache's device (a copy method
        given it instead of a list skips the per-call check and transfer)."""
        return self._index(page_ids)

    def _index(self, page_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        if isinstance(page_ids, torch.Tensor):  # from device_index: checked already
            return page_ids
        if not page_ids:
            raise ValueError("page_ids must not be empty")
        idx = torch.as_tensor(list(page_ids), dtype=torch.int64)
        if int(idx.min()) < 0 or int(idx.max()) >= self.num_pages:
            raise IndexError(f"page ids {list(page_ids)} out of range [0, {self.num_pages})")
        if self.data.is_cuda:  # page-locked + async: a plain H2D would wait for the whole stream
            return idx.pin_memory().to(self.data.device, non_blocking=True)
        return idx

    def gather_block(self, page_ids: Sequence[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """Copy pages ``page_ids`` (in order) into one contiguous ``[layers, 2, n*page_size,
        kv_heads, head_dim]`` buffer (``out`` if given: same dtype, any device-compatible
        contiguous tensor of that shape) and return it."""
        idx = self._index(page_ids)
        n = len(page_ids)
        src = self.data.index_select(2, idx)  # [L, 2, n, ps, H, D]
        if out is None:
            return src.reshape(self.block_shape(n))
        if tuple(out.shape) != self.block_shape(n) or not out.is_contiguous():
            raise ValueError(
                f"out must be contiguous with shape {self.block_shape(n)}, got {tuple(out.shape)}"
            )
        out.view(src.shape).copy_(src)
        return out

    def scatter_block(
        self, page_ids: Sequence[int] | torch.Tensor, buf: torch.Tensor, non_blocking: bool = False
    ) -> None:
        """Copy a ``[layers, 2, n*page_size, kv_heads, head_dim]`` buffer into pages
        ``page_ids`` (inverse of :meth:`gather_block`): :meth:`scatter_layers` over every layer."""
        self.scatter_layers(range(self.num_layers), page_ids, buf, non_blocking)

    def scatter_layers(
        self,
        layers: range,
        page_ids: Sequence[int] | torch.Tensor,
        buf: torch.Tensor,
        non_blocking: bool = False,
    ) -> None:
        """Copy layers ``layers`` (a contiguous step-1 range) of a block buffer into pages
        ``page_ids``: the block layout is layer-major, so that part of ``buf`` is one contiguous
        slice and moves as one copy. The buffer may live on another device; ``non_blocking``
        (CUDA, page-locked ``buf``) returns before the copy ran, on the current stream: ``buf``
        must then stay untouched until that stream passed this point. ``page_ids`` may be a
        tensor from :meth:`device_index`."""
        idx = self._index(page_ids)
        n = len(page_ids)
        if tuple(buf.shape) != self.block_shape(n):
            raise ValueError(f"buffer shape {tuple(buf.shape)} != {self.block_shape(n)}")
        if layers.step != 1 or not 0 <= layers.start < layers.stop <= self.num_layers:
            raise IndexError(f"layers {layers} not a non-empty range within [0, {self.num_layers})")
        a, b = layers.start, layers.stop
        src = buf[a:b].to(device=self.data.device, dtype=self.dtype, non_blocking=non_blocking)
        self.data[a:b].index_copy_(
            2, idx, src.reshape(b - a, 2, n, self.page_size, self.num_kv_heads, self.head_dim)
        )
