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


@pytest.fixture
def authed_daemon(start_daemon, tmp_path):
    """``authed_daemon(tokens, use_disk=True, **sections)``: a daemon with auth on, ``tokens``
    ({token: tenant}, ``*`` the operator) in its token file; ``sections`` override config
    tables as ``start_daemon``'s do (a table given merges into the auth one)."""

    def start(tokens: dict[str, str], use_disk: bool = True, **sections):
        f = tmp_path / f"tokens{len(list(tmp_path.glob('tokens*.txt')))}.txt"
        f.write_text("".join(f"{tok} {tenant}\n" for tok, tenant in tokens.items()))
        sections = {**sections, "auth": {"token_file": str(f), **sections.get("auth", {})}}
        return start_daemon(use_disk=use_disk, **sections)

    return start
