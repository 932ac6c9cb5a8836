"""``kvengine``: serve, generate, bench, import-gguf, make-tiny-model."""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

from engine.config import KV_CACHE_DTYPES

_UNITS = {
    "": 1,
    "b": 1,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
}


def parse_size(text: str) -> int:
    """``"64GiB"`` -> bytes. Raises argparse.ArgumentTypeError naming the bad value."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (examples: 512MiB, 2GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", required=True, help="Hugging Face model folder (see import-gguf, make-tiny-model)"
    )
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if available)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-pages", type=int, default=None)
    p.add_argument("--kv-cache-bytes", type=parse_size, default=parse_size("512MiB"))
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton", "flash_attn"])
    p.add_argument("--no-prefix-cache", action="store_true")
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=list(KV_CACHE_DTYPES),
        help="what the KV pages (and stored blocks) hold: auto = the model dtype; fp8_e4m3 = half of "
        "bf16's bytes, static per-(layer, KV head) scales calibrated at start",
    )


def _config(a):
    from engine.config import EngineConfig

    device = a.device
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return EngineConfig(
        page_size=a.page_size,
        num_pages=a.num_pages,
        kv_cache_bytes=a.kv_cache_bytes,
        max_num_batched_tokens=a.max_num_batched_tokens,
        max_num_seqs=a.max_num_seqs,
        max_model_len=a.max_model_len,
        device=device,
        dtype=a.dtype,
        enable_prefix_cache=not a.no_prefix_cache,
        attention_backend=a.attention_backend,
        kv_cache_dtype=a.kv_cache_dtype,
    )


def cmd_serve(a) -> int:
    import os

    import uvicorn

    from engine.async_engine import AsyncEngine
    from engine.server import create_app

    url = a.kv_connector
    if a.kv_connector_config:
        from urllib.parse import quote

        url += ("&" if "?" in url else "?") + "config=" + quote(a.kv_connector_config)
    aeng = AsyncEngine.from_model(a.model, _config(a), url, lookup_timeout_s=a.kv_lookup_timeout_s)
    name = a.served_model_name or os.path.basename(os.path.normpath(a.model))
    app = create_app(aeng, name)
    print(
        f"event=serving model={name} url=http://{a.host}:{a.port} kv_connector={a.kv_connector}", flush=True
    )
    uvicorn.run(app, host=a.host, port=a.port, log_level=a.log_level)
    return 0


def cmd_generate(a) -> int:
    from engine.llm import LLMEngine
    from engine.sequence import SamplingParams

    if a.prompt_file:
        text = Path(a.prompt_file).read_text(encoding="utf-8")
    else:
        text = a.prompt if a.prompt is not None else sys.stdin.read()
    eng = LLMEngine(a.model, _config(a))
    ids = (
        eng.tokenizer.apply_chat_template([{"role": "user", "content": text}])
        if a.chat
        else eng.tokenizer.encode(text)
    )
    seq = eng.add_request(
        ids, SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, seed=a.seed)
    )
    t0 = time.perf_counter()
    ttft = None
    while eng.has_work():
        for o in eng.step():
            if ttft is None:
                ttft = time.perf_counter() - t0
            sys.stdout.write(o.text_delta)
            sys.stdout.flush()
    total = time.perf_counter() - t0
    n = len(seq.output_tokens)
    decode_rate = (n - 1) / (total - ttft) if n > 1 and total > ttft else float("nan")
    print(
        f"\n\nprompt_tokens={len(ids)} output_tokens={n} ttft_s={ttft:.4f} decode_tokens_per_s={decode_rate:.1f}",
        file=sys.stderr,
    )
    return 0


def cmd_bench(a) -> int:
    import torch

    from engine.llm import LLMEngine
    from engine.sequence import SamplingParams

    eng = LLMEngine(a.model, _config(a))
    vocab = eng.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    results = {}
    prompt = torch.randint(10, vocab, (a.prompt_len,), generator=g).tolist()
    eng.generate([prompt[:32]], SamplingParams(max_tokens=2, temperature=0))  # warm up
    eng.bm.reset_cache()
    t0 = time.perf_counter()
    eng.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    results["prefill_tokens_per_s"] = a.prompt_len / (time.perf_counter() - t0)
    eng.bm.reset_cache()
    ps = [torch.randint(10, vocab, (a.decode_prompt_len,), generator=g).tolist() for _ in range(a.batch)]
    seqs = [
        eng.add_request(p, SamplingParams(max_tokens=a.decode_tokens, temperature=0, ignore_eos=True))
        for p in ps
    ]
    while any(s.num_computed < s.num_prompt for s in seqs):
        eng.step()
    t0 = time.perf_counter()
    while eng.has_work():
        eng.step()
    gen = sum(len(s.output_tokens) - 1 for s in seqs)
    results["decode_tokens_per_s"] = gen / (time.perf_counter() - t0)
    results.update(prompt_len=a.prompt_len, batch=a.batch, decode_tokens=a.decode_tokens)
    print(json.dumps(results, indent=2))
    return 0


def cmd_import_gguf(a) -> int:
    from engine.convert import import_gguf

    out = import_gguf(a.file, a.dir)
    print(f"event=imported gguf={a.file} dir={out}")
    return 0


def cmd_make_tiny(a) -> int:
    from engine.convert import make_tiny_model

    out = make_tiny_model(a.dir, a.preset, a.seed)
    print(f"event=created preset={a.preset} dir={out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from engine.convert import PRESETS

    p = argparse.ArgumentParser(prog="kvengine", description="tierkv's paged-attention inference engine")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _engine_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument(
        "--kv-connector",
        default="none",
        help="none | memory:// | kvstore://host:port,... | local://PATH | etcd://...",
    )
    s.add_argument(
        "--kv-connector-config",
        default=None,
        metavar="TOML",
        help="connector options from a TOML file (the URL's query overrides them); see docs/connector.md",
    )
    s.add_argument(
        "--kv-lookup-timeout-s",
        type=float,
        default=None,
        metavar="S",
        help="the engine's backstop on one connector lookup (default: the connector's "
        "lookup_deadline_s + 1 s; never below it)",
    )
    s.add_argument("--served-model-name", default=None)
    s.add_argument("--log-level", default="warning")
    s.set_defaults(fn=cmd_serve)
    g = sub.add_parser(
        "generate", help="one prompt (--prompt, --prompt-file or stdin); prints TTFT and tokens/s"
    )
    _engine_args(g)
    g.add_argument("--prompt", default=None)
    g.add_argument("--prompt-file", default=None)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.set_defaults(fn=cmd_generate)
    b = sub.add_parser("bench", help="prefill and batched decode throughput")
    _engine_args(b)
    b.add_argument("--prompt-len", type=int, default=512)
    b.add_argument("--batch", type=int, default=16)
    b.add_argument("--decode-prompt-len", type=int, default=64)
    b.add_argument("--decode-tokens", type=int, default=64)
    b.set_defaults(fn=cmd_bench)
    i = sub.add_parser("import-gguf", help="GGUF file -> Hugging Face folder (needs the gguf extra)")
    i.add_argument("file")
    i.add_argument("dir")
    i.set_defaults(fn=cmd_import_gguf)
    m = sub.add_parser("make-tiny-model", help="random-weight Llama-family folder with a tokenizer")
    m.add_argument("dir")
    m.add_argument("--preset", default="llama-tiny", choices=sorted(PRESETS))
    m.add_argument("--seed", type=int, default=0)
    m.set_defaults(fn=cmd_make_tiny)
    return p


def main(argv: list[str] | None = None) -> int:
    from engine.errors import EngineError

    a = build_parser().parse_args(argv)
    try:
        return a.fn(a)
    except EngineError as exc:
        print(f"kvengine: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
