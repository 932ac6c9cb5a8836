"""A prompt as the engine sees it: token ids through the engine's own tokenizer and chat
template (engine/loader.py's ``Tokenizer``, imported lazily), and the engine's block-key
namespace (``Namespace.for_model``, the rule ``LLMEngine.namespace`` follows: model
fingerprint, KV dtype, layout, block_tokens, tp; plus the tenant salt the daemons derive).

tests/cli/test_cli_lookup.py checks the tokens and the namespace against a real engine's.
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


ENGINE_EXTRA = "pip install 'tierkv[engine]'"


def _needs_engine(what: str, exc: ImportError, instead: str = "") -> UsageError:
    # a store-only install (`pip install tierkv`) lacks the engine's tokenizer packages
    return UsageError(
        f"{what} uses the engine's tokenizer, not installed here ({exc.name or exc} is missing): "
        f"{ENGINE_EXTRA}{instead}"
    )


def load_tokenizer(model_dir: str, what: str = "--tokenizer", instead: str = ""):
    """The engine's :class:`engine.loader.Tokenizer` of ``model_dir`` (``tokenizer.json``, its
    special tokens and chat template); UsageError naming the file, or, without the engine
    extra (tokenizers, jinja2), naming ``what``, the install that adds it and ``instead``. The
    engine's own code, not a copy, so the CLI's token ids are the engine's. The import is lazy,
    inside this function: only the prompt and decode paths need the engine (whose loader
    imports torch only for weights)."""
    try:
        import jinja2  # noqa: F401 - the chat template's; checked here, before any work
        import tokenizers  # noqa: F401 - what engine.loader.Tokenizer loads tokenizer.json with

        from engine.errors import ModelLoadError
        from engine.loader import Tokenizer
    except ImportError as exc:
        raise _needs_engine(what, exc, instead) from exc
    try:
        return Tokenizer(model_dir)
    except ModelLoadError as exc:
        raise UsageError(f"{exc} (--model/--tokenizer must be a model folder)") from exc


def prompt_tokens(model_dir: str, text: str, chat: bool) -> list[int]:
    """Token ids of ``text`` as ``/v1/completions`` (special tokens added) or, with ``chat``,
    as ``/v1/chat/completions`` with one user message (the engine's chat template, which
    carries its own special tokens). UsageError naming the folder when its template fails, or
    the engine extra when it is not installed (``--tokens-json`` needs no tokenizer)."""
    tok = load_tokenizer(model_dir, "tokenizing a prompt", " (or give its token ids: --tokens-json)")
    import jinja2  # load_tokenizer checked it is there

    if not chat:
        return tok.encode(text)
    try:
        return tok.apply_chat_template([{"role": "user", "content": text}])
    except jinja2.TemplateError as exc:
        raise UsageError(f"{model_dir}: chat template failed: {exc}") from exc


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
    from kvstore.keys import Namespace

    if dtype not in DTYPE_SIZES:
        raise UsageError(f"--dtype {dtype!r}: expected one of {sorted(DTYPE_SIZES)}")
    try:  # the engine's rule (LLMEngine.namespace calls it too)
        ns = Namespace.for_model(
            model_dir, dtype, block_tokens, layout=layout, tp_size=tp_size, tp_rank=tp_rank
        )
    except FileNotFoundError as exc:
        raise UsageError(f"--model {model_dir}: {exc.strerror}: {exc.filename}") from exc
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
