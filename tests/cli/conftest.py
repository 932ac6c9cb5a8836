"""Fixtures for the inspection CLI tests: run ``kvstore`` in-process (exit status, stdout,
stderr), put blocks into real daemons through the client, the tiny model folder."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import pytest

from kvstore.client.config import ClientConfig
from kvstore.client.node import NodeClient
from kvstore.keys import Namespace


@dataclass
class Result:
    code: int
    out: str
    err: str

    def json(self):
        return json.loads(self.out)


@pytest.fixture
def cli(capsys):
    """``cli(*argv) -> Result``: the ``kvstore`` console script's ``main`` in this process
    (synchronous tests only: the CLI runs its own event loop)."""
    from kvstore.cli import main

    def run(*argv) -> Result:
        capsys.readouterr()
        try:
            code = main([str(a) for a in argv])
        except SystemExit as exc:  # argparse usage errors
            code = int(exc.code or 0)
        o = capsys.readouterr()
        return Result(code, o.out, o.err)

    return run


def _put_blocks(addr: str, blocks, ns: Namespace, token: str = "") -> None:
    async def go():
        c = NodeClient(addr, ClientConfig(token=token, namespaces=(ns,)))
        try:
            res = await c.put(blocks)
            assert len(res) == len(blocks) and all(r.status.ok for r in res), res
        finally:
            await c.close()

    asyncio.run(go())


@pytest.fixture
def put_blocks():
    """``put_blocks(addr, [(header, payload)], namespace, token="")``: store through the data
    port (synchronous tests only); asserts every block was stored."""
    return _put_blocks


@pytest.fixture(scope="session")
def cli_model(tiny_model_dir) -> str:
    """The tiny Llama model folder (tests/conftest.py's ``tiny_model_dir``)."""
    return tiny_model_dir("llama-tiny")
