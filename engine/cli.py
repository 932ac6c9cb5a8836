"""``kvengine``: serve, generate, bench, import-gguf, make-tiny-model."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from engine.config import KV_CACHE_DTYPES, EngineSection

# what `tierkv[engine]` adds to the store's install (pyproject.toml); gguf's: `tierkv[gguf]`
ENGINE_PACKAGES = {"torch", "safetensors", "tokenizers", "jinja2", "fastapi", "uvicorn"}


class _Given(argparse.Action):
    """Keeps a flag's text and notes that it was given: a given flag overrides the environment
    and the config file; an absent one leaves them be (its default is only for --help)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)
        namespace.given = {**namespace.given, self.dest: option_string}


def _flag(p: argparse.ArgumentParser, name: str, help_text: str | None = None, **kw) -> None:
    """``--name`` for the EngineSection key of the same name (dashes as underscores); its
    default shown is the key's default."""
    key = name.replace("-", "_")
    p.add_argument(
        f"--{name}", dest=key, action=_Given, default=getattr(EngineSection(), key), help=help_text, **kw
    )


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.set_defaults(given={})
    p.add_argument(
        "--config",
        default=None,
        metavar="TOML",
        help="settings from the [engine] table of a TOML file (keys: the flags' names with "
        "underscores); TIERKV_ENGINE__<KEY> variables override it, flags override both "
        "(docs/configuration.md)",
    )
    _flag(p, "model", "Hugging Face model folder (see import-gguf, make-tiny-model); required")
    _flag(p, "device", "cpu or cuda[:N] (default: cuda if available)")
    _flag(p, "dtype", metavar="{float32,bfloat16,float16}")
    _flag(p, "page-size")
    _flag(p, "num-pages")
    _flag(p, "kv-cache-bytes", "page pool size, e.g. 8GiB or 8GB (docs/configuration.md: units)")
    _flag(p, "max-num-batched-tokens")
    _flag(p, "max-num-seqs")
    _flag(p, "max-model-len")
    _flag(p, "attention-backend", metavar="{auto,torch,triton,flash_attn}")
    _flag(p, "no-prefix-cache", nargs=0, const="true")
    _flag(
        p,
        "kv-cache-dtype",
        "what the KV pages (and stored blocks) hold: auto = the model dtype; fp8_e4m3 = half of "
        "bf16's bytes, static per-(layer, KV head) scales calibrated at start",
        metavar="{" + ",".join(KV_CACHE_DTYPES) + "}",
    )


def load_settings(a: argparse.Namespace) -> EngineSection:
    """The EngineSection of a parsed serve/generate/bench command line: defaults, then its
    ``--config`` file, then ``TIERKV_ENGINE__*`` variables, then the flags it gave. Raises
    kvstore's ConfigError naming the key and its source (main reports it as a usage error)."""
    import os

    from engine.config import EngineSettings
    from kvstore.settings import ConfigError, load_config

    flags = {f"engine.{key}": (flag, getattr(a, key)) for key, flag in a.given.items()}
    s = load_config(EngineSettings, a.config, os.environ, flags=flags).engine
    if not s.model:
        raise ConfigError("engine.model: required (--model, TIERKV_ENGINE__MODEL or [engine] model)")
    return s


def _config(s):
    device = s.device
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return s.engine_config(device)


def cmd_serve(a) -> int:
    import os

    import uvicorn

    from engine.async_engine import AsyncEngine
    from engine.server import create_app

    s = load_settings(a)
    url = s.kv_connector
    if s.kv_connector_config:
        from urllib.parse import quote

        url += ("&" if "?" in url else "?") + "config=" + quote(s.kv_connector_config)
    aeng = AsyncEngine.from_model(
        s.model,
        _config(s),
        url,
        lookup_timeout_s=s.kv_lookup_timeout_s,
        timeline_layers=s.timeline_layers,
    )
    name = s.served_model_name or os.path.basename(os.path.normpath(s.model))
    app = create_app(aeng, name)
    print(
        f"event=serving model={name} url=http://{s.host}:{s.port} kv_connector={s.kv_connector}", flush=True
    )
    uvicorn.run(app, host=s.host, port=s.port, log_level=s.log_level)
    return 0


def cmd_generate(a) -> int:
    from engine.llm import LLMEngine
    from engine.sequence import SamplingParams

    if a.prompt_file:
        text = Path(a.prompt_file).read_text(encoding="utf-8")
    else:
        text = a.prompt if a.prompt is not None else sys.stdin.read()
    s = load_settings(a)
    eng = LLMEngine(s.model, _config(s))
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

    s = load_settings(a)
    eng = LLMEngine(s.model, _config(s))
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
    _flag(s, "host")
    _flag(s, "port")
    _flag(s, "kv-connector", "none | memory:// | kvstore://host:port,... | local://PATH | etcd://...")
    _flag(
        s,
        "kv-connector-config",
        "connector options from a TOML file (the URL's query overrides them); see docs/connector.md",
        metavar="TOML",
    )
    _flag(
        s,
        "kv-lookup-timeout-s",
        "the engine's backstop on one connector lookup (default: the connector's "
        "lookup_deadline_s + 1 s; never below it)",
        metavar="S",
    )
    _flag(
        s,
        "timeline-layers",
        "time each prefill step per layer group (load wait, compute) into the request timeline "
        "and tierkv_engine_layer_group_seconds; off: no cost (docs/engine.md)",
        nargs=0,
        const="true",
    )
    _flag(s, "served-model-name")
    _flag(s, "log-level")
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
    """Run one command. A bad setting (kvstore's ConfigError: a key, a value, its source) or an
    engine error is one line on stderr and status 2, like an argparse usage error."""
    from engine.errors import EngineError
    from kvstore.settings import ConfigError

    try:
        a = build_parser().parse_args(argv)  # the model presets' module imports torch
        return a.fn(a)
    except (EngineError, ConfigError) as exc:
        print(f"kvengine: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        # a store-only install (`pip install tierkv`) has the kvengine script but not the engine
        if (exc.name or "").partition(".")[0] not in ENGINE_PACKAGES:
            raise
        print(f"kvengine: error: {exc.name} is not installed: pip install 'tierkv[engine]'", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
