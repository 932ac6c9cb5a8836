"""Page tables for the attention tests: each sequence's pages scattered over the pool."""

from __future__ import annotations

import torch


def scattered_tables(
    context_lens: list[int], page_size: int, spare: int, g: torch.Generator
) -> tuple[list[list[int]], int]:
    """Per sequence of ``context_lens`` tokens its page table, drawn from one random
    permutation of a pool of exactly the pages they need plus ``spare``; and that pool's size."""
    need = [-(-c // page_size) for c in context_lens]
    num_pages = sum(need) + spare
    perm = torch.randperm(num_pages, generator=g).tolist()
    tables, off = [], 0
    for n in need:
        tables.append(perm[off : off + n])
        off += n
    return tables, num_pages
