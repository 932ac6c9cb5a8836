"""Fixtures for connector tests: tiny random models (built once per session)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    from engine.convert import make_tiny_model

    made: dict[str, str] = {}

    def get(preset: str = "llama-gqa4") -> str:
        if preset not in made:
            made[preset] = make_tiny_model(tmp_path_factory.mktemp(preset), preset)
        return made[preset]

    return get
