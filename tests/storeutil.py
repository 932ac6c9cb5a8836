"""Helpers for the store tests: configs over tmp dirs and chained random blocks."""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import AsyncIterator
from typing import Protocol, TypeVar

from kvstore.block import BlockHeader, make_header
from kvstore.config import load_store_config
from kvstore.keys import Namespace

MiB = 1 << 20


def make_cfg(tmp_path, **overrides):
    base = {
        "disk.path": str(tmp_path / "disk"),
        "dram.capacity": "8MiB",
        "dram.slab_size": "1MiB",
        "disk.capacity": "64MiB",
        "disk.sync": False,
    }
    base.update({k.replace("__", "."): v for k, v in overrides.items()})
    return load_store_config(None, base, env={})


def make_blocks(
    n: int,
    nbytes: int = 256 * 1024,
    block_tokens: int = 4,
    seed: int = 0,
    ns: Namespace | None = None,
    tokens: list[int] | None = None,
):
    """``n`` chained blocks of ``nbytes`` random payload each, in namespace ``ns`` (default: a
    float16 one of ``block_tokens`` tokens a block; a given ``ns`` brings its own): a list of
    (header, payload bytes). The blocks hold random tokens, or the first ``n`` blocks of
    ``tokens`` (a prompt's, so a lookup of that prompt finds them). The same ``seed`` makes the
    same blocks. The suite's one block maker (tests/daemon's ``blocks_of`` fixture and
    tests/cli's prompts call it too)."""
    ns = ns or Namespace("test-model", "float16", block_tokens)
    block_tokens = ns.block_tokens
    rnd = random.Random(seed)
    if tokens is None:
        tokens = [rnd.randrange(50000) for _ in range(n * block_tokens)]
    else:
        assert len(tokens) >= n * block_tokens, f"{len(tokens)} tokens make fewer than {n} blocks"
        tokens = list(tokens[: n * block_tokens])
    keys = ns.block_keys(tokens)
    out, parent = [], ns.id
    for i, k in enumerate(keys):
        payload = rnd.randbytes(nbytes)
        h = make_header(
            key=k,
            parent=parent,
            namespace=ns.id,
            tokens=tokens[i * block_tokens : (i + 1) * block_tokens],
            dtype="uint8",
            shape=[nbytes],
            payload=payload,
        )
        out.append((h, payload))
        parent = k
    return out


async def write_all(c, blocks, deadline_s: float | None = None) -> None:
    """Write ``blocks`` (header, payload pairs) through the client ``c`` in one ``put``:
    every one stored (asserted, naming each block's status otherwise)."""
    res = await c.put(blocks, deadline_s)
    assert [r.status.ok for r in res] == [True] * len(blocks), [r.status.name for r in res]


async def read_back(c, blocks, lookup_deadline_s: float, deadline_s: float) -> tuple[int, int]:
    """Look up the longest stored prefix of ``blocks`` (header, payload pairs) through the
    client ``c`` and read it: (blocks read, up to the first that is not a HIT; of them, those
    whose bytes differ from the payload written)."""
    from kvstore.client.read import get_into
    from kvstore.results import Status

    keys = [h.key for h, _ in blocks]
    n = (await c.lookup(keys, lookup_deadline_s)).hit_blocks
    bufs = [bytearray(h.payload_len) for h, _ in blocks[:n]]
    hits = wrong = 0
    for r, b, (_, x) in zip(await get_into(c, keys[:n], bufs, None, deadline_s), bufs, blocks):
        if r.status is not Status.HIT:
            break
        wrong += bytes(b) != x
        hits += 1
    return hits, wrong


def flip_byte_in_file(path: str, needle: bytes) -> int:
    """Flip one byte inside the first occurrence of ``needle`` in ``path``; returns its offset."""
    with open(path, "r+b") as f:
        data = f.read()
        off = data.find(needle)
        assert off >= 0, "payload not found in file"
        f.seek(off + len(needle) // 2)
        b = f.read(1)
        f.seek(off + len(needle) // 2)
        f.write(bytes([b[0] ^ 0xFF]))
        f.flush()
        os.fsync(f.fileno())
    return off


def tiers_of(node, keys) -> list[str | None]:
    """Per key the highest tier of ``node`` holding it, None where absent or deleted (held
    but doomed): the node's own per-key answer (``NodeState.where``), every tenant alike."""
    return [t.name if (t := node.state.where(k.raw)) is not None else None for k in keys]


async def on_disk_only(cfg, blocks, flip: bytes | None = None):
    """A node of ``cfg`` that stored ``blocks``, closed, then reopened: its DRAM starts empty,
    so every block is on disk only (asserted; ``cfg`` must write them down: ``disk.sync``, or a
    DRAM too small for them). With ``flip``, a byte inside those bytes is flipped in the LMDB
    file before the reopen (a payload's: the block still opens, its read finds the damage)."""
    from kvstore.node.store import NodeStore

    node = await NodeStore.open(cfg)
    try:
        await node.writer.put(blocks)
    finally:
        await node.close()
    if flip is not None:
        flip_byte_in_file(f"{cfg.disk.path}/data.mdb", flip)
    node = await NodeStore.open(cfg)
    assert tiers_of(node, [h.key for h, _ in blocks]) == ["disk"] * len(blocks)
    return node


async def settle(node, deadline_s: float = 60.0) -> None:
    """Await the work ``node``'s cancelled callers left finishing (disk writes and deletes run
    on to their end): a fixed sleep for it failed on a loaded host. The deadline is a bound,
    never a measurement."""
    left = await node._finishing.drain(deadline_s)
    assert left == 0, f"{left} finishing tasks still running after {deadline_s:g} s"


class Checkable(Protocol):
    """An open node or tier: its own invariants asserted by ``check()``, ended by ``close()``."""

    def check(self) -> None: ...

    async def close(self) -> None: ...


CheckableT = TypeVar("CheckableT", bound=Checkable)


@contextlib.asynccontextmanager
async def checked(node: CheckableT) -> AsyncIterator[CheckableT]:
    """``node`` (an open ``NodeStore`` or tier) for the block: its invariants checked
    (``node.check()``) when the block ends normally, the node closed however it ends."""
    try:
        yield node
        node.check()
    finally:
        await node.close()


def remade(h: BlockHeader, payload: bytes, **fields) -> BlockHeader:
    """A header like ``h`` (its key, parent, namespace and tokens, each replaced by ``fields``)
    for ``payload`` (uint8, its length): a forged, planted or rewritten block."""
    base = {"key": h.key, "parent": h.parent, "namespace": h.namespace, "tokens": h.token_bytes}
    return make_header(**{**base, **fields}, dtype="uint8", shape=[len(payload)], payload=payload)
