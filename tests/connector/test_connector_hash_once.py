"""A prompt's chain is hashed once per request and namespace: the engine hashes it when the
request is added; the connector's lookup takes the engine's keys when they are its namespace's,
and load and save take the lookup's. Every key derivation (``Namespace.key_batch``,
``block_keys``, ``next_key``) is counted through real engines and a real daemon."""

from __future__ import annotations

import pytest
from connutil import open_engine, random_prompt, reference, run

from kvstore.keys import Namespace


@pytest.fixture
def hashes(monkeypatch):
    """Every key derivation from now on, as (what, namespace id, tokens hashed)."""
    calls: list[tuple[str, object, int]] = []
    real_batch, real_next = Namespace.key_batch, Namespace.next_key

    def key_batch(self, tokens, start_parent=None):
        calls.append(("key_batch", self.id, len(tokens)))
        return real_batch(self, tokens, start_parent)

    def next_key(self, parent, block):
        calls.append(("next_key", self.id, len(block)))
        return real_next(self, parent, block)

    monkeypatch.setattr(Namespace, "key_batch", key_batch)
    monkeypatch.setattr(Namespace, "next_key", next_key)
    return calls


@pytest.mark.parametrize("block_tokens", [16, 32])
async def test_one_hash_per_request_and_namespace_through_lookup_load_and_save(
    tiny_model, start_daemon, hashes, block_tokens
):
    """Blocks of one page (16 tokens, the connector's namespace is the prefix cache's): one
    hash per request. Blocks of two pages (another namespace): one by the engine, one by the
    connector's lookup -- none at load or save. A cold request (lookup miss, save) and a hit
    (lookup, load, save of blocks known stored) on a second engine over the same daemon;
    150 + 8 tokens fill no new page, so nothing past the prompt is hashed."""
    d = tiny_model()
    prompt = random_prompt(150, 31)
    ref = reference(d, prompt)
    node = start_daemon()
    url = f"kvstore://{node.addr}?lookup_deadline_s=5&policy=always&block_tokens={block_tokens}"
    async with open_engine(d, url) as a, open_engine(d, url) as b:
        await a.start()
        await b.start()  # warm-ups hash their own prompts: before counting
        engine_ns, store_ns = a.engine.bm.namespace.id, a.connector.ns.id
        assert (engine_ns == store_ns) == (block_tokens == 16)
        once = [("key_batch", engine_ns, 150)] + (
            [] if block_tokens == 16 else [("key_batch", store_ns, 150)]
        )
        hashes.clear()
        assert (await run(a, prompt))[0] == ref
        assert await a.connector.flush()
        assert a.connector.metrics.value("tierkv_connector_saved_blocks_total") == 150 // block_tokens
        assert hashes == once
        hashes.clear()
        toks, cached = await run(b, prompt)
        assert toks == ref and cached == 150 // block_tokens * block_tokens
        assert await b.connector.flush()
        assert hashes == once
        a.check_integrity()
        b.check_integrity()


async def test_an_engine_without_a_prefix_cache_leaves_the_one_hash_to_the_connector(
    tiny_model, start_daemon, hashes
):
    d = tiny_model()
    prompt = random_prompt(150, 32)
    ref = reference(d, prompt)
    node = start_daemon()
    url = f"kvstore://{node.addr}?lookup_deadline_s=5&policy=always"
    async with open_engine(d, url, enable_prefix_cache=False) as a:
        await a.start()
        ns = a.connector.ns.id
        for cached in (0, 144):  # cold, then a hit from the store (the engine caches nothing)
            hashes.clear()
            assert await run(a, prompt) == (ref, cached)
            assert await a.connector.flush()
            assert hashes == [("key_batch", ns, 150)]
