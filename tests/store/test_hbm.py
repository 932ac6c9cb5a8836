"""The HBM tier: same interface over a GPU slab. Runs only where CUDA exists."""

from __future__ import annotations

import pytest
from storeutil import checked, make_blocks, tiers_of

from kvstore.errors import TierError
from kvstore.node.store import NodeStore
from kvstore.results import Status


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


async def test_hbm_without_cuda_is_a_clear_error(cfg_factory):
    if _cuda():
        pytest.skip("CUDA present: the error path cannot be shown here")
    with pytest.raises(TierError, match="CUDA is not available"):
        await NodeStore.open(cfg_factory(hbm__capacity="4MiB", hbm__slab_size="1MiB"))


@pytest.mark.cuda
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA device (none on this machine)")
async def test_hbm_tier_roundtrip_and_demotion(cfg_factory):
    async with checked(
        await NodeStore.open(cfg_factory(hbm__capacity="2MiB", hbm__slab_size="1MiB"))
    ) as node:
        assert [t.name for t in node.tiers] == ["hbm", "dram", "disk"]
        blocks = make_blocks(12)
        for b in blocks:
            assert (await node.writer.put([b]))[0].status is Status.STORED
        where = tiers_of(node, [h.key for h, _ in blocks])
        assert where[-1] == "hbm" and "dram" in where
        bufs = [bytearray(h.payload_len) for h, _ in blocks]
        got = await node.reader.read([h.key for h, _ in blocks], bufs)
        assert [g.status for g in got] == [Status.HIT] * len(blocks)
        assert all(bytes(b) == p for b, (_, p) in zip(bufs, blocks))
