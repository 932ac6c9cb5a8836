"""Fixtures for daemon tests. Real ``kvstore serve`` subprocesses come from the
``start_daemon`` fixture of tests/conftest.py (tests/daemonutil.py)."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.block import make_header
from kvstore.keys import Namespace


@pytest.fixture
def ns() -> Namespace:
    return Namespace("test-model", "uint8", 4)


def make_blocks(ns: Namespace, n: int, size: int, seed: int = 0, start_token: int = 0):
    """A chain of ``n`` blocks of random payload (``size`` bytes each): [(header, payload)]."""
    rng = np.random.default_rng(seed)
    tokens = [int(t) for t in rng.integers(0, 50000, n * ns.block_tokens)]
    tokens[0] = start_token + seed
    keys = ns.block_keys(tokens)
    out, parent = [], ns.id
    for i, k in enumerate(keys):
        payload = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        toks = tokens[i * ns.block_tokens : (i + 1) * ns.block_tokens]
        out.append(
            (
                make_header(
                    key=k,
                    parent=parent,
                    namespace=ns.id,
                    tokens=toks,
                    dtype="uint8",
                    shape=[size],
                    payload=payload,
                ),
                payload,
            )
        )
        parent = k
    return out


@pytest.fixture
def blocks_of():
    return make_blocks
