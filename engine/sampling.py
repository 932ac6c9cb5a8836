"""Token sampling: greedy, temperature, top-k, top-p, per-request seeded generators."""

from __future__ import annotations

import torch

from engine.sequence import SamplingParams


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int]:
    """One token per row of ``logits`` ([B, vocab], fp32). Greedy rows take the argmax (ties
    to the lowest id, like transformers); the rest sample from the filtered distribution with
    the row's own generator, so a seeded request draws the same tokens in any batch."""
    out = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        # Sample on the CPU with the request's CPU generator: the same draw on every device.
        row = logits[i].float().cpu() / p.temperature
        if p.top_k > 0 and p.top_k < row.shape[-1]:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, idx = torch.sort(row, descending=True)
            probs = sorted_logits.softmax(-1)
            # drop a token once the mass before it already reaches top_p (keeps at least one)
            drop = probs.cumsum(-1) - probs >= p.top_p
            row = row.scatter(0, idx, sorted_logits.masked_fill(drop, float("-inf")))
        probs = row.softmax(-1)
        out[i] = int(torch.multinomial(probs, 1, generator=generators[i]).item())
    return out
