"""The registry of attention backends: a name -> the module that builds it. Each backend lives
in its own file (``engine/attention_<name>.py``) and imports only ``engine/attention_meta.py``
(and the kernel it runs); nothing imports back here, so the imports run one way.

Every backend is an ``attention_meta.PagedAttention``: ``forward(q, k, v, k_cache, v_cache, meta)``
stores the step's new K/V (``[T, kv_heads, head_dim]``) into their slots and returns the
attention of ``q [T, heads, head_dim]`` over each sequence's pages (layout: attention_meta.py).
"""

from __future__ import annotations

import importlib

import torch

from engine.errors import ConfigError

# name -> module with ``create(device, num_heads, num_kv_heads, head_dim, dtype)``
BACKENDS = {
    "torch": "engine.attention_torch",
    "triton": "engine.attention_triton",
    "flash_attn": "engine.attention_flash",
}
# What ``auto`` tries on CUDA, in order (a backend that does not import or does not take the
# dtype is skipped); on CPU ``auto`` is torch.
CUDA_PREFERENCE = ("flash_attn", "triton", "torch")


def make_backend(
    name: str, device: str, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
):
    """Build backend ``name`` (or pick one for ``auto``). An explicit name that cannot run on
    this device, dtype or install raises ConfigError naming why."""
    if name == "auto":
        if not device.startswith("cuda"):
            return _create("torch", device, num_heads, num_kv_heads, head_dim, dtype)
        for cand in CUDA_PREFERENCE:
            try:
                return _create(cand, device, num_heads, num_kv_heads, head_dim, dtype)
            except (ImportError, ConfigError):
                continue
    if name not in BACKENDS:
        raise ConfigError(f"attention_backend {name!r} not one of auto/{'/'.join(BACKENDS)}")
    try:
        return _create(name, device, num_heads, num_kv_heads, head_dim, dtype)
    except ImportError as exc:
        raise ConfigError(f"attention_backend {name!r} but its library does not import: {exc}") from exc


def _create(name: str, device: str, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype):
    return importlib.import_module(BACKENDS[name]).create(device, num_heads, num_kv_heads, head_dim, dtype)
