"""The launch plan of the paged-attention kernel (engine/triton_paged.py): tile sizes, how a
step's queries are cut into tiles and how the keys are split (split-K). No Triton here: plans
are plain tensors and integers, built once per step (or once per CUDA-graph bucket).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention_meta import AttnMetadata
from engine.errors import ConfigError


def pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class PagedKernelConfig:
    """Tile sizes and the split-K policy. ``rows``: query rows (tokens x group heads) per
    program in prefill tiles; ``block_n``: key positions per inner step; splits are used while
    programs < ``target_programs`` (about 2 x the GPU's SM count), each split at least
    ``min_split_keys`` keys."""

    rows: int = 64
    block_n: int = 64
    target_programs: int = 264
    min_split_keys: int = 256
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("rows", "block_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ConfigError(f"PagedKernelConfig.{name} must be a power of two >= 16, got {v}")
        if self.target_programs < 1 or self.min_split_keys < self.block_n:
            raise ConfigError(
                f"PagedKernelConfig needs target_programs >= 1 and min_split_keys >= block_n, got "
                f"{self.target_programs}, {self.min_split_keys}"
            )


@dataclass(frozen=True)
class LaunchPlan:
    """What one step's launches share across layers (built once per step)."""

    tile_seq: torch.Tensor  # [tiles] int32: the sequence of each query tile
    tile_start: torch.Tensor  # [tiles] int32: the tile's first query index within its sequence
    block_m: int
    splits: int
    split_len: int  # keys per split, a multiple of block_n


def plan_step(
    meta: AttnMetadata, num_kv_heads: int, group: int, cfg: PagedKernelConfig, device
) -> LaunchPlan:
    """Cut the step's queries into tiles and choose the key splits."""
    gp2 = pow2(group)
    block_m = 1 if meta.is_decode_only else max(1, cfg.rows // gp2)
    seqs, starts = [], []
    for i, ql in enumerate(meta.query_lens):
        for s in range(0, ql, block_m):
            seqs.append(i)
            starts.append(s)
    splits, split_len = _split_keys(len(seqs) * num_kv_heads, meta.max_context_len, cfg)
    return LaunchPlan(
        tile_seq=torch.tensor(seqs, dtype=torch.int32, device=device),
        tile_start=torch.tensor(starts, dtype=torch.int32, device=device),
        block_m=block_m,
        splits=splits,
        split_len=split_len,
    )


def plan_decode(
    batch: int, num_kv_heads: int, max_context: int, cfg: PagedKernelConfig, device
) -> LaunchPlan:
    """A plan for any decode-only step of ``batch`` sequences of at most ``max_context``
    tokens: fixed tensors and splits, so it can be captured once in a CUDA graph and replayed
    for every step of that batch size (splits past a sequence's end exit at once)."""
    splits, split_len = _split_keys(batch * num_kv_heads, max_context, cfg)
    return LaunchPlan(
        tile_seq=torch.arange(batch, dtype=torch.int32, device=device),
        tile_start=torch.zeros(batch, dtype=torch.int32, device=device),
        block_m=1,
        splits=splits,
        split_len=split_len,
    )


def _split_keys(programs: int, max_context: int, cfg: PagedKernelConfig) -> tuple[int, int]:
    """(splits, keys per split): split while programs < target, each split >= min_split_keys."""
    splits = 1
    if programs < cfg.target_programs:
        splits = min(-(-cfg.target_programs // programs), max(1, max_context // cfg.min_split_keys))
    per = -(-max_context // splits)
    split_len = -(-per // cfg.block_n) * cfg.block_n
    return -(-max_context // split_len), split_len  # rounding may leave fewer non-empty parts
