"""Helpers for connector tests: engines with a connector, runs, KV of a prompt's pages."""

from __future__ import annotations

import torch

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.llm import LLMEngine
from engine.sequence import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def engine_config(**kw) -> EngineConfig:
    base = dict(num_pages=96, max_num_batched_tokens=64)
    base.update(kw)
    return EngineConfig(**base)


def make_engine(model_dir: str, url: str, **kw) -> AsyncEngine:
    return AsyncEngine.from_model(model_dir, engine_config(**kw), url)


async def run(aeng: AsyncEngine, prompt: list[int], params: SamplingParams = GREEDY):
    """(tokens, cached_tokens) of one request."""
    toks, cached = [], 0
    async for out in aeng.generate(prompt, params):
        toks.append(out.token_id)
        cached = out.cached_tokens
    return toks, cached


def reference(model_dir: str, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
    eng = LLMEngine(model_dir, engine_config(enable_prefix_cache=False))
    return eng.generate([prompt], params)[0].output_tokens


def prompt_kv(aeng: AsyncEngine, prompt: list[int], n_tokens: int) -> torch.Tensor:
    """The KV the engine holds for the first ``n_tokens`` of ``prompt`` (from its prefix
    cache: the request must have finished), as one block buffer."""
    eng = aeng.engine
    ps = eng.config.page_size
    pages = eng.bm.match_prefix(prompt, n_tokens // ps)
    assert len(pages) == n_tokens // ps, f"only {len(pages)} pages cached"
    return eng.kv.gather_block(pages)
