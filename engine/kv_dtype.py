"""The KV cache's storage dtype (``--kv-cache-dtype``) and, for fp8, its scales.

Choices: ``auto`` (the model's compute dtype: today's behaviour, byte for byte), ``bf16``,
``fp16``, ``fp32`` (stored in that dtype, converted to the compute dtype when read) and
``fp8_e4m3`` (``torch.float8_e4m3fn`` with scales).

fp8 scales are static, one per (layer, K or V, KV head): ``stored = clamp(x / scale, ±448)``,
``x ≈ stored * scale``. They are fixed once at engine start by :func:`calibrate_scales`: one
prefill of a deterministic calibration prompt (:func:`calibration_tokens`) at the compute
dtype, the largest |K| / |V| per (layer, head) mapped to at most half of e4m3's range (so a
later token may be 2x larger before it saturates) and rounded up to a power of two. Powers of
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
CALIBRATION_TOKENS = 512
# The plain layout ([layers, 2, block_tokens, kv_heads, head_dim] in the stored dtype): the
# default of kvstore.keys.Namespace, so ``auto`` keeps today's namespaces.
PLAIN_LAYOUT = "LKTHD"
# fp8: per (layer, k/v, kv head) the head's [block_tokens, head_dim] bytes, then its fp32 scale
# (4 bytes, little-endian): payload shape [layers, 2, kv_heads, block_tokens * head_dim + 4].
SCALED_LAYOUT = "LKH(TD+f32scale)"

# A calibration text of ordinary prose, lists, numbers and code (written for this project).
_CALIBRATION_TEXT = """\
The harbour town woke slowly. Fishing boats came in before seven, their nets heavy with
mackerel, and the market opened at eight: bread, cheese, three kinds of olives, lemons from
the hills. Prices in 2024 were 1.20 for a loaf, 4.50 for a kilo of fish, 0.80 for coffee.
Q: How many boats came in on Tuesday? A: Eleven, two fewer than on Monday.
def mean(xs):
    return sum(xs) / len(xs) if xs else 0.0
for i in range(10):
    print(i, mean([i, i * 2, i ** 2]))
1. Read the instructions. 2. Check the parts: 4 screws, 2 panels, 1 hinge. 3. Assemble.
"Where are you going?" she asked. "To the lighthouse," he said, "before the storm."
SELECT name, count(*) FROM orders WHERE total > 100 GROUP BY name ORDER BY 2 DESC;
"""


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


def calibration_tokens(encode, vocab_size: int, n: int = CALIBRATION_TOKENS) -> list[int]:
    """``n`` calibration token ids: the built-in text through ``encode`` (text -> ids), repeated;
    without a tokenizer (``encode`` None) a fixed pseudo-random sequence over the vocabulary."""
    if encode is not None:
        ids = [t for t in encode(_CALIBRATION_TEXT) if 0 <= t < vocab_size]
        if ids:
            return (ids * (n // len(ids) + 1))[:n]
    x, out = 12345, []
    for _ in range(n):  # an LCG: the same ids in every process
        x = (1103515245 * x + 12345) % (1 << 31)
        out.append(x % vocab_size)
    return out


def pow2_scales(amax: torch.Tensor) -> torch.Tensor:
    """Scales mapping ``amax`` to at most FP8_TARGET, rounded up to a power of two (1.0 where
    amax is 0 or not finite)."""
    out = torch.ones_like(amax, dtype=torch.float32)
    for i, a in enumerate(amax.reshape(-1).tolist()):
        if a > 0 and math.isfinite(a):
            out.view(-1)[i] = 2.0 ** math.ceil(math.log2(a / FP8_TARGET))
    return out


class _AmaxRecorder:
    """Wraps an attention backend and records max |K| and |V| per KV head of each layer call."""

    def __init__(self, inner, num_layers: int, num_kv_heads: int) -> None:
        self.inner, self.name = inner, "calibration"
        self.amax = torch.zeros(num_layers, 2, num_kv_heads, dtype=torch.float32)
        self.calls = 0

    def forward(self, q, k, v, k_cache, v_cache, meta, k_scale=None, v_scale=None):
        layer = self.calls % self.amax.shape[0]
        self.calls += 1
        self.amax[layer, 0] = torch.maximum(self.amax[layer, 0], k.float().abs().amax(dim=(0, 2)).cpu())
        self.amax[layer, 1] = torch.maximum(self.amax[layer, 1], v.float().abs().amax(dim=(0, 2)).cpu())
        return self.inner.forward(q, k, v, k_cache, v_cache, meta)


def calibrate_scales(model, tokens: list[int], device: str, dtype: torch.dtype) -> torch.Tensor:
    """Static fp8 scales ``[layers, 2, kv_heads]`` (fp32, on the CPU) of ``model``: one prefill
    of ``tokens`` over a temporary cache in the compute ``dtype`` (see the module docstring)."""
    from engine.attention_meta import build_metadata
    from engine.attention_torch import TorchAttention
    from engine.kv_cache import KVCache

    cfg = model.cfg
    n = min(len(tokens), model.rope_cos.shape[0])
    if n < 1:
        raise ConfigError("fp8 calibration needs at least one token")
    ps = 16
    pages = -(-n // ps)
    kv = KVCache(cfg.num_layers, pages, ps, cfg.num_kv_heads, cfg.head_dim, dtype, device)
    rec = _AmaxRecorder(
        TorchAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim), cfg.num_layers, cfg.num_kv_heads
    )
    meta = build_metadata([n], [n], [list(range(pages))], ps, device)
    ids = torch.tensor(tokens[:n], dtype=torch.int64, device=device)
    pos = torch.arange(n, dtype=torch.int64, device=device)
    model(ids, pos, kv.layers(), meta, rec, torch.tensor([n - 1], device=device))  # inference mode
    return pow2_scales(rec.amax)  # an ordinary tensor (not an inference one): usable anywhere
