"""A prompt as the engine sees it, without importing the engine: token ids from a model
folder's ``tokenizer.json`` (same calls as engine/loader.py's ``Tokenizer``), the chat template
rendering of ``kvengine``'s chat endpoint, and the engine's block-key namespace
(``LLMEngine.namespace``: model fingerprint, KV dtype, block_tokens, tp, tenant salt).

tests/cli/test_cli_lookup.py checks all three against the engine's own functions.
"""

from __future__ import annotations

import json
import os
from typing import Any

from kvstore.block import DTYPE_SIZES
from kvstore.inspect.admin_client import UsageError


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from exc
    except ValueError as exc:
        raise UsageError(f"{path} is not JSON: {exc}") from exc


def load_tokenizer(model_dir: str):
    """``tokenizers.Tokenizer`` of ``model_dir/tokenizer.json``; UsageError naming the file."""
    from tokenizers import Tokenizer

    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        raise UsageError(f"{path}: no such file (--model/--tokenizer must be a model folder)")
    try:
        return Tokenizer.from_file(path)
    except Exception as exc:  # tokenizers raises a bare Exception on bad JSON
        raise UsageError(f"cannot load {path}: {exc}") from exc


def _special(tok: Any) -> str:
    if isinstance(tok, dict):
        return str(tok.get("content", ""))
    return tok if isinstance(tok, str) else ""


def chat_text(model_dir: str, user_text: str) -> str:
    """``user_text`` as one user message rendered by the folder's chat template with a
    generation prompt (tokenizer_config.json's ``chat_template`` or chat_template.jinja), or the
    engine's plain fallback (``user: ...\\nassistant: ``) when the folder has none."""
    cfg_path = os.path.join(model_dir, "tokenizer_config.json")
    cfg = _read_json(cfg_path) if os.path.isfile(cfg_path) else {}
    template = cfg.get("chat_template")
    if isinstance(template, list):
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    jinja_path = os.path.join(model_dir, "chat_template.jinja")
    if template is None and os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            template = f.read()
    messages = [{"role": "user", "content": user_text}]
    if not template:
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(msg: str) -> None:
        raise jinja2.TemplateError(msg)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
    try:
        return env.from_string(template).render(
            messages=messages,
            add_generation_prompt=True,
            bos_token=_special(cfg.get("bos_token")),
            eos_token=_special(cfg.get("eos_token")),
        )
    except jinja2.TemplateError as exc:
        raise UsageError(f"{model_dir}: chat template failed: {exc}") from exc


def prompt_tokens(model_dir: str, text: str, chat: bool) -> list[int]:
    """Token ids of ``text`` as ``/v1/completions`` (special tokens added) or, with ``chat``,
    as ``/v1/chat/completions`` with one user message (template carries its own specials)."""
    tok = load_tokenizer(model_dir)
    if chat:
        return tok.encode(chat_text(model_dir, text), add_special_tokens=False).ids
    return tok.encode(text, add_special_tokens=True).ids


def tokens_from_json(path: str) -> list[int]:
    """A JSON list of ints, or an object with a ``tokens`` (or ``prompt_token_ids``) list."""
    doc = _read_json(path)
    if isinstance(doc, dict):
        doc = doc.get("tokens", doc.get("prompt_token_ids"))
    if not isinstance(doc, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in doc):
        raise UsageError(f'--tokens-json {path}: expected a JSON list of token ids (or {{"tokens": [...]}})')
    return doc


def engine_namespace(
    model_dir: str,
    dtype: str,
    block_tokens: int,
    tp_size: int,
    tp_rank: int,
    tenant: str,
    layout: str = "LKTHD",
    salt_secret_file: str = "",
):
    """The Namespace the engine (and its connector) uses for this model folder. ``layout``: the
    payload layout the engine logs at start (``event=kv_cache layout=...``; ``LKTHD`` unless
    it runs with ``--kv-cache-dtype``). With ``salt_secret_file`` (the daemons'
    ``auth.salt_secret_file``) the tenant's salt is derived as the daemons derive it;
    without, it is the tenant's name (daemons without a secret)."""
    from kvstore.daemon.auth import read_salt_secret, secret_salt
    from kvstore.errors import ConfigError, KeyFormatError
    from kvstore.keys import Namespace, model_fingerprint

    if dtype not in DTYPE_SIZES:
        raise UsageError(f"--dtype {dtype!r}: expected one of {sorted(DTYPE_SIZES)}")
    try:
        fp = model_fingerprint(model_dir)
    except FileNotFoundError as exc:
        raise UsageError(f"--model {model_dir}: {exc.strerror}: {exc.filename}") from exc
    try:
        ns = Namespace(fp, dtype, block_tokens, layout=layout, tp_size=tp_size, tp_rank=tp_rank)
    except KeyFormatError as exc:
        raise UsageError(str(exc)) from exc
    if not tenant:
        return ns
    if not salt_secret_file:
        return ns.with_tenant(tenant)
    try:
        secret = read_salt_secret(salt_secret_file)
    except ConfigError as exc:
        raise UsageError(str(exc).replace("auth.salt_secret_file", "--salt-secret-file", 1)) from exc
    return ns.with_tenant(secret_salt(secret, tenant))


def block_bytes(
    model_dir: str, dtype: str, block_tokens: int, tp_size: int, layout: str = "LKTHD"
) -> int | None:
    """Payload bytes of one block of this model (layers x 2 x block_tokens x kv_heads/tp x
    head_dim x itemsize, plus a 4-byte scale per layer, K/V and head in a scaled layout) from
    config.json, or None when the config lacks the fields."""
    cfg = _read_json(os.path.join(model_dir, "config.json"))
    try:
        heads = int(cfg["num_attention_heads"])
        kvh = int(cfg.get("num_key_value_heads") or heads)
        hd = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
        layers = int(cfg["num_hidden_layers"])
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    heads_here = max(1, kvh // tp_size)
    scales = 4 * layers * 2 * heads_here if "scales=" in layout else 0
    return layers * 2 * block_tokens * heads_here * hd * DTYPE_SIZES[dtype] + scales
