"""KVTransfer.scatter_stacked: blocks whose buffers are one stacked tensor land in their pages
exactly as scatter() puts them block by block (one and two pages per block, whole and in layer
groups); a stack of the wrong shape or a page out of range is refused before any copy."""

from __future__ import annotations

import pytest
import torch

from engine.kv_cache import KVCache
from engine.kv_transfer import KVTransfer


@pytest.mark.parametrize("ppb", [1, 2])
@pytest.mark.parametrize("groups", [1, 3])
def test_scatter_stacked_equals_block_by_block(ppb, groups):
    a, b = (KVCache(8, 12, 4, 2, 8, torch.float32, "cpu") for _ in range(2))
    pages = [[9, 2], [0, 5], [11, 7]] if ppb == 2 else [[9], [0], [5], [11]]
    stacked = torch.randn(len(pages), *a.block_shape(ppb))
    KVTransfer(a).scatter([(p, stacked[i]) for i, p in enumerate(pages)], groups)
    t = KVTransfer(b)
    assert t.scatter_stacked(pages, stacked, groups).done()
    assert torch.equal(a.data, b.data)
    assert t.last_groups == groups
    flat = [p for block in pages for p in block]
    assert torch.equal(
        b.gather_block(flat), stacked.permute(1, 2, 0, 3, 4, 5).reshape(b.block_shape(len(flat)))
    )


def test_scatter_stacked_refuses_bad_input_before_copying():
    kv = KVCache(8, 12, 4, 2, 8, torch.float32, "cpu")
    t = KVTransfer(kv)
    with pytest.raises(ValueError, match="stacked shape"):
        t.scatter_stacked([[1], [2]], torch.randn(3, *kv.block_shape(1)))
    with pytest.raises(IndexError, match="out of range"):
        t.scatter_stacked([[1], [12]], torch.randn(2, *kv.block_shape(1)))
    assert not kv.data.any()
