"""kvstore:// end to end against real daemons: a second engine process hits what the first
stored; faults (kill -9 mid-load, a corrupt block on disk, a daemon that never answers, a wrong
token) all end in correct output, within the deadline plus prefill time."""

from __future__ import annotations

import asyncio
import json
import pathlib
import subprocess
import sys
import time

import pytest
import torch
from connutil import (
    assert_loads,
    open_engine,
    random_prompt,
    reference,
    run,
    run_fresh,
    store_cold,
)
from storeutil import flip_byte_in_file

from tests.connector.slowlink import SilentServer

CHILD = pathlib.Path(__file__).with_name("engine_child.py")


async def test_second_engine_process_hits_the_daemon(stored_prompt):
    s = await stored_prompt(150, 1)
    d, url, prompt, ref = s.model_dir, s.url, s.prompt, s.ref
    # in-process fresh engine: bitwise KV
    async with open_engine(d, url) as b:
        await assert_loads(b, prompt, ref, s.kv, 144)
        assert b.connector.metrics.value("tierkv_connector_hit_tokens_total", tier="remote:dram") == 144
    # another process: the hit crosses process boundaries
    out = subprocess.run(
        [sys.executable, str(CHILD), d, url, json.dumps(prompt)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res == {"tokens": ref, "cached": 144}


@pytest.mark.heavy
async def test_kill_9_mid_load_recomputes_the_rest(stored_prompt):
    s = await stored_prompt(400, 2, "&load_batch_blocks=1&load_parallel=1")  # 25 sequential GETs
    prompt, ref = s.prompt, s.ref

    async def killer():
        while b.connector.metrics.value("tierkv_connector_bytes_loaded_total") == 0:
            await asyncio.sleep(0.0005)
        s.daemon.kill9()

    async with open_engine(s.model_dir, s.url, enable_prefix_cache=False) as b:
        k = asyncio.ensure_future(killer())
        t0 = time.monotonic()
        toks, cached = await run(b, prompt)
        assert toks == ref
        assert 0 < cached < 400, f"the kill did not land mid-load (cached={cached})"
        assert time.monotonic() - t0 < 30
        await k
        causes = sum(
            b.connector.metrics.value("tierkv_connector_recompute_fallbacks_total", cause=c)
            for c in ("miss", "error", "timeout")
        )
        assert causes > 0
        # the daemon is gone: later requests are ordinary prefill
        toks2, cached2 = await run(b, prompt)
        assert toks2 == ref and cached2 == 0
        b.check_integrity()


async def test_corrupt_block_on_disk_is_recomputed(stored_prompt, start_daemon, tmp_path):
    wd = tmp_path / "n"
    s = await stored_prompt(150, 3, workdir=wd, dram={"capacity": 0}, disk={"sync": True})
    assert s.daemon.stop() == 0
    # flip a byte inside block 4's payload in the daemon's LMDB file
    needle = s.kv[:, :, 64:80].contiguous().view(torch.uint8).reshape(-1)[:512].numpy().tobytes()
    flip_byte_in_file(wd / "disk" / "data.mdb", needle)
    node = start_daemon(workdir=wd, dram={"capacity": 0}, disk={"sync": True})
    async with open_engine(
        s.model_dir, f"kvstore://{node.addr}?lookup_deadline_s=5&policy=always", enable_prefix_cache=False
    ) as b:
        toks, cached = await run(b, s.prompt)
        assert toks == s.ref
        assert cached == 64, "blocks before the corrupt one load; it and the rest are recomputed"
        causes = {
            c: b.connector.metrics.value("tierkv_connector_recompute_fallbacks_total", cause=c)
            for c in ("corrupt", "miss")
        }
        assert sum(causes.values()) >= 1, causes  # the daemon drops the bad copy: corrupt, then a miss


async def test_daemon_that_never_answers(tiny_model):
    d = tiny_model()
    srv = SilentServer()
    prompt = random_prompt(100, 4)
    ref = reference(d, prompt)
    try:
        async with open_engine(d, f"kvstore://{srv.addr}?save_deadline_s=0.5&load_deadline_s=0.5") as b:
            t0 = time.monotonic()
            toks, cached = await run(b, prompt)
            elapsed = time.monotonic() - t0
            assert toks == ref and cached == 0
            assert elapsed < 10, elapsed
            res = await b.connector.flush(10)
            assert res.complete and res.saved == 0 and res.failed + res.dropped == 6, res  # told, not silent
            assert not res
            assert b.connector.metrics.value("tierkv_connector_saved_blocks_total") == 0
    finally:
        srv.close()


async def test_wrong_token_is_a_miss_not_an_error(tiny_model, start_daemon, tmp_path):
    d = tiny_model()
    tokens = tmp_path / "tokens"
    tokens.write_text("s3cret-token-a tenant-a\n")
    node = start_daemon(auth={"token_file": str(tokens)})
    prompt = random_prompt(100, 5)
    good = f"kvstore://{node.addr}?token=s3cret-token-a&tenant=tenant-a&lookup_deadline_s=5&policy=always"
    ref, _ = await store_cold(d, good, prompt)
    assert await run_fresh(
        d, f"kvstore://{node.addr}?token=wrong-token-b&tenant=tenant-a", prompt, enable_prefix_cache=False
    ) == (ref, 0)
    assert await run_fresh(d, good, prompt, enable_prefix_cache=False) == (ref, 96)


async def test_tenants_key_with_the_secret_salt_the_daemon_hands_out(tiny_model, start_daemon, tmp_path):
    """With ``auth.salt_secret_file`` a tenant's namespace is salted by a secret the daemon
    hands out at HELLO (docs/security.md): the connector keys with it and hits; the tenant
    name alone (computable offline) is not the salt, and another tenant sees nothing."""
    d = tiny_model()
    tokens = tmp_path / "tokens"
    tokens.write_text("secret-token-a tenant-a\nsecret-token-b tenant-b\n")
    secret = tmp_path / "salt-secret"
    secret.write_text("a-long-random-cluster-secret-0123456789abcdef\n")
    secret.chmod(0o600)
    node = start_daemon(auth={"token_file": str(tokens), "salt_secret_file": str(secret)})
    prompt = random_prompt(100, 6)
    ref = reference(d, prompt)
    url_a = f"kvstore://{node.addr}?token=secret-token-a&tenant=tenant-a&lookup_deadline_s=5&policy=always"
    async with open_engine(d, url_a, enable_prefix_cache=False) as a:
        assert await run(a, prompt) == (ref, 0)
        flushed = await a.connector.flush()
        assert flushed and flushed.saved == 6, flushed
        guess = a.connector.base_ns.with_tenant("tenant-a")
        assert a.connector.ns != guess  # the salt is the daemon's secret, not the tenant's name
    assert await run_fresh(d, url_a, prompt, enable_prefix_cache=False) == (ref, 96)
    url_b = f"kvstore://{node.addr}?token=secret-token-b&tenant=tenant-b&lookup_deadline_s=5&policy=always"
    assert await run_fresh(d, url_b, prompt, enable_prefix_cache=False) == (ref, 0)
