"""The load path: a hit is a few large reads (one per batch of up to 128 MiB, not one per 8 blocks),
into staging slots allocated at start; on CPU each batch is copied into its pages on the
loader's copy thread, and a load cancelled while a copy runs returns only once that copy has
ended, its slot given back after it. Real engines, a real daemon, a real local store."""

from __future__ import annotations

import asyncio
import re
import threading

import aiohttp
from connutil import assert_loads, open_engine, random_prompt, run

from engine.kv_connector import ConnectorRequest


async def _gets(daemon) -> float:
    """The daemon's count of GET requests answered (its /metrics)."""
    async with aiohttp.ClientSession() as s, s.get(f"{daemon.admin}/metrics") as r:
        text = await r.text()
    m = re.search(r'^tierkv_ops_total{op="GET",result="ok"} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


async def test_a_remote_hit_is_one_get_into_slots_allocated_at_start(stored_prompt):
    """The 24 blocks loaded (of a tiny model) fit one batch: one GET request reaches the daemon
    (with the former 8 blocks per GET it was 3), the KV is the cold run's bit for bit, and the load took
    no staging buffer beyond those allocated at start."""
    s = await stored_prompt(400, 5)
    async with open_engine(s.model_dir, s.url) as b:
        await b.start()
        before = await _gets(s.daemon)
        await assert_loads(b, s.prompt, s.ref, s.kv, 384)
        assert await _gets(s.daemon) - before == 1
        assert b.connector.loader.staging.fresh == 0


async def test_many_batches_copied_while_read_give_the_cold_output(stored_prompt):
    """Batches of 2 blocks, 2 reads in flight and a third batch in its copy: 13 batches whose
    copies overlap the next reads;
    the hit's tokens and KV are the cold run's, every slot back in the pool afterwards."""
    s = await stored_prompt(420, 6, "&load_batch_blocks=2&load_parallel=2")
    async with open_engine(s.model_dir, s.url) as b:
        await assert_loads(b, s.prompt, s.ref, s.kv, 416)
        loader = b.connector.loader
        assert loader.staging.idle == b.connector.cfg.load_parallel + 1
        assert (
            b.connector.metrics.value("tierkv_connector_bytes_loaded_total") == 26 * b.connector.block_bytes
        )


async def test_a_load_cancelled_during_its_copy_waits_for_the_copy(tiny_model, tmp_path):
    """The copy thread is held busy; a load's read finishes and its copy queues behind; the load
    is cancelled. It does not return while its copy may still write the pages, and its slot
    stays lent; once the copy ran, the cancellation goes through and the slot is back."""
    d = tiny_model()
    url = f"local://{tmp_path}/store?lookup_deadline_s=5&policy=always"
    prompt = random_prompt(160, 7)
    async with open_engine(d, url) as a:
        await run(a, prompt)
        assert await a.connector.flush()
        conn, eng = a.connector, a.engine
        loader = conn.loader
        idle = loader.staging.idle
        pages = eng.bm.take([], 10)
        held = threading.Event()
        loader._copier.submit(held.wait, 30)  # the copy thread is busy until released
        req = ConnectorRequest("cancelled", tuple(prompt), tuple(pages), 0)
        task = asyncio.ensure_future(conn.load(req, pages))
        while conn.metrics.value("tierkv_connector_bytes_loaded_total") == 0:
            await asyncio.sleep(0.001)  # the read is done, its copy queued
        task.cancel()
        await asyncio.sleep(0.1)
        assert not task.done()
        assert loader.staging.idle == idle - 1
        held.set()
        try:
            await asyncio.wait_for(task, 10)
            raise AssertionError("the load was not cancelled")
        except asyncio.CancelledError:
            pass
        await asyncio.sleep(0.01)
        assert loader.staging.idle == idle
        eng.bm.release(pages)
