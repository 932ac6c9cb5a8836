"""The page format of vLLM's KV cache, as tierkv keys it: everything that makes one vLLM
instance's bytes of a block usable by another, and nothing else.

One tierkv block is one vLLM block: its page in every attention layer, moved as opaque bytes
(``[layers, *page]``, ``page`` = vLLM's per-layer ``[H, N, C]`` view of one block: how K and V
are packed inside it is the attention backend's business, and on CPU its ISA's). The format
goes into the block keys' namespace, so a block saved under another model, KV dtype, compute
dtype, attention backend (and ISA), KV layout, page shape, layer count, block size or tensor
parallel rank -- or by the bundled engine (layout ``LKTHD``) -- is never found, let alone
loaded. The worker reads the format off its KV tensors; the scheduler gets it from the worker
through vLLM's handshake, so both key blocks the same way.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass

import torch

from kvstore.client import ConfigError
from kvstore.keys import Namespace, model_fingerprint


@dataclass(frozen=True)
class PageFormat:
    model: str  # kvstore.keys.model_fingerprint of the weights (+ a digest of vLLM's overrides)
    compute_dtype: str  # the model's dtype (torch name)
    kv_dtype: str  # the KV tensors' dtype (torch name)
    backend: str  # attention backend, with the ISA where it packs by ISA ("CPU_ATTN/vec")
    kv_layout: str  # vLLM's KVCacheLayout name ("LBHNC")
    page_shape: tuple[int, ...]  # one layer's view of one block
    layers: int
    block_size: int
    tp_size: int = 1
    tp_rank: int = 0

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.kv_dtype)

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.layers, *self.page_shape)

    @property
    def block_bytes(self) -> int:
        return math.prod(self.block_shape) * torch.empty((), dtype=self.dtype).element_size()

    @property
    def layout(self) -> str:
        """The namespace's layout field: never ``LKTHD``, the bundled engine's."""
        shape = "x".join(map(str, self.page_shape))
        return f"vllm:{self.backend}:{self.kv_layout}:{shape}:{self.layers}L:{self.compute_dtype}"

    def namespace(self, block_tokens: int) -> Namespace:
        if block_tokens != self.block_size:
            raise ConfigError(
                f"block_tokens {block_tokens}: with vLLM a block is vLLM's block_size {self.block_size}"
            )
        return Namespace(
            self.model, self.kv_dtype, block_tokens, self.layout, tp_size=self.tp_size, tp_rank=self.tp_rank
        )


def model_identity(model: str, revision: str | None, overrides: object, fingerprint: str = "") -> str:
    """The model part of the namespace: ``fingerprint`` when given (the user names the weights),
    else :func:`kvstore.keys.model_fingerprint` of the model's folder (a local path, or the
    local snapshot of a hub id), plus a digest of vLLM's ``hf_overrides`` when there are any
    (they may change what the model computes). ConfigError naming the model when its files
    cannot be found here."""
    if not fingerprint:
        fingerprint = model_fingerprint(_model_folder(model, revision))
    if overrides:
        text = json.dumps(overrides, sort_keys=True, default=str).encode()
        fingerprint += "+" + hashlib.blake2b(text, digest_size=8).hexdigest()
    return fingerprint


def _model_folder(model: str, revision: str | None) -> str:
    if os.path.isfile(os.path.join(model, "config.json")):
        return model
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model, revision=revision, local_files_only=True)
    except Exception as exc:  # not a hub id, or not downloaded here
        raise ConfigError(
            f"model {model!r}: no local folder with config.json to fingerprint ({exc}); "
            "set kv_connector_extra_config.model_fingerprint to name these weights"
        ) from None
