"""A load whose batch fails after its read (the copy cannot start, a block cannot be viewed)
gives the read and its staging slot back: the store holds no lease afterwards, the pool has
its up-front slots idle, and the failure is a miss with a counter (its blocks not counted as
hits), never an exception. Real
engines and a real in-process store."""

from __future__ import annotations

import asyncio
import contextlib

from connutil import open_engine, random_prompt, run

from engine.kv_connector import ConnectorRequest


@contextlib.asynccontextmanager
async def _stored(d, tmp_path, seed: int, extra: str = ""):
    """An engine on an in-process store (batches of 2 blocks, ``extra`` more URL options)
    that has run and flushed a 160-token prompt (10 full blocks): (engine, prompt)."""
    url = f"local://{tmp_path}/store?lookup_deadline_s=5&policy=always&load_batch_blocks=2{extra}"
    prompt = random_prompt(160, seed)
    async with open_engine(d, url) as a:
        await run(a, prompt)
        assert await a.connector.flush()
        yield a, prompt


async def test_a_load_whose_copy_cannot_start_gives_its_slot_and_leases_back(tiny_model, tmp_path):
    """The loader's copy thread is stopped (the loader closed), so the batch's copy raises when
    it is handed on: the load is a miss (counted), no lease on the store's DRAM is left held
    and every up-front staging slot is idle again; the next load takes no fresh slot."""
    async with _stored(tiny_model(), tmp_path, 21) as (a, prompt):  # 5 batches of 2 blocks
        conn, eng = a.connector, a.engine
        loader, node = conn.loader, conn.backend.node
        up_front = conn.cfg.load_parallel + 1
        assert loader.staging.idle == up_front
        await loader.close()  # the copy thread is gone: handing a copy on raises
        for i in range(3):
            pages = eng.bm.take([], 10)
            req = ConnectorRequest(f"r{i}", tuple(prompt), tuple(pages), 0)
            assert await conn.load(req, pages) == 0
            eng.bm.release(pages)
            assert loader.staging.idle == up_front
            assert loader.staging.fresh == 0
            assert len(node.state.leases.leases) == 0
            node.check()
        assert conn.metrics.value("tierkv_connector_recompute_fallbacks_total", cause="error") == 30
        # recomputed, so not counted as loaded either
        assert conn.metrics.value("tierkv_connector_hit_tokens_total", tier="dram") == 0


async def test_a_copy_that_fails_on_the_copy_thread_counts_no_hit_tokens(tiny_model, tmp_path):
    """The batches' copies start on the copy thread and raise there (page ids past the engine's
    KV cache): the load loads nothing, every block is a counted fallback, and no block is
    counted as a hit token (it was recomputed, not loaded); the slots and leases are back."""
    async with _stored(tiny_model(), tmp_path, 22) as (a, prompt):
        conn = a.connector
        node = conn.backend.node
        pages_per_block = conn.loader.pages_per_block
        past_the_cache = 1 << 30
        pages = list(range(past_the_cache, past_the_cache + 10 * pages_per_block))
        req = ConnectorRequest("r-far", tuple(prompt), tuple(pages), 0)
        assert await conn.load(req, pages) == 0
        assert conn.metrics.value("tierkv_connector_recompute_fallbacks_total", cause="error") == 10
        assert conn.metrics.value("tierkv_connector_hit_tokens_total", tier="dram") == 0
        assert conn.loader.staging.idle == conn.cfg.load_parallel + 1
        assert len(node.state.leases.leases) == 0
        node.check()


async def _concurrent_loads(tmp_path, d, extra: str, n_loads: int):
    """``n_loads`` loads of one stored prompt at once; (tokens each loaded, the loader)."""
    async with _stored(d, tmp_path, 23, extra) as (a, prompt):
        conn, eng = a.connector, a.engine
        pages = [eng.bm.take([], 10) for _ in range(n_loads)]
        reqs = [ConnectorRequest(f"c{i}", tuple(prompt), tuple(p), 0) for i, p in enumerate(pages)]
        loaded = await asyncio.gather(*(conn.load(r, p) for r, p in zip(reqs, pages)))
        for p in pages:
            eng.bm.release(p)
        assert conn.loader.staging.lent == 0
        assert len(conn.backend.node.state.leases.leases) == 0
        return loaded, conn.loader


async def test_concurrent_loads_past_the_staging_bound_wait_for_a_slot(tiny_model, tmp_path):
    """Four loads at once each want two staging slots. Unbounded they add slots; with
    ``load_staging_bytes`` below two slots the bound is the two made at start: no slot is
    added, the loads take turns, and every load still loads all of its 160 tokens."""
    d = tiny_model()
    loaded, loader = await _concurrent_loads(tmp_path / "free", d, "", 4)
    assert loaded == [160] * 4
    assert loader.staging.fresh > 0  # the loads did overlap
    loaded, loader = await _concurrent_loads(tmp_path / "bound", d, "&load_staging_bytes=1", 4)
    assert loaded == [160] * 4
    assert loader.staging.most == 2 and loader.staging.fresh == 0
