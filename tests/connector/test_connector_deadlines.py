"""The engine honours the connector's deadlines, and a fresh engine's first request pays no
set-up (issue 11): a real daemon behind a real slow link (tests/connector/slowlink.py)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest
import torch
from connutil import Stored, make_engine, open_engine, prompt_kv, random_prompt, run

from engine.async_engine import AsyncEngine
from engine.errors import ConfigError
from tests.connector.slowlink import SlowLink


@contextlib.asynccontextmanager
async def _hit_through(
    s: Stored, query: str, delay_s: float, rate_bps: float = 0.0, **kw
) -> AsyncIterator[AsyncEngine]:
    """An engine (``make_engine``'s, with ``kw``) whose connector, with the options in
    ``query``, reaches ``s``'s daemon through a :class:`SlowLink` of ``delay_s`` and
    ``rate_bps``: stopped, then the link closed, however the block ends."""
    link = SlowLink(s.daemon.addr, delay_s=delay_s, rate_bps=rate_bps)
    try:
        async with open_engine(s.model_dir, f"kvstore://{link.addr}?{query}", **kw) as b:
            yield b
    finally:
        link.close()


async def test_a_lookup_slower_than_half_a_second_hits_under_a_2s_deadline(stored_prompt):
    # issue 11: the engine cut every lookup at a fixed 0.5 s, whatever lookup_deadline_s said
    s = await stored_prompt(150, 11)
    query = "lookup_deadline_s=2&load_deadline_s=20&policy=always"
    async with _hit_through(s, query, 0.8, enable_prefix_cache=False) as b:  # round trips >= 0.8 s
        assert await run(b, s.prompt) == (s.ref, 144)
        assert (
            b.connector.metrics.value("tierkv_connector_recompute_fallbacks_total", cause="lookup_timeout")
            == 0
        )


async def test_the_first_request_after_start_pays_no_connection_setup(stored_prompt):
    # A fresh connection costs one round trip (HELLO) before its first EXISTS: with a 1 s link
    # a lookup that opens its connection needs >= 2 s, one on a connection opened at start
    # 1 s. The 1.9 s deadline leaves no room for set-up on the request path.
    s = await stored_prompt(150, 12)
    query = "lookup_deadline_s=1.9&load_deadline_s=20&policy=always"
    async with _hit_through(s, query, 1.0, enable_prefix_cache=False) as b:
        await b.start()
        assert await run(b, s.prompt) == (s.ref, 144)


async def test_local_store_is_opened_at_start(tiny_model, tmp_path):
    async with open_engine(tiny_model(), f"local://{tmp_path}/s") as a:
        assert a.connector.backend.node is None
        await a.start()
        assert a.connector.backend.node is not None  # not on the first request's lookup


def test_an_engine_cap_below_the_connectors_deadline_is_refused(tiny_model, tmp_path):
    a = make_engine(tiny_model(), f"local://{tmp_path}/s?lookup_deadline_s=2")
    with pytest.raises(ConfigError, match="lookup_timeout_s 0.5 is below"):
        AsyncEngine(a.engine, a.connector, lookup_timeout_s=0.5)
    assert AsyncEngine(a.engine, a.connector).lookup_timeout_s >= 2


async def test_saves_that_outlive_an_internal_timeout_are_reported_not_silent(tiny_model, start_daemon):
    # issue 11: saves through a slow link hit a timeout shorter than save_deadline_s inside the
    # client (node marked down), and flush() still said True. Whatever the client does with a
    # 1.2 s round trip, flush() must account for every block and claim none it did not store.
    d = tiny_model()
    node = start_daemon()
    prompt = random_prompt(150, 13)  # 9 full blocks
    link = SlowLink(node.addr, delay_s=1.2)
    try:
        async with open_engine(
            d, f"kvstore://{link.addr}?save_deadline_s=20&lookup_deadline_s=5&load_deadline_s=20"
        ) as a:
            await run(a, prompt)
            res = await a.connector.flush(60)
    finally:
        link.close()
    assert res.complete, res
    assert res.saved + res.dropped + res.failed == 9, res
    assert bool(res) == (res.saved == 9)
    async with open_engine(d, f"kvstore://{node.addr}?lookup_deadline_s=5") as direct:
        await direct.start()
        keys = direct.connector.ns.block_keys(prompt)
        present = (await direct.connector.backend.lookup(keys, 5)).names()
        # never claims a block it did not store (a write whose reply came after the client's
        # own write deadline may have landed although it is reported failed: conservative)
        assert sum(t is not None for t in present) >= res.saved, (present, res)


async def test_a_link_too_slow_for_one_whole_batch_loads_a_prefix(stored_prompt):
    # The 24 blocks (8 KiB each) all fit one 128 MiB batch; a 48 KiB/s link moves them in about
    # 4 s, twice the 2 s deadline of a read, so one read of all of them times out and the load
    # got nothing. Batches sized to end within half the deadline (from the floor, then from
    # what the link was measured to move) load a prefix: the tokens and KV are the cold run's.
    s = await stored_prompt(400, 14)
    query = "lookup_deadline_s=5&load_deadline_s=2&load_floor_bandwidth=16KiB&policy=always"
    async with _hit_through(s, query, 0.0, rate_bps=48 << 10) as b:
        await b.start()
        toks, cached = await run(b, s.prompt)
        assert toks == s.ref
        assert cached > 0 and cached % 16 == 0, cached
        # the loaded blocks are the stored ones bit for bit ([layers, K/V, tokens, heads, dim])
        assert torch.equal(prompt_kv(b, s.prompt, cached), s.kv[:, :, :cached])
