"""How many keys one EXISTS carries (docs/protocol.md, HELLO ``exists_keys``): the client
sends at most what the node said in HELLO, and at most its own MAX_EXISTS_KEYS whatever a
node says; a node that does not say (one from before the field) gets at most MAX_BATCH keys
a request; a node that says something malformed is refused at HELLO; an EXISTS reply with a
code byte out of range (anywhere in a long reply) is refused. Each case against a stub peer
that speaks just enough of the protocol and records what it was asked."""

from __future__ import annotations

import pytest
from stubpeer import frame, serve

from kvstore import protocol as P
from kvstore.client.config import ClientConfig
from kvstore.client.node import NodeClient
from kvstore.keys import KeyBatch


def _codes_of(raw: bytes) -> bytes:
    """The stub's answer: key ``i``'s code is its first byte mod 4 (so order is checked)."""
    return bytes(b % 4 for b in raw[::16])


async def _stub(exists_keys, limit: int | None = None, answer=None):
    """A peer: HELLO ok (with ``exists_keys`` when not None), then EXISTS answered per key
    by ``_codes_of`` (or ``answer(keys)``), refused as a node of that ``limit`` would when
    over it. Returns (server, port, sizes asked)."""
    asked: list[int] = []

    def reply(h: dict):
        if h["op"] != "EXISTS":
            return None
        keys = h["keys"]
        asked.append(len(keys) // 16)
        if limit is not None and len(keys) // 16 > limit:
            err = f"keys: a batch of {len(keys) // 16} keys, at most {limit} keys"
            return frame({"rid": h["rid"], "ok": False, "code": P.BAD_REQUEST, "err": err}), False
        tiers = answer(keys) if answer else _codes_of(keys)
        return frame({"rid": h["rid"], "ok": True, "tiers": tiers}), False

    server, port = await serve(reply, None if exists_keys is None else {"exists_keys": exists_keys})
    return server, port, asked


def _keys(n: int, seed: int) -> KeyBatch:
    import random

    return KeyBatch(random.Random(seed).randbytes(16 * n))


def _client(port: int, ns) -> NodeClient:
    return NodeClient(
        f"127.0.0.1:{port}", ClientConfig(namespaces=(ns,), op_timeout_s=5, probe_interval_s=60)
    )


async def test_a_node_that_does_not_say_gets_at_most_max_batch_keys_a_request(ns):
    """An old node (no ``exists_keys`` in HELLO, refusing more than 4096 keys as it would)
    answers a long lookup right: the client cut it in requests it takes."""
    server, port, asked = await _stub(None, limit=P.MAX_BATCH)
    keys = _keys(2 * P.MAX_BATCH + 5, 1)
    c = _client(port, ns)
    try:
        assert (await c.lookup(keys)).tiers == _codes_of(keys.raw)
        assert asked == [P.MAX_BATCH, P.MAX_BATCH, 5]
        assert c.counters["errors"] == 0
    finally:
        await c.close()
        server.close()


async def test_a_node_is_asked_as_many_keys_as_it_says_and_no_more_than_the_client_sends(ns):
    keys = _keys(P.MAX_EXISTS_KEYS + 10, 2)
    for says, parts in ((8192, [8192, 8192, 10]), (1 << 40, [P.MAX_EXISTS_KEYS, 10])):
        server, port, asked = await _stub(says)
        c = _client(port, ns)
        try:
            assert (await c.lookup(keys)).tiers == _codes_of(keys.raw)
            assert asked == parts, (says, asked)
        finally:
            await c.close()
            server.close()


@pytest.mark.parametrize("says", [0, -1, "many", 1.5, True, 1, P.MAX_BATCH - 1])
async def test_a_node_that_says_a_malformed_limit_is_refused_at_hello(ns, says):
    """Its connection fails with one error naming the field; the lookup answers absent. Below
    MAX_BATCH is malformed too: every node of this protocol takes that many, and a node that
    said 1 would turn one lookup into thousands of round trips on the engine's loop."""
    server, port, asked = await _stub(says)
    c = _client(port, ns)
    try:
        keys = _keys(10, 3)
        assert (await c.lookup(keys)).tiers == bytes(10)
        assert asked == []  # never asked: the HELLO reply failed the connection
        assert c.counters["errors"] == 1
    finally:
        await c.close()
        server.close()
    with pytest.raises(P.ProtocolError, match="exists_keys"):
        P.HelloReply.from_wire(
            {
                "rid": 0,
                "ok": True,
                "v": P.PROTOCOL_VERSION,
                "tenant": "",
                "salt": "",
                "ns": [],
                "exists_keys": says,
            }
        )


@pytest.mark.parametrize("at", [0, 8191, 16383])
async def test_a_long_exists_reply_with_one_code_out_of_range_is_refused(ns, at):
    """A lying node: one byte over the top code anywhere in a reply of 16,384 codes."""

    def lie(raw: bytes) -> bytes:
        codes = bytearray(_codes_of(raw))
        codes[at] = 4
        return bytes(codes)

    server, port, asked = await _stub(P.MAX_EXISTS_KEYS, answer=lie)
    c = _client(port, ns)
    try:
        assert (await c.lookup(_keys(P.MAX_EXISTS_KEYS, 4))).tiers == bytes(P.MAX_EXISTS_KEYS)
        assert asked == [P.MAX_EXISTS_KEYS] and c.counters["errors"] == 1
    finally:
        await c.close()
        server.close()
    with pytest.raises(P.ProtocolError, match=f"tiers\\[{at}\\] is 4"):
        P.ExistsReply.from_wire(
            {"rid": 1, "ok": True, "tiers": lie(_keys(P.MAX_EXISTS_KEYS, 4).raw)}, P.MAX_EXISTS_KEYS
        )
