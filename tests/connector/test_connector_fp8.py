"""fp8 KV through the store: ``local://`` (DRAM, then disk after a restart) and ``kvstore://``
(a real daemon, and a second engine process) hits equal the cold fp8 run token for token with
bitwise-equal pages; a block carries half the bf16 bytes plus its scales (connector metrics,
``kvstore show``); fp8 and model-dtype engines on one store never use each other's blocks."""

from __future__ import annotations

import asyncio
import json
import pathlib
import subprocess
import sys

import torch
from connutil import open_engine, prompt_kv, random_prompt, run, sharing_store

CHILD = pathlib.Path(__file__).with_name("engine_child.py")
FP8 = {"kv_cache_dtype": "fp8_e4m3"}


def _bf16_block_bytes(aeng, block_tokens: int) -> int:
    mc = aeng.engine.model_config
    return mc.num_layers * 2 * block_tokens * mc.num_kv_heads * mc.head_dim * 2


async def test_local_fp8_hits_dram_then_disk_exact(tiny_model, tmp_path):
    d = tiny_model()
    prompt = random_prompt(150, 1)  # 9 blocks of 16 and a tail
    url = f"local://{tmp_path}/store?lookup_deadline_s=5&policy=always"
    async with open_engine(d, url, **FP8) as a:
        cold, cached = await run(a, prompt)
        assert cached == 0
        cold_kv = prompt_kv(a, prompt, 144)
        assert cold_kv.dtype == torch.float8_e4m3fn
        assert await a.connector.flush()
        m = a.connector.metrics
        mc = a.engine.model_config
        block = m.value("tierkv_connector_block_bytes", kv_dtype="float8_e4m3fn")
        assert block == _bf16_block_bytes(a, 16) // 2 + 4 * mc.num_layers * 2 * mc.num_kv_heads
        assert m.value("tierkv_connector_bytes_saved_total") == 9 * block
    # a fresh fp8 engine over the same store after a restart: every block from disk
    async with open_engine(d, url, **FP8) as c:
        toks, cached = await run(c, prompt)
        assert toks == cold and cached == 144
        assert torch.equal(prompt_kv(c, prompt, 144).view(torch.uint8), cold_kv.view(torch.uint8))
        assert c.connector.metrics.value("tierkv_connector_hit_tokens_total", tier="disk") == 144
        # the same store from an engine in the model's own dtype: another namespace, no hit
        async with sharing_store(d, url, c) as b:
            _, cached_b = await run(b, prompt)
            assert cached_b == 0
        c.check_integrity()


async def test_remote_fp8_hit_second_process_and_show(tiny_model, start_daemon, capsys):
    d = tiny_model()
    node = start_daemon()
    url = f"kvstore://{node.addr}?lookup_deadline_s=5&policy=always"
    prompt = random_prompt(150, 2)
    async with open_engine(d, url, **FP8, enable_prefix_cache=False) as a:
        cold, cached = await run(a, prompt)
        assert cached == 0
        assert await a.connector.flush()
        keys = a.connector.ns.block_keys(prompt)
        ns_id = a.connector.ns.id.hex
        block = int(a.connector.metrics.value("tierkv_connector_block_bytes", kv_dtype="float8_e4m3fn"))
        bf16 = _bf16_block_bytes(a, 16)
    # a fresh in-process engine: bitwise pages, same tokens
    async with open_engine(d, url, **FP8) as b:
        toks, cached = await run(b, prompt)
        assert toks == cold and cached == 144
        assert b.connector.metrics.value("tierkv_connector_hit_tokens_total", tier="remote:dram") == 144
        assert b.connector.metrics.value("tierkv_connector_bytes_loaded_total") == 9 * block
        b.check_integrity()
    # another process with the same flag: its calibration gives the same scales, so it hits
    out = subprocess.run(
        [sys.executable, str(CHILD), d, url, json.dumps(prompt), json.dumps(FP8)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"tokens": cold, "cached": 144}
    # the inspection CLI (its own event loop: in a thread) names the layout, the scales and
    # the size against bf16
    from kvstore.cli import main

    capsys.readouterr()
    assert await asyncio.to_thread(main, ["show", keys[0].hex, "--node", node.admin, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["namespace"] == ns_id and doc["payload_len"] == block
    assert doc["header"]["dtype"] == "float8_e4m3fn"
    kv = doc["kv"]
    assert kv["layout"] == "LKH(TD+f32scale)" and kv["bf16_bytes"] == bf16
    assert kv["scales"]["count"] * 4 == block - bf16 // 2
    assert await asyncio.to_thread(main, ["show", keys[0].hex, "--node", node.admin]) == 0
    text = capsys.readouterr().out
    assert "LKH(TD+f32scale)" in text and "float32 (layer, k/v, kv head)" in text


async def test_bf16_kv_on_an_fp32_model_hits_exactly(tiny_model, tmp_path):
    """Any stored dtype other than the compute dtype goes the same way (no scales)."""
    d = tiny_model()
    prompt = random_prompt(70, 3)
    url = f"local://{tmp_path}/store?lookup_deadline_s=5&policy=always"
    async with open_engine(d, url, kv_cache_dtype="bf16", enable_prefix_cache=False) as a:
        cold, _ = await run(a, prompt)
        assert await a.connector.flush()
        toks, cached = await run(a, prompt)
        assert toks == cold and cached == 64
        m = a.connector.metrics
        assert m.value("tierkv_connector_block_bytes", kv_dtype="bfloat16") == _bf16_block_bytes(a, 16)
