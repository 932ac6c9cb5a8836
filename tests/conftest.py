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
