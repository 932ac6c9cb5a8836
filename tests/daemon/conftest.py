"""Fixtures for daemon tests. Real ``kvstore serve`` subprocesses come from the
``start_daemon`` fixture of tests/conftest.py (tests/daemonutil.py)."""

from __future__ import annotations

import pytest
from storeutil import make_blocks

from kvstore.keys import Namespace


@pytest.fixture
def ns() -> Namespace:
    return Namespace("test-model", "uint8", 4)


@pytest.fixture
def blocks_of():
    """``blocks_of(ns, n, size, seed=0)``: a chain of ``n`` blocks of ``size`` random bytes in
    ``ns`` ([(header, payload)]), made by the suite's one block maker (tests/storeutil.py)."""
    return lambda ns, n, size, seed=0: make_blocks(n, size, seed=seed, ns=ns)
