"""local:// end to end: a second engine (empty HBM cache) loads the prefix from the in-process
store's DRAM, then — after the store restarts — from its disk. The loaded KV is bitwise equal
to the KV computed cold, and the greedy output is identical."""

from __future__ import annotations

import asyncio

from connutil import (
    assert_loads,
    make_engine,
    open_engine,
    prompt_kv,
    random_prompt,
    reference,
    run,
    sharing_store,
)


async def test_dram_then_disk_hits_are_exact(tiny_model, tmp_path):
    d = tiny_model()
    prompt = random_prompt(150, 1)  # 9 full blocks of 16 and a 6-token tail
    ref = reference(d, prompt)
    url = f"local://{tmp_path}/store?lookup_deadline_s=5&policy=always"
    async with open_engine(d, url) as a:  # its stop closes the connector: the node flushes and closes
        assert await run(a, prompt) == (ref, 0)
        cold_kv = prompt_kv(a, prompt, 144)
        assert await a.connector.flush()
        assert a.connector.metrics.value("tierkv_connector_saved_blocks_total") == 9
        # a fresh engine, same store: the hit must come from the store's DRAM
        async with sharing_store(d, url, a) as b:
            await assert_loads(b, prompt, ref, cold_kv, 144)
            assert b.connector.metrics.value("tierkv_connector_hit_tokens_total", tier="dram") == 144
            b.check_integrity()

    # the store restarts (a new node over the same LMDB): blocks come from disk
    async with open_engine(d, url) as c:
        await assert_loads(c, prompt, ref, cold_kv, 144)
        assert c.connector.metrics.value("tierkv_connector_hit_tokens_total", tier="disk") == 144
        c.check_integrity()


async def test_partial_prefix_and_tails(tiny_model, tmp_path):
    """Prompts sharing only part of a cached prefix load only the shared blocks."""
    d = tiny_model()
    base = random_prompt(100, 2)
    url = f"local://{tmp_path}/store?lookup_deadline_s=5&policy=always"
    async with open_engine(d, url, enable_prefix_cache=False) as a:  # every hit must come from the store
        await run(a, base)
        await a.connector.flush()
        for p, want in [
            (base[:40] + random_prompt(30, 3), 32),
            (base + [7, 7, 7], 96),
            (random_prompt(50, 4), 0),
        ]:
            toks, cached = await run(a, p)
            assert toks == reference(d, p)
            assert cached == want
            await a.connector.flush()
        a.check_integrity()


async def test_policy_never_and_bad_url(tiny_model, tmp_path):
    import pytest

    from engine.errors import ConnectorError

    d = tiny_model()
    prompt = random_prompt(64, 5)
    async with open_engine(d, f"local://{tmp_path}/s?policy=never", enable_prefix_cache=False) as a:
        await run(a, prompt)
        await a.connector.flush()
        toks, cached = await run(a, prompt)
        assert cached == 0 and toks == reference(d, prompt)
    for bad, word in [
        ("local://", "missing PATH"),
        (f"local://{tmp_path}?policy=sometimes", "policy"),
        (f"local://{tmp_path}?lookup_deadline_s=0", "lookup_deadline_s"),
        (f"local://{tmp_path}?colour=blue", "unknown option 'colour'"),
        ("kvstore://localhost", "not host:port"),
        ("kvstore://localhost:0", "port 1-65535"),
        (f"local://{tmp_path}?block_tokens=24", "multiple of page size"),
    ]:
        with pytest.raises(ConnectorError, match=word):  # the engine's error, at the seam
            make_engine(d, bad)


async def test_concurrent_requests_share_prefixes(tiny_model, tmp_path):
    d = tiny_model()
    url = f"local://{tmp_path}/store?lookup_deadline_s=5&policy=always"
    shared = random_prompt(64, 6)
    prompts = [shared + random_prompt(5 + 7 * i, 10 + i) for i in range(6)]
    async with open_engine(d, url, enable_prefix_cache=False) as a:
        await run(a, shared)
        await a.connector.flush()
        results = await asyncio.gather(*(run(a, p) for p in prompts))
        for p, (toks, cached) in zip(prompts, results):
            assert toks == reference(d, p)
            assert cached == 64
        a.check_integrity()


async def test_save_waits_for_room_in_a_small_queue(tiny_model, tmp_path):
    """A queue bounded to (less than) one block still stores a long prompt, block by block."""
    d = tiny_model()
    prompt = random_prompt(150, 8)
    async with open_engine(
        d, f"local://{tmp_path}/s?save_queue_bytes=1&policy=always&lookup_deadline_s=5"
    ) as a:
        await run(a, prompt)
        assert await a.connector.flush()
        assert a.connector.metrics.value("tierkv_connector_saved_blocks_total") == 9
        assert a.connector.metrics.value("tierkv_connector_dropped_saves_total", cause="queue_full") == 0
