"""The Triton attention backend: every step (prefill chunks with or without a cached prefix,
decode, any mix) runs the paged kernel of ``engine/triton_paged.py`` once per layer, reading
K/V in place through the block table.

Runs on CUDA; on CPU only under Triton's interpreter (``TRITON_INTERPRET=1``), which is how the
tests compare it with the torch backend on a machine without a GPU.
"""

from __future__ import annotations

import os

import torch

from engine.attention_meta import AttnMetadata, PagedAttention
from engine.errors import ConfigError
from engine.triton_paged import PagedAttentionKernel
from engine.triton_plan import PagedKernelConfig


class TritonAttention(PagedAttention):
    name = "triton"

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, cfg: PagedKernelConfig | None = None
    ) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.kernel = PagedAttentionKernel(num_heads, num_kv_heads, head_dim, cfg or PagedKernelConfig())
        self.scale = self.kernel.scale

    def attend(self, q, k, v, k_cache, v_cache, meta: AttnMetadata, k_scale, v_scale) -> torch.Tensor:
        """The kernel applies fp8 scales; pages of any dtype are cast to the dot products' type
        as they are loaded."""
        q = q.contiguous()
        return self.kernel(q, k_cache, v_cache, meta, torch.empty_like(q), k_scale, v_scale)

    def decode_plans(self, batch: int, max_context: int, device) -> dict:
        """Fixed per-step plans for decode-only steps of ``batch`` sequences (CUDA graphs):
        entries for ``AttnMetadata.plans``."""
        return {self.kernel.plan_key: self.kernel.decode_plan(batch, max_context, device)}


def create(
    device: str, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> TritonAttention:
    """The backend for ``device``; ConfigError on CPU without the interpreter, ImportError
    without triton. The split-K target is sized to the GPU (2 programs per SM)."""
    if not device.startswith("cuda") and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError(
            f"attention_backend 'triton' needs a CUDA device (or TRITON_INTERPRET=1 to run it on "
            f"the CPU interpreter), got device {device!r}"
        )
    import triton  # noqa: F401  (ImportError here, not at the first step)

    cfg = PagedKernelConfig()
    if device.startswith("cuda"):
        sms = torch.cuda.get_device_properties(torch.device(device)).multi_processor_count
        cfg = PagedKernelConfig(target_programs=2 * sms)
    return TritonAttention(num_heads, num_kv_heads, head_dim, cfg)
