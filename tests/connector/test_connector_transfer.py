"""The copy path loads and saves go through (engine/kv_transfer.py): whole-block and layer-wise
copies put the same bytes in the same pages, a bad block list copies nothing, and a hit
loaded either way is bitwise the KV computed cold — on CPU always, on CUDA (copy stream,
per-layer events the compute stream waits on) where a device exists."""

from __future__ import annotations

import asyncio

import pytest
import torch
from connutil import assert_loads, open_engine, prompt_kv, random_prompt, run, sharing_store

from engine import kv_transfer
from engine.kv_cache import KVCache
from engine.kv_connector import ConnectorRequest
from engine.kv_transfer import KVTransfer

HAS_CUDA = torch.cuda.is_available()
DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")]
    ),
]


def _kv(device: str) -> KVCache:
    return KVCache(
        num_layers=3,
        num_pages=12,
        page_size=4,
        num_kv_heads=2,
        head_dim=8,
        dtype=torch.float32,
        device=device,
    )


@pytest.mark.parametrize("device", DEVICES)
def test_layer_group_and_whole_block_copies_agree(device, monkeypatch):
    g = torch.Generator().manual_seed(0)
    blocks = [([7, 2], torch.randn(_kv("cpu").block_shape(2), generator=g)) for _ in range(2)]
    blocks[1] = ([0, 11], blocks[1][1])
    if device == "cuda":
        blocks = [(p, b.pin_memory()) for p, b in blocks]
    results = []
    cases = [(g, staged) for g in (1, 2, 3, 9) for staged in (False, True, "tiny")]  # 9: capped at 3
    for groups, staged in cases:
        # "tiny": a staging buffer holds one block only, so each block is its own chunk
        monkeypatch.setattr(kv_transfer, "STAGING_BYTES", 1 if staged == "tiny" else 256 << 20)
        staged = bool(staged)
        kv = _kv(device)
        t = KVTransfer(kv)
        pending = t.scatter(blocks, groups, staged=staged)
        if device == "cuda":
            # the next step's barrier: the compute stream waits for every layer of an unfinished
            # load (synchronizing that stream alone, not the device, then finishes the load)
            barrier = t.step_barrier()
            assert barrier is not None or pending.done(), "an unfinished load is not in the barrier"
            for layer in range(kv.num_layers) if barrier is not None else ():
                barrier(layer)
            torch.cuda.current_stream().synchronize()
        assert pending.done()
        for pages, buf in blocks:  # each block reads back exactly, through the save path too
            assert torch.equal(t.gather(pages).cpu(), buf)
        results.append(kv.data.cpu())
    assert len(results) == len(cases) and all(torch.equal(results[0], r) for r in results[1:])
    untouched = [p for p in range(12) if p not in (7, 2, 0, 11)]
    assert not results[0][:, :, untouched].any()


def test_bad_block_list_copies_nothing():
    kv = _kv("cpu")
    t = KVTransfer(kv)
    good = ([1, 2], torch.ones(kv.block_shape(2)))
    for bad, err in [(([3], torch.ones(kv.block_shape(2))), ValueError), (([3, 12], good[1]), IndexError)]:
        with pytest.raises(err):
            t.scatter([good, bad], groups=3)
        assert not kv.data.any(), "the good block before a bad one must not have been copied"
    assert t.step_barrier() is None  # CPU: nothing is ever pending


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layer_groups", [1, 2])
async def test_store_hit_is_exact_either_way(tiny_model, tmp_path, device, layer_groups):
    d = tiny_model()
    prompt = random_prompt(150, 5)  # 9 blocks of 16 + 6
    url = f"local://{tmp_path}/store?lookup_deadline_s=5&policy=always&layer_groups={layer_groups}&load_batch_blocks=4"
    async with open_engine(d, url, device=device) as a:
        cold, cached = await run(a, prompt)
        assert cached == 0
        cold_kv = prompt_kv(a, prompt, 144)
        assert await a.connector.flush()
        async with sharing_store(d, url, a, device=device) as b:
            assert b.connector.layer_groups == layer_groups
            assert b.engine.transfer.cuda is (device == "cuda")
            await assert_loads(b, prompt, cold, cold_kv, 144)
            b.check_integrity()


async def test_flush_waits_for_saves_still_copying(tiny_model, tmp_path):
    """flush() right after a save began (its blocks not all queued yet: a one-block queue makes
    it wait for room after each) returns only once every block of it is stored."""
    d = tiny_model()
    url = f"local://{tmp_path}/store?lookup_deadline_s=5&policy=always&save_queue_bytes=1"
    async with open_engine(d, url, num_pages=128) as a:
        eng = a.engine
        prompt = random_prompt(40 * 16, 9)
        eng.generate([prompt], eng_params())  # computes the pages; the prefix cache keeps them
        pages = eng.bm.match_prefix(prompt, 40)
        assert len(pages) == 40
        req = ConnectorRequest("r", tuple(prompt), tuple(pages), 0)
        saving = asyncio.ensure_future(a.connector.save(req, pages))
        await asyncio.sleep(0)  # the save has begun and queued its first blocks only
        assert await a.connector.flush(30)
        assert saving.done()
        assert await a.connector.lookup(prompt) == 40 * 16


def eng_params():
    from engine.sequence import SamplingParams

    return SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("layer_groups", [1, 3])
async def test_daemon_hit_is_exact_in_layer_groups(stored_prompt, layer_groups):
    # issue 11 item 5: kvstore:// loads copy in layer groups too, not only local:// ones
    s = await stored_prompt(150, 6, f"&layer_groups={layer_groups}&load_batch_blocks=4")  # 9 blocks of 16 + 6
    async with open_engine(s.model_dir, s.url) as b:
        await assert_loads(b, s.prompt, s.ref, s.kv, 144)
        groups = b.engine.transfer.scatter_groups
        assert groups[min(layer_groups, b.engine.kv.num_layers)] == 3  # 3 GET batches of <= 4 blocks
        assert sum(groups.values()) == 3
        b.check_integrity()
