"""Fixtures of the vLLM connector tests. vLLM lives in a venv of its own (``.venv-vllm``,
``make vllm-venv``; its pins disagree with ``.venv``'s): each engine is a child process of
that venv's interpreter (``TIERKV_VLLM_PYTHON`` names another). Without one that can import
vLLM and the connector, every test here skips with one reason."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def vllm_python() -> str:
    py = os.environ.get("TIERKV_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")
    if not os.path.exists(py):
        pytest.skip(f"vLLM venv not built: run `make vllm-venv` (no {py})")
    probe = subprocess.run(
        [py, "-c", "import vllm, connector.vllm"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    if probe.returncode:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        pytest.skip(f"vLLM venv not usable: {py} cannot import vllm and connector.vllm ({last})")
    return py


@pytest.fixture(scope="session")
def smol_model(tmp_path_factory, vllm_python) -> str:
    """SmolLM2-135M-Instruct as a Hugging Face folder (from the offline GGUF, once)."""
    from rich.console import Console

    from connector.demo import ensure_model

    return ensure_model(
        str(tmp_path_factory.mktemp("vllm-model") / "SmolLM2-135M-Instruct"), Console(quiet=True)
    )
