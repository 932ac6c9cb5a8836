"""Fixtures for the single-node store tests: real tiers over tmp dirs, nothing mocked."""

from __future__ import annotations

import sys

import pytest
from storeutil import make_cfg

from kvstore.node.store import NodeStore


@pytest.fixture
async def node(tmp_path):
    n = await NodeStore.open(make_cfg(tmp_path))
    yield n
    n.check()
    await n.close()


@pytest.fixture
def cfg_factory(tmp_path):
    return lambda **kw: make_cfg(tmp_path, **kw)


@pytest.fixture
def busy_gil():
    """The interpreter switches threads every microsecond: a race between the event loop and
    a worker thread (a cancelled transfer still copying) shows up within a test's run."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)
