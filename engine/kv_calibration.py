"""fp8 scale calibration at engine start (the scheme: engine/kv_dtype.py's docstring): one
prefill of a deterministic calibration prompt at the compute dtype over a temporary cache,
recording the largest |K| and |V| per (layer, KV head).

Apart from engine/kv_dtype.py because it runs the model's attention over a KV cache: the
attention metadata and the cache import kv_dtype, so kv_dtype imports neither (no circle).
"""

from __future__ import annotations

import torch

from engine.attention_meta import build_metadata
from engine.attention_torch import TorchAttention
from engine.errors import ConfigError
from engine.kv_cache import KVCache
from engine.kv_dtype import pow2_scales

CALIBRATION_TOKENS = 512

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
