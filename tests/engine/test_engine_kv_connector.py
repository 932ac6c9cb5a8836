"""The connector interface: page <-> block-buffer copies, the registry, and the scheduler
hook (lookup -> pages allocated -> load -> tail prefilled; a failed load is recomputed),
driven through AsyncEngine with the in-process MemoryConnector."""

from __future__ import annotations

import asyncio

import pytest
import torch
from polling import until_async
from prometheus_client import generate_latest
from scraping import Scrape

from engine.async_engine import AsyncEngine
from engine.block_manager import PoolIntegrityError
from engine.config import EngineConfig
from engine.errors import ConnectorError
from engine.kv_cache import KVCache
from engine.kv_connector import ConnectorContext, ConnectorRegistry, MemoryConnector
from engine.llm import LLMEngine
from engine.sequence import SamplingParams
from engine.server import Metrics

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def test_engine_gather_scatter_block_layout():
    kv = KVCache(3, 10, 4, 2, 8, torch.float32, "cpu")
    kv.data.copy_(torch.randn_like(kv.data))
    pages = [7, 2, 5]
    buf = kv.gather_block(pages)
    assert buf.shape == (3, 2, 12, 2, 8) and buf.is_contiguous()
    for t in range(12):
        assert torch.equal(buf[1, 1, t], kv.data[1, 1, pages[t // 4], t % 4])
    out = torch.empty_like(buf)
    assert kv.gather_block(pages, out=out) is out and torch.equal(out, buf)
    kv2 = KVCache(3, 10, 4, 2, 8, torch.float32, "cpu")
    kv2.scatter_block([0, 9, 1], buf)
    assert torch.equal(kv2.gather_block([0, 9, 1]), buf)
    assert kv2.data[:, :, [2, 3, 4, 5, 6, 7, 8]].abs().sum() == 0  # nothing else written
    with pytest.raises(ValueError):
        kv2.scatter_block([0, 1], buf)
    with pytest.raises(IndexError):
        kv.gather_block([10])


def test_engine_registry(tiny_model_dir):
    eng = LLMEngine(tiny_model_dir("llama-tiny"), EngineConfig(num_pages=16))
    ctx = ConnectorContext(16, eng.kv, eng.namespace, eng.model_dir, "cpu", eng.transfer)
    reg = ConnectorRegistry()
    assert reg.create("none", ctx) is None
    with pytest.raises(ConnectorError, match="unknown scheme 'bogus'"):
        reg.create("bogus://x", ctx)
    c = reg.create("memory://?block_tokens=32&fail_after=2", ctx)
    assert isinstance(c, MemoryConnector) and c.block_tokens == 32 and c.fail_after == 2
    with pytest.raises(ConnectorError, match="multiple"):
        reg.create("memory://?block_tokens=24", ctx)
    reg.register("mine", "engine.kv_connector:_memory_factory")
    assert isinstance(reg.create("mine://", ctx), MemoryConnector)
    ns = eng.namespace(32)
    assert ns.block_tokens == 32 and ns.kv_dtype == "float32"


async def run(aeng: AsyncEngine, prompt: list[int], params=GREEDY) -> tuple[list[int], int, str]:
    toks, cached, text = [], 0, ""
    async for out in aeng.generate(prompt, params):
        toks.append(out.token_id)
        cached = out.cached_tokens
        text += out.text
    return toks, cached, text


def reference(d: str, prompt: list[int]) -> list[int]:
    eng = LLMEngine(d, EngineConfig(num_pages=64, enable_prefix_cache=False))
    return eng.generate([prompt], GREEDY)[0].output_tokens


@pytest.mark.parametrize(
    "url,expect_cached", [("memory://?block_tokens=32", 96), ("memory://?block_tokens=16&fail_after=2", 32)]
)
async def test_engine_connector_hit_equals_no_hit(tiny_model_dir, url, expect_cached):
    d = tiny_model_dir("llama-gqa4")
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(6, 262, (100,), generator=g).tolist()
    ref = reference(d, prompt)
    # No local prefix cache, so every hit must come through the connector.
    aeng = AsyncEngine.from_model(
        d, EngineConfig(num_pages=64, enable_prefix_cache=False, max_num_batched_tokens=40), url
    )
    try:
        first, cached0, _ = await run(aeng, prompt)
        assert first == ref and cached0 == 0
        assert aeng.connector.prefill_tokens >= 40 and aeng.connector.prefill_seconds > 0
        await asyncio.sleep(0.05)  # let the background save finish
        aeng.check_integrity()
        assert aeng.connector.saved_blocks == 96 // aeng.connector.block_tokens
        second, cached, _ = await run(aeng, prompt)
        assert second == ref
        assert cached == expect_cached
        assert aeng.connector.loaded_blocks == expect_cached // aeng.connector.block_tokens
        # concurrent requests with the same prefix and different tails
        tails = [prompt + [7, 8, 9], prompt[:64] + [10] * 20]
        res = await asyncio.gather(*(run(aeng, p) for p in tails))
        assert [r[0] for r in res] == [reference(d, p) for p in tails]
        await asyncio.sleep(0.05)
        aeng.check_integrity()
    finally:
        await aeng.stop()


class _Broken(MemoryConnector):
    async def lookup(self, token_ids):
        return 64  # claims a hit it cannot deliver

    async def load(self, request, page_ids):
        raise OSError("store went away")

    async def save(self, request, page_ids):
        raise OSError("store went away")


class _NoLookup(MemoryConnector):
    async def lookup(self, token_ids):
        raise OSError("store went away")


@pytest.mark.parametrize(
    "connector, want",
    [(_Broken, {"lookup": 0, "load": 1, "save": 1}), (_NoLookup, {"lookup": 1, "load": 0, "save": 0})],
)
async def test_engine_connector_errors_become_recompute_and_are_counted(tiny_model_dir, connector, want):
    """A load or save that raises, or a lookup that does: the output is exact (the tokens are
    recomputed, a lookup that failed is a miss) and /metrics counts each failed call."""
    d = tiny_model_dir("llama-tiny")
    prompt = list(range(10, 90))
    eng = LLMEngine(d, EngineConfig(num_pages=32, enable_prefix_cache=False))
    ctx = ConnectorContext(16, eng.kv, eng.namespace, eng.model_dir, "cpu", eng.transfer)
    aeng = AsyncEngine(eng, connector(ctx))
    metrics = Metrics(aeng)
    try:
        toks, cached, _ = await run(aeng, prompt)
        assert toks == reference(d, prompt) and cached == 0
        # the save runs on after the request's last token: await its count
        await until_async(lambda: connector_failures(metrics), 30, f"failures {want}", lambda f: f == want)
        aeng.check_integrity()
    finally:
        await aeng.stop()


def connector_failures(metrics: Metrics) -> dict[str, float]:
    """``tierkv_engine_connector_failures_total`` by call, as the engine's /metrics shows it."""
    m = Scrape(generate_latest(metrics.registry).decode())
    return m.by("tierkv_engine_connector_failures_total", "call")


async def test_engine_no_connector_is_unchanged(tiny_model_dir):
    d = tiny_model_dir("llama-tiny")
    prompt = list(range(20, 60))
    aeng = AsyncEngine.from_model(d, EngineConfig(num_pages=32), "none")
    try:
        assert aeng.connector is None
        toks, cached, text = await run(aeng, prompt)
        assert toks == reference(d, prompt) and cached == 0
        toks2, cached2, _ = await run(aeng, prompt)
        assert toks2 == toks and cached2 == 32  # the engine's own prefix cache
        await aeng.verify()
        aeng.engine.bm.refcount[0] += 1  # corrupt it: verify must notice
        with pytest.raises(PoolIntegrityError):
            await aeng.verify()
        aeng.engine.bm.refcount[0] -= 1
    finally:
        await aeng.stop()


async def test_engine_abort_releases_pages(tiny_model_dir):
    d = tiny_model_dir("llama-tiny")
    aeng = AsyncEngine.from_model(d, EngineConfig(num_pages=32), "none")
    try:
        gen = aeng.generate(
            list(range(10, 50)), SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        )
        async for _ in gen:
            break
        await gen.aclose()
        await until_async(lambda: aeng.engine.has_work(), 10.0, "the engine idle", ok=lambda busy: not busy)
        aeng.check_integrity()
        assert aeng.engine.bm.num_used == 0
    finally:
        await aeng.stop()


async def test_engine_saves_even_when_the_request_ends_at_prefill(tiny_model_dir):
    d = tiny_model_dir("llama-tiny")
    aeng = AsyncEngine.from_model(
        d, EngineConfig(num_pages=32, enable_prefix_cache=False), "memory://?block_tokens=32"
    )
    try:
        prompt = list(range(10, 80))  # 2 whole blocks of 32
        await run(aeng, prompt, SamplingParams(max_tokens=1, temperature=0))
        await until_async(
            lambda: (aeng.connector.saved_blocks, bool(aeng._held)),
            10.0,
            "2 blocks saved and no pages held",
            ok=lambda got: got == (2, False),
        )
        aeng.check_integrity()
        assert aeng.engine.bm.num_used == 0  # the save's references are gone
        _, cached, _ = await run(aeng, prompt, SamplingParams(max_tokens=1, temperature=0))
        assert cached == 64
    finally:
        await aeng.stop()


async def test_engine_skips_the_lookup_when_its_own_cache_holds_every_block(tiny_model_dir):
    # issue 11 item 2: an HBM hit paid a connector round trip for blocks it already holds
    d = tiny_model_dir("llama-tiny")
    g = torch.Generator().manual_seed(9)
    prompt = torch.randint(6, 250, (100,), generator=g).tolist()
    aeng = AsyncEngine.from_model(d, EngineConfig(num_pages=64), "memory://?block_tokens=32")
    try:
        first, _, _ = await run(aeng, prompt)
        assert aeng.connector.lookups == 1
        again, cached, _ = await run(aeng, prompt)
        assert again == first and cached == 96
        assert aeng.connector.lookups == 1, "the engine's own cache covered every full block"
        await run(aeng, prompt + list(range(30, 70)))  # a block past the cache
        assert aeng.connector.lookups == 2
    finally:
        await aeng.stop()
