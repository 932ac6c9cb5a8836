"""Fixtures for connector tests: tiny random models (tests/conftest.py's ``tiny_model_dir``)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir):
    """``tiny_model(preset="llama-gqa4") -> folder``: the suite's tiny models, by default one
    with grouped KV heads (fewer KV heads than query heads, as the block layout must handle)."""
    return lambda preset="llama-gqa4": tiny_model_dir(preset)
