"""200 randomized prompts with overlapping prefixes and lengths that are not multiples of the
block size, several at once through `kvengine serve --kv-connector kvstore://…` (its own
prefix cache off, so every hit comes through the store): 0 mismatches against the same server
run with no connector."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import time
import urllib.request

import aiohttp
import pytest
from daemonutil import stop_process
from ports import free_port
from scraping import scrape_async

MAX_TOKENS = 4


def _prompts(n: int, seed: int) -> list[list[int]]:
    rnd = random.Random(seed)
    docs = [[rnd.randrange(6, 250) for _ in range(rnd.randrange(40, 220))] for _ in range(12)]
    out = []
    for _ in range(n):
        doc = rnd.choice(docs)
        cut = rnd.randrange(1, len(doc) + 1)
        tail = [rnd.randrange(6, 250) for _ in range(rnd.randrange(0, 30))]
        p = doc[:cut] + tail
        if len(p) % 16 == 0:
            p.append(7)
        out.append(p)
    return out


async def _serve_and_query(model_dir: str, connector: str, prompts: list[list[int]]):
    """Start a server with ``connector``, send ``prompts`` 8 at a time. Returns
    ([(text, cached_tokens)], the server's /metrics at the end: tests/scraping.py's Scrape)."""
    port = free_port()
    cmd = [sys.executable, "-m", "engine.cli", "serve", "--model", model_dir, "--port", str(port),
           "--device", "cpu", "--num-pages", "512", "--no-prefix-cache", "--kv-connector", connector,
           "--served-model-name", "m"]  # fmt: skip
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            try:
                with urllib.request.urlopen(base + "/health", timeout=1):
                    break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    proc.kill()
                    pytest.fail(f"server did not start: {proc.stdout.read()}")
                time.sleep(0.1)
        sem = asyncio.Semaphore(8)
        async with aiohttp.ClientSession() as http:

            async def one(p):
                async with sem:
                    body = {
                        "model": "m",
                        "prompt": p,
                        "max_tokens": MAX_TOKENS,
                        "temperature": 0,
                        "ignore_eos": True,
                    }
                    async with http.post(base + "/v1/completions", json=body) as r:
                        assert r.status == 200, await r.text()
                        j = await r.json()
                        return j["choices"][0]["text"], j["usage"]["prompt_tokens_details"]["cached_tokens"]

            results = await asyncio.gather(*(one(p) for p in prompts))
            return results, await scrape_async(base)
    finally:
        stop_process(proc, 10)


@pytest.mark.heavy
async def test_200_random_prompts_through_the_server(tiny_model, start_daemon):
    d = tiny_model()
    node = start_daemon()
    prompts = _prompts(200, 11)
    want, _ = await _serve_and_query(d, "none", prompts)
    assert [c for _, c in want] == [0] * len(prompts)
    # policy=always: for a tiny model the cost model rightly prefers recompute; here the loads
    # themselves are under test
    got, metrics = await _serve_and_query(
        d, f"kvstore://{node.addr}?lookup_deadline_s=5&policy=always", prompts
    )
    mismatches = [i for i, (g, w) in enumerate(zip(got, want)) if g[0] != w[0]]
    assert mismatches == [], f"{len(mismatches)} of 200 differ: {mismatches[:10]}"
    hits = sum(c for _, c in got)
    assert hits > 16 * 200, f"too few store hits to mean anything ({hits} tokens)"
    # the connector's metrics are on the server's /metrics, and agree with the usage counts
    assert metrics.value("tierkv_connector_hit_tokens_total", tier="remote:dram") == hits
