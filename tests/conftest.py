"""Fixtures every test directory can use."""

from __future__ import annotations

import pytest
from daemonutil import launch_daemon


@pytest.fixture
def start_daemon(tmp_path):
    """Factory: ``start_daemon(use_disk=True, workdir=None, **sections) -> Daemon``; every
    daemon is stopped (SIGTERM, then SIGKILL) at teardown."""
    started = []

    def start(use_disk: bool = True, workdir=None, **sections):
        wd = workdir or tmp_path / f"node{len(started) + 1}"
        d = launch_daemon(wd, use_disk, **sections)
        started.append(d)
        return d

    yield start
    for d in started:
        d.stop(10)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: ``tiny_model_dir(preset="llama-tiny") -> folder`` of a random tiny model
    (engine/convert.py's PRESETS), each preset built once for the whole session. The suite's
    one tiny-model fixture: tests/connector's ``tiny_model`` and tests/cli's ``cli_model`` are
    presets of it."""
    from engine.convert import make_tiny_model

    made: dict[str, str] = {}

    def get(preset: str = "llama-tiny") -> str:
        if preset not in made:
            made[preset] = make_tiny_model(tmp_path_factory.mktemp(preset), preset)
        return made[preset]

    return get
