"""A lying node against the client's batched fetch (the columns path, kvstore/client/conn.py):
a block sent under another key, blocks in another order, a payload whose checksum differs,
a reply cut short, a payload longer than the buffer. Each lie is a miss for exactly the
blocks it touches (a reply that breaks the stream: every block of it), never wrong bytes
behind a HIT, and the other blocks of the batch are HITs with their own bytes."""

from __future__ import annotations

import asyncio
import struct

import numpy as np
import pytest
from storeutil import remade
from stubpeer import frame, serve

from kvstore.block import make_header
from kvstore.client.config import ClientConfig
from kvstore.client.node import NodeClient
from kvstore.client.read import get_into
from kvstore.keys import Namespace
from kvstore.lookups import TIER_CODES
from kvstore.results import Expect, Status

NS = Namespace("lying-node", "uint8", 4)
N, SIZE = 8, 4096


def _blocks():
    keys = NS.block_keys(list(range(4 * N)))
    rng = np.random.default_rng(3)
    out = []
    for i, k in enumerate(keys):
        payload = rng.integers(0, 256, SIZE, dtype=np.uint8).tobytes()
        h = make_header(
            key=k,
            parent=keys[i - 1] if i else NS.id,
            namespace=NS.id,
            tokens=list(range(4 * i, 4 * i + 4)),
            dtype="uint8",
            shape=[SIZE],
            payload=payload,
        )
        out.append((h, payload))
    return out


BLOCKS = _blocks()


async def _node(reply) -> tuple[asyncio.AbstractServer, int]:
    """A peer that says HELLO, then answers each GET with ``reply(req) -> (entries, payload
    bytes, close_after)``."""

    def answer(h: dict):
        entries, payload, close = reply(h)
        plen = sum(e[0] == 0 and len(p) for e, p in entries)
        head = frame({"rid": h["rid"], "ok": True, **_columns([e for e, _ in entries]), "plen": plen})
        return head + payload, close

    return await serve(answer)


def _columns(entries: list) -> dict:
    """``[status, header bytes or None, tier name or None]`` per key as a GET reply's columns
    (docs/protocol.md, GET): the lies are in what the entries say, not in the framing."""
    ends, at = [], 0
    for _, raw, _ in entries:
        at += len(raw or b"")
        ends.append(at)
    return {
        "st": bytes(e[0] for e in entries),
        "tier": bytes(TIER_CODES.get(e[2], 0) for e in entries),
        "hdrs": b"".join(e[1] or b"" for e in entries),
        "hend": struct.pack(f"<{len(entries)}I", *ends),
    }


def _hit(i: int, payload: bytes | None = None):
    h, p = BLOCKS[i]
    return [0, h.encode(), "dram"], p if payload is None else payload


async def _fetch(reply, expect=None):
    server, port = await _node(reply)
    c = NodeClient(f"127.0.0.1:{port}", ClientConfig(namespaces=(NS,), op_timeout_s=2, probe_interval_s=60))
    bufs = [np.zeros(SIZE, np.uint8) for _ in BLOCKS]
    try:
        got = await get_into(c, [h.key for h, _ in BLOCKS], bufs, expect)
    finally:
        await c.close()
        server.close()
    return got, bufs


def _check(got, bufs, want: dict[int, Status]):
    """Every block is HIT with its own bytes unless ``want`` names its status."""
    assert len(got) == N
    for i, g in enumerate(got):
        assert g.status is want.get(i, Status.HIT), (i, g.status)
        if g.status is Status.HIT:
            assert bufs[i].tobytes() == BLOCKS[i][1], i
            assert g.header == BLOCKS[i][0]


@pytest.mark.parametrize("with_expect", [False, True])
async def test_each_lie_is_a_miss_for_its_own_blocks(with_expect):
    def reply(req):
        entries = [_hit(i) for i in range(N)]
        entries[1], entries[2] = entries[2], entries[1]  # two blocks in each other's place
        entries[4] = [entries[4][0], bytes([entries[4][1][0] ^ 1]) + entries[4][1][1:]]  # corrupt
        entries[6] = [[0, BLOCKS[7][0].encode(), "dram"], BLOCKS[7][1]]  # another key's block
        return [(e, p) for e, p in entries], b"".join(p for _, p in entries), False

    expect = [Expect(h.parent, h.token_bytes) for h, _ in BLOCKS] if with_expect else None
    got, bufs = await _fetch(reply, expect)
    _check(got, bufs, {1: Status.MISMATCH, 2: Status.MISMATCH, 4: Status.CORRUPT, 6: Status.MISMATCH})


async def test_a_wrong_expectation_is_a_mismatch_for_that_block_only():
    def reply(req):
        entries = [_hit(i) for i in range(N)]
        return entries, b"".join(p for _, p in entries), False

    expect = [Expect(h.parent, h.token_bytes) for h, _ in BLOCKS]
    h3 = BLOCKS[3][0]
    expect[3] = Expect(h3.parent, bytes(len(h3.token_bytes)))  # other tokens under this key
    expect[5] = Expect(BLOCKS[0][0].key, None)  # another parent
    got, bufs = await _fetch(reply, expect)
    _check(got, bufs, {3: Status.MISMATCH, 5: Status.MISMATCH})


async def test_a_reply_cut_short_is_a_miss_for_every_block_of_it():
    def reply(req):
        entries = [_hit(i) for i in range(N)]
        return entries, b"".join(p for _, p in entries)[: 5 * SIZE + 100], True

    got, bufs = await _fetch(reply)
    assert [g.status for g in got] == [Status.ERROR] * N


async def test_a_payload_longer_than_its_buffer_is_a_miss_not_an_overflow():
    big = remade(BLOCKS[2][0], bytes(2 * SIZE))  # block 2's header, twice its length

    def reply(req):
        entries = [_hit(i) for i in range(N)]
        entries[2] = ([0, big.encode(), "dram"], bytes(2 * SIZE))
        return entries, b"".join(p for _, p in entries), False

    got, bufs = await _fetch(reply)
    assert [g.status for g in got] == [Status.ERROR] * N
    assert not any(b.any() for b in bufs[3:])  # nothing landed past the refusal
