"""The lookup's record travels with the request: the connector hashes a prompt's chain once,
at lookup; the engine keeps the record on the sequence and hands it back to load and save,
which take their keys and tiers from it. Real engine, real in-process store."""

from __future__ import annotations

import torch
from connutil import open_engine, prompt_kv, random_prompt, reference, run

from connector.prompt_lookup import PromptLookup
from engine.kv_connector import ConnectorLookup, ConnectorRequest


async def test_load_and_save_use_the_lookups_keys_and_tiers(tiny_model, tmp_path):
    d = tiny_model()
    prompt, other = random_prompt(150, 21), random_prompt(150, 22)  # 9 full blocks of 16 each
    ref = reference(d, prompt)
    async with open_engine(d, f"local://{tmp_path}/store?lookup_deadline_s=5&policy=always") as a:
        toks, _ = await run(a, prompt)
        assert toks == ref
        cold_kv = prompt_kv(a, prompt, 144)
        assert await a.connector.flush()
        conn = a.connector
        found = await conn.lookup_result(prompt)
        assert isinstance(found, ConnectorLookup) and found.hit_tokens == 144
        rec = found.found
        assert isinstance(rec, PromptLookup)
        assert rec.keys == conn.ns.key_batch(prompt) and len(rec.keys) == 9
        assert rec.tiers == ("dram",) * 9 and rec.namespace == conn.ns.id.raw
        assert await conn.lookup(prompt) == 144  # the int form still answers

        pages = list(range(9))  # free pages of the engine's pool (no request runs now)

        async def load(lookup) -> int:
            return await conn.load(ConnectorRequest("r", tuple(prompt), tuple(pages), 0, lookup), pages)

        # the record's keys are what load fetches: another prompt's keys load nothing
        # (verified against this prompt's tokens: never its blocks), its own load all 9
        foreign = PromptLookup(rec.namespace, conn.ns.key_batch(other), rec.tiers)
        assert await load(foreign) == 0
        assert await load(rec) == 144
        assert torch.equal(a.engine.kv.gather_block(pages), cold_kv), "loaded KV must be bitwise equal"
        # no record, or one hashed under another namespace: load hashes the prompt itself
        assert await load(None) == 144
        assert await load(PromptLookup(b"\x07" * 16, conn.ns.key_batch(other))) == 144

        # save: the record's keys, extended by hashing only the blocks past them
        short = PromptLookup(rec.namespace, rec.keys[:3])
        req = ConnectorRequest("r", tuple(prompt), tuple(pages), 0, short)
        assert conn.keys_for(req, 9) == conn.ns.key_batch(prompt[:144])
        assert conn.keys_for(req, 2) == rec.keys[:2]
        a.check_integrity()


async def test_the_engine_hands_the_record_back_for_a_hit(tiny_model, start_daemon):
    """Through the engine, against a daemon: the second request for the prompt is served from
    the store with the record its lookup made. The hit is counted under the record's tier
    ("remote:dram": the lookup's name for a daemon's DRAM; a load without the record knows
    only the block's own "dram"), and its output equals the cold run's."""
    d = tiny_model()
    prompt = random_prompt(150, 23)
    ref = reference(d, prompt)
    node = start_daemon()
    url = f"kvstore://{node.addr}?lookup_deadline_s=5&policy=always"
    async with open_engine(d, url, enable_prefix_cache=False) as a:  # every hit must come from the store
        assert (await run(a, prompt))[0] == ref
        assert await a.connector.flush()
        toks, cached = await run(a, prompt)
        assert toks == ref and cached == 144
        metric = a.connector.metrics.value
        assert metric("tierkv_connector_hit_tokens_total", tier="remote:dram") == 144
        assert metric("tierkv_connector_hit_tokens_total", tier="dram") == 0
        a.check_integrity()
