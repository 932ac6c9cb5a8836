"""Fixtures for connector tests: tiny random models (tests/conftest.py's ``tiny_model_dir``)
and a prompt stored cold on a real daemon."""

from __future__ import annotations

import pytest
from connutil import Stored, random_prompt, store_cold


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir):
    """``tiny_model(preset="llama-gqa4") -> folder``: the suite's tiny models, by default one
    with grouped KV heads (fewer KV heads than query heads, as the block layout must handle)."""
    return lambda preset="llama-gqa4": tiny_model_dir(preset)


@pytest.fixture
def stored_prompt(tiny_model, start_daemon):
    """``await stored_prompt(n, seed, options="", **daemon_sections) -> Stored``: a daemon
    (``start_daemon(**daemon_sections)``) holding a random ``n``-token prompt stored cold by an
    engine of the default tiny model, whose connector URL is
    ``kvstore://ADDR?lookup_deadline_s=5&policy=always`` followed by ``options``."""

    async def store(n: int, seed: int, options: str = "", **daemon_sections) -> Stored:
        model_dir, daemon = tiny_model(), start_daemon(**daemon_sections)
        url = f"kvstore://{daemon.addr}?lookup_deadline_s=5&policy=always{options}"
        prompt = random_prompt(n, seed)
        ref, kv = await store_cold(model_dir, url, prompt)
        return Stored(model_dir, daemon, url, prompt, ref, kv)

    return store
