"""The KV cache tensors and the page <-> block-buffer copies the connector uses.

One tensor ``data: [layers, 2 (k, v), num_pages + 1, page_size, kv_heads, head_dim]`` in the
storage dtype (engine/kv_dtype.py; the last page is scratch, see ``scratch_page``). Layer
``l``'s caches are the views ``data[l, 0]`` / ``data[l, 1]`` (``[num_pages, page_size,
kv_heads, head_dim]``, the layout flash-attn's paged API expects). fp8 caches also hold
``scales [layers, 2, kv_heads]`` (fp32, static): a stored value times its (layer, k/v, head)
scale is the K/V the model computed, to fp8's precision.

A block of ``n`` pages moves as one contiguous buffer of :meth:`KVCache.block_shape` (the
store's payload): ``[layers, 2, n * page_size, kv_heads, head_dim]`` for unscaled dtypes
(layout ``LKTHD``); for fp8 ``[layers, 2, kv_heads, n * page_size * head_dim + 4]``: per
(layer, k/v, head) that head's ``[tokens, head_dim]`` bytes, then its fp32 scale's 4 bytes
(little-endian), so the scales travel inside the payload (and its checksum) and a block stays
layer-major (a layer range is one contiguous slice). A block whose scales differ from the
cache's is refused by :meth:`check_block`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from engine.errors import ConfigError
from engine.kv_dtype import is_scaled

SCALE_BYTES = 4  # one fp32 scale per (layer, k/v, head) in an fp8 block


class LayerKV(NamedTuple):
    """One layer's caches ``[pages, page_size, kv_heads, head_dim]`` and, for fp8, their
    per-KV-head scales ``[kv_heads]`` (fp32; None otherwise)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None


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
        scales: torch.Tensor | None = None,
    ) -> None:
        """``dtype``: what the pages hold; ``scales`` ``[layers, 2, kv_heads]``: required for
        fp8 dtypes and refused for others (ConfigError)."""
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        if is_scaled(dtype) != (scales is not None):
            raise ConfigError(
                f"a {dtype} KV cache needs scales iff it is fp8, got scales={scales is not None}"
            )
        if scales is not None and tuple(scales.shape) != (num_layers, 2, num_kv_heads):
            raise ConfigError(f"scales shape {tuple(scales.shape)} != {(num_layers, 2, num_kv_heads)}")
        # One page more than the pool: the scratch page (index ``num_pages``), never handed
        # out, where the padding rows of a fixed-size decode batch (CUDA graphs) write their K/V.
        self.scratch_page = num_pages
        self.data = torch.zeros(
            (num_layers, 2, num_pages + 1, page_size, num_kv_heads, head_dim), dtype=dtype, device=device
        )
        self.scales = None if scales is None else scales.to(self.data.device, torch.float32).contiguous()
        # The scales as a block carries them: [layers, 2, heads, 4] bytes (host, and per device).
        self._scale_bytes: dict[torch.device, torch.Tensor] = {}
        if scales is not None:
            host = scales.detach().to("cpu", torch.float32).contiguous().view(torch.uint8)
            self._scale_bytes[torch.device("cpu")] = host.view(num_layers, 2, num_kv_heads, SCALE_BYTES)

    @property
    def scaled(self) -> bool:
        return self.scales is not None

    @staticmethod
    def bytes_per_page(
        num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return (
            num_layers * 2 * page_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        )

    @property
    def page_bytes(self) -> int:
        """Bytes of one page over all layers (K and V; fp8 scales are per cache, not per page)."""
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

    def layers(self) -> list[LayerKV]:
        """Every layer's caches and scales (what the model and the backends read)."""
        s = self.scales
        return [
            LayerKV(*self.layer(i), *((s[i, 0], s[i, 1]) if s is not None else (None, None)))
            for i in range(self.num_layers)
        ]

    def block_shape(self, num_pages: int) -> tuple[int, ...]:
        """The payload shape of a block of ``num_pages`` pages (see the module docstring)."""
        t = num_pages * self.page_size
        if self.scaled:
            return (self.num_layers, 2, self.num_kv_heads, t * self.head_dim + SCALE_BYTES)
        return (self.num_layers, 2, t, self.num_kv_heads, self.head_dim)

    def block_bytes(self, num_pages: int) -> int:
        return math.prod(self.block_shape(num_pages)) * self.data.element_size()

    def check_block(self, page_ids: Sequence[int], buf: torch.Tensor) -> None:
        """Raise ValueError / IndexError unless ``buf`` is a block buffer for ``page_ids`` (for
        fp8: carrying this cache's scales)."""
        if not page_ids:
            raise ValueError("page_ids must not be empty")
        if tuple(buf.shape) != self.block_shape(len(page_ids)):
            raise ValueError(f"buffer shape {tuple(buf.shape)} != {self.block_shape(len(page_ids))}")
        if min(page_ids) < 0 or max(page_ids) >= self.num_pages:
            raise IndexError(f"page ids {list(page_ids)} out of range [0, {self.num_pages})")
        if self.scaled and not torch.equal(self._block_scales(buf), self._scales_on(buf.device)):
            raise ValueError("the block's fp8 scales differ from this KV cache's")

    def _block_scales(self, buf: torch.Tensor) -> torch.Tensor:
        return buf.view(torch.uint8)[..., -SCALE_BYTES:]

    def _scales_on(self, device: torch.device) -> torch.Tensor:
        b = self._scale_bytes.get(device)
        if b is None:
            b = self._scale_bytes[device] = self._scale_bytes[torch.device("cpu")].to(device)
        return b

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
        """Copy pages ``page_ids`` (in order) into one contiguous :meth:`block_shape` buffer
        (``out`` if given: same dtype, any device-compatible contiguous tensor of that shape)
        and return it."""
        idx = self._index(page_ids)
        n = len(page_ids)
        shape = self.block_shape(n)
        if out is not None and (tuple(out.shape) != shape or not out.is_contiguous()):
            raise ValueError(f"out must be contiguous with shape {shape}, got {tuple(out.shape)}")
        src = self.data.index_select(2, idx)  # [L, 2, n, ps, H, D]
        if not self.scaled:
            if out is None:
                return src.reshape(shape)
            out.view(src.shape).copy_(src)
            return out
        if out is None:
            out = torch.empty(shape, dtype=self.dtype, device=self.data.device)
        ob, td = out.view(torch.uint8), n * self.page_size * self.head_dim
        heads = ob[..., :td].view(self.num_layers, 2, self.num_kv_heads, n, self.page_size, self.head_dim)
        heads.copy_(src.view(torch.uint8).permute(0, 1, 4, 2, 3, 5))
        ob[..., td:].copy_(self._scales_on(out.device))
        return out

    def scatter_block(
        self, page_ids: Sequence[int] | torch.Tensor, buf: torch.Tensor, non_blocking: bool = False
    ) -> None:
        """Copy a :meth:`block_shape` buffer into pages ``page_ids`` (inverse of
        :meth:`gather_block`): :meth:`check_block`, then :meth:`scatter_layers` over every layer."""
        if not isinstance(page_ids, torch.Tensor):
            self.check_block(page_ids, buf)
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
        tensor from :meth:`device_index`. An fp8 block's scales are checked by
        :meth:`check_block` (the caller's, before any copy), not here."""
        idx = self._index(page_ids)
        n = len(page_ids)
        if tuple(buf.shape) != self.block_shape(n):
            raise ValueError(f"buffer shape {tuple(buf.shape)} != {self.block_shape(n)}")
        if layers.step != 1 or not 0 <= layers.start < layers.stop <= self.num_layers:
            raise IndexError(f"layers {layers} not a non-empty range within [0, {self.num_layers})")
        a, b = layers.start, layers.stop
        src = buf[a:b].to(device=self.data.device, dtype=self.dtype, non_blocking=non_blocking)
        self._scatter_pages(a, b, idx, src[None])

    def scatter_staged(self, layers: range, idx: torch.Tensor, staging: torch.Tensor) -> None:
        """Copy layers ``layers`` of ``nb`` blocks already on the cache's device, ``staging
        [nb, len(layers), ...]`` (each a :meth:`block_shape` slice), into pages ``idx [nb,
        n]`` with one scatter (the transfer's staged path)."""
        self._scatter_pages(layers.start, layers.stop, idx, staging)

    def _scatter_pages(self, a: int, b: int, idx: torch.Tensor, src: torch.Tensor) -> None:
        """``src [nb, b - a, ...]``: layer slices of ``nb`` blocks on the device; ``idx``:
        their page ids (``[n]`` for one block, ``[nb, n]``)."""
        nb = src.shape[0]
        idx = idx.view(nb, -1)
        n = idx.shape[1]
        ps, h, d = self.page_size, self.num_kv_heads, self.head_dim
        if self.scaled:  # [nb, l, 2, H, n*ps*D + 4] bytes -> [l, 2, nb, n, ps, H, D]
            u = src.view(torch.uint8)[..., : n * ps * d].reshape(nb, b - a, 2, h, n, ps, d)
            self.data.view(torch.uint8)[a:b][:, :, idx] = u.permute(1, 2, 0, 4, 5, 3, 6)
            return
        self.data[a:b][:, :, idx] = src.reshape(nb, b - a, 2, n, ps, h, d).permute(1, 2, 0, 3, 4, 5, 6)
