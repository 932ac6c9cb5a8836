"""Helpers for connector tests: prompts, engines with a connector, runs, KV of a prompt's pages."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from connector.backends import Backend
from connector.config import parse_connector_url
from connector.store_connector import StoreConnector
from engine.async_engine import AsyncEngine, connector_context
from engine.config import EngineConfig
from engine.llm import LLMEngine
from engine.sequence import SamplingParams

if TYPE_CHECKING:
    from daemonutil import Daemon

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def random_prompt(n: int, seed: int) -> list[int]:
    """``n`` token ids inside the tiny models' vocabulary; the same ``seed``, the same ids."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(6, 250, (n,), generator=g).tolist()


def engine_config(**kw) -> EngineConfig:
    base = dict(num_pages=96, max_num_batched_tokens=64)
    base.update(kw)
    return EngineConfig(**base)


def make_engine(model_dir: str, url: str, **kw) -> AsyncEngine:
    return AsyncEngine.from_model(model_dir, engine_config(**kw), url)


@contextlib.asynccontextmanager
async def open_engine(model_dir: str, url: str, **kw) -> AsyncIterator[AsyncEngine]:
    """:func:`make_engine`'s engine (not started: ``start()`` or its first request opens the
    store), stopped however the block ends."""
    aeng = make_engine(model_dir, url, **kw)
    try:
        yield aeng
    finally:
        await aeng.stop()


@contextlib.asynccontextmanager
async def sharing_store(model_dir: str, url: str, owner: AsyncEngine, **kw) -> AsyncIterator[AsyncEngine]:
    """A second engine (``engine_config(**kw)``) whose connector, configured by ``url``, uses
    ``owner``'s open store: a fresh HBM cache over the same store. Stopped however the block
    ends, leaving the store to ``owner``, which closes it."""
    eng = LLMEngine(model_dir, engine_config(**kw))
    backend = owner.connector.backend
    aeng = AsyncEngine(eng, StoreConnector(connector_context(eng), parse_connector_url(url), backend=backend))
    try:
        yield aeng
    finally:
        aeng.connector.backend = Backend()  # the shared one is closed with its owner
        await aeng.stop()


async def store_cold(model_dir: str, url: str, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """Run ``prompt`` on a fresh engine with the connector at ``url`` (nothing cached yet, the
    tokens the no-cache :func:`reference`'s: asserted) and flush until every block is saved
    (asserted): the reference tokens and the KV of its full blocks."""
    ref = reference(model_dir, prompt)
    async with open_engine(model_dir, url) as aeng:
        assert await run(aeng, prompt) == (ref, 0)
        res = await aeng.connector.flush(30)
        assert res, res
        return ref, prompt_kv(
            aeng, prompt, len(prompt) // aeng.engine.config.page_size * aeng.engine.config.page_size
        )


async def run_fresh(model_dir: str, url: str, prompt: list[int], **kw) -> tuple[list[int], int]:
    """(tokens, cached_tokens) of ``prompt`` on a fresh engine (:func:`make_engine`'s), stopped after."""
    async with open_engine(model_dir, url, **kw) as aeng:
        return await run(aeng, prompt)


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


async def assert_loads(
    aeng: AsyncEngine, prompt: list[int], ref: list[int], cold_kv: torch.Tensor, cached: int
) -> None:
    """``prompt`` on ``aeng`` gives the tokens ``ref`` with ``cached`` tokens from the store, and
    their KV is bit for bit the cold run's (``cold_kv``: [layers, K/V, tokens, heads, dim])."""
    assert await run(aeng, prompt) == (ref, cached)
    assert torch.equal(prompt_kv(aeng, prompt, cached), cold_kv[:, :, :cached]), (
        "loaded KV must be bitwise equal"
    )


def prompt_kv(aeng: AsyncEngine, prompt: list[int], n_tokens: int) -> torch.Tensor:
    """The KV the engine holds for the first ``n_tokens`` of ``prompt`` (from its prefix
    cache: the request must have finished), as one block buffer."""
    eng = aeng.engine
    ps = eng.config.page_size
    pages = eng.bm.match_prefix(prompt, n_tokens // ps)
    assert len(pages) == n_tokens // ps, f"only {len(pages)} pages cached"
    return eng.kv.gather_block(pages)


@dataclass(frozen=True)
class Stored:
    """A prompt stored cold on a daemon through the connector at ``url``."""

    model_dir: str
    daemon: Daemon
    url: str
    prompt: list[int]
    ref: list[int]  # the prompt's tokens without a cache (the cold run's, asserted)
    kv: torch.Tensor  # the cold run's KV of the prompt's full blocks
