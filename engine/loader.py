"""Loading a Hugging Face model folder: safetensors weights memory-mapped without an extra
copy, the tokenizer (``tokenizer.json`` via ``tokenizers``) and the chat template.

torch is imported only by the weight loaders: ``kvstore lookup --prompt`` tokenizes through
:class:`Tokenizer` (one chat template implementation) without paying for torch.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.errors import ModelLoadError

if TYPE_CHECKING:
    import torch

# safetensors dtype names -> torch dtype attribute names
_ST_DTYPES = {
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F64": "float64",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}


def safetensors_files(model_dir: str | os.PathLike) -> list[str]:
    """The ``*.safetensors`` files of a folder, sorted. Raises ModelLoadError if there are none."""
    root = os.fspath(model_dir)
    if not os.path.isdir(root):
        raise ModelLoadError(f"model folder {root} does not exist")
    files = sorted(os.path.join(root, n) for n in os.listdir(root) if n.endswith(".safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors file in {root}")
    return files


def iter_safetensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of one safetensors file. Tensors are views of
    a private (copy-on-write) memory map of the file: no bytes are copied until written.
    Raises ModelLoadError naming the file when the header or an offset is bad."""
    import torch

    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise ModelLoadError(f"{path}: not a safetensors file (only {size} bytes)")
            (hlen,) = struct.unpack("<Q", f.read(8))
            if hlen > size - 8 or hlen > 100 << 20:
                raise ModelLoadError(f"{path}: bad safetensors header length {hlen}")
            header = json.loads(f.read(hlen))
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path}: cannot read safetensors header: {exc}") from exc
    if not isinstance(header, dict):
        raise ModelLoadError(f"{path}: safetensors header is not an object")
    base = 8 + hlen
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = getattr(torch, _ST_DTYPES[meta["dtype"]])
            start, end = (int(x) for x in meta["data_offsets"])
            shape = [int(d) for d in meta["shape"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"{path}: bad entry for tensor {name!r}: {meta!r}") from exc
        itemsize = torch.empty((), dtype=dtype).element_size()
        numel = 1
        for d in shape:
            numel *= d
        if start < 0 or end < start or base + end > size or (end - start) != numel * itemsize:
            raise ModelLoadError(f"{path}: tensor {name!r} has bad offsets {start}..{end} for shape {shape}")
        if numel == 0:
            yield name, torch.empty(shape, dtype=dtype)
            continue
        yield name, torch.frombuffer(mm, dtype=dtype, count=numel, offset=base + start).view(shape)


def load_state(model_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors file in the folder (memory-mapped views)."""
    out: dict[str, torch.Tensor] = {}
    for path in safetensors_files(model_dir):
        for name, t in iter_safetensors(path):
            out[name] = t
    return out


@dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template plus the special-token strings it may reference."""

    source: str
    bos_token: str = ""
    eos_token: str = ""

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(msg: str) -> None:
            raise jinja2.TemplateError(msg)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
        return env.from_string(self.source).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )


class Tokenizer:
    """``tokenizer.json`` via the ``tokenizers`` library plus the chat template and special
    tokens from ``tokenizer_config.json`` / ``chat_template.jinja`` when present."""

    def __init__(self, model_dir: str | os.PathLike) -> None:
        from tokenizers import Tokenizer as _Tok

        root = os.fspath(model_dir)
        path = os.path.join(root, "tokenizer.json")
        if not os.path.isfile(path):
            raise ModelLoadError(f"missing {path}")
        try:
            self._tok = _Tok.from_file(path)
        except Exception as exc:  # tokenizers raises a bare Exception on bad JSON
            raise ModelLoadError(f"cannot load {path}: {exc}") from exc
        cfg: dict[str, Any] = {}
        cfg_path = os.path.join(root, "tokenizer_config.json")
        if os.path.isfile(cfg_path):
            try:
                with open(cfg_path, encoding="utf-8") as f:
                    cfg = json.load(f)
            except (OSError, ValueError) as exc:
                raise ModelLoadError(f"cannot parse {cfg_path}: {exc}") from exc
        self.bos_token = _token_str(cfg.get("bos_token"))
        self.eos_token = _token_str(cfg.get("eos_token"))
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_path = os.path.join(root, "chat_template.jinja")
        if template is None and os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                template = f.read()
        self.chat_template = ChatTemplate(template, self.bos_token, self.eos_token) if template else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        """Render the chat template with a generation prompt and tokenize it (the template
        carries its own special tokens, as transformers does)."""
        if self.chat_template is None:
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
        else:
            text = self.chat_template.render(messages, add_generation_prompt=True)
        return self.encode(text, add_special_tokens=False)


def _token_str(tok: Any) -> str:
    if isinstance(tok, dict):
        return str(tok.get("content", ""))
    return tok or ""


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas. Holds back a trailing partial UTF-8
    character (decoded as U+FFFD) until the next token completes it."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self.ids: list[int] = []
        self.text = ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        full = self._tok.decode(self.ids)
        if full.endswith("\ufffd"):
            return ""
        delta = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text = full
        return delta
