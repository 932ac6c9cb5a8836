"""The KV cache's storage dtype (``--kv-cache-dtype``) and, for fp8, its scales.

Choices: ``auto`` (the model's compute dtype: today's behaviour, byte for byte), ``bf16``,
``fp16``, ``fp32`` (stored in that dtype, converted to the compute dtype when read) and
``fp8_e4m3`` (``torch.float8_e4m3fn`` with scales).

fp8 scales are static, one per (layer, K or V, KV head): ``stored = clamp(x / scale, ±448)``,
``x ≈ stored * scale``. They are fixed once at engine start (engine/kv_calibration.py): one
prefill of a deterministic calibration prompt at the compute dtype, the largest |K| / |V| per
(layer, head) mapped to at most half of e4m3's range (so a later token may be 2x larger
before it saturates) and rounded up to a power of two (:func:`pow2_scales`). Powers of
two make the scales robust (a last-bit difference in the calibration's arithmetic rarely moves
one) and dequantisation exact. Static scales keep a block's bytes a function of its tokens
only: chunking, batching and which run computed it do not matter, so a hit equals the cold run.

The namespace carries the storage dtype and :func:`layout_name` (the payload layout, the
compute dtype when it differs, and a digest of the scales), so blocks of different dtypes,
scales or compute dtypes never mix.
"""

from __future__ import annotations

import hashlib
import math

import torch

from engine.config import KV_CACHE_DTYPES
from engine.errors import ConfigError

_STORAGE = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "fp8_e4m3": torch.float8_e4m3fn,
}
FP8_DTYPES = (torch.float8_e4m3fn,)
FP8_MAX = 448.0  # e4m3fn's largest finite value
# Calibrated |x| max lands at or below this (half the range: 2x headroom before saturation).
FP8_TARGET = FP8_MAX / 2
# The plain layout ([layers, 2, block_tokens, kv_heads, head_dim] in the stored dtype): the
# default of kvstore.keys.Namespace, so ``auto`` keeps today's namespaces.
PLAIN_LAYOUT = "LKTHD"
# fp8: per (layer, k/v, kv head) the head's [block_tokens, head_dim] bytes, then its fp32 scale
# (4 bytes, little-endian): payload shape [layers, 2, kv_heads, block_tokens * head_dim + 4].
SCALED_LAYOUT = "LKH(TD+f32scale)"


def storage_dtype(choice: str, compute: torch.dtype) -> torch.dtype:
    """The dtype pages hold for ``--kv-cache-dtype choice``; ConfigError naming a bad choice."""
    if choice == "auto":
        return compute
    if choice not in _STORAGE:
        raise ConfigError(f"kv_cache_dtype {choice!r} not one of {'/'.join(KV_CACHE_DTYPES)}")
    return _STORAGE[choice]


def is_scaled(dtype: torch.dtype) -> bool:
    """True for the dtypes stored with scales (fp8)."""
    return dtype in FP8_DTYPES


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def scales_digest(scales: torch.Tensor) -> str:
    """16 hex digits of the fp32 scales' bytes (``[layers, 2, kv_heads]``)."""
    raw = scales.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
    return hashlib.blake2b(raw, digest_size=8).hexdigest()


def layout_name(storage: torch.dtype, compute: torch.dtype, scales: torch.Tensor | None) -> str:
    """The namespace's layout string: ``LKTHD`` when pages hold the compute dtype (``auto``),
    else the payload layout, the compute dtype the K/V were computed in and, for fp8, the
    scheme and digest of the static scales."""
    if storage == compute and scales is None:
        return PLAIN_LAYOUT
    base = SCALED_LAYOUT if scales is not None else PLAIN_LAYOUT
    out = f"{base};compute={dtype_name(compute)}"
    if scales is not None:
        out += f";scales=static-layer-kv-head-pow2:{scales_digest(scales)}"
    return out


def pow2_scales(amax: torch.Tensor) -> torch.Tensor:
    """Scales mapping ``amax`` to at most FP8_TARGET, rounded up to a power of two (1.0 where
    amax is 0 or not finite)."""
    out = torch.ones_like(amax, dtype=torch.float32)
    for i, a in enumerate(amax.reshape(-1).tolist()):
        if a > 0 and math.isfinite(a):
            out.view(-1)[i] = 2.0 ** math.ceil(math.log2(a / FP8_TARGET))
    return out
