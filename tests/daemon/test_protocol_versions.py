"""A tierkv client meeting a node of another protocol version fails that connection with one
error naming both versions, and its calls answer as misses (never raise). The version-3 node
is the reply a version-3 daemon gives (its HELLO check, verbatim), served from a socket here:
no daemon of that version exists in this tree (version 4: a GET carries keys only and is
answered in columns, which a version-3 peer cannot read). The other direction (a client of another
version against this daemon) is in test_protocol_independent_client.py."""

from __future__ import annotations

import asyncio
import struct

import msgpack
import pytest

from kvstore import protocol as P
from kvstore.client.config import ClientConfig
from kvstore.client.conn import Conn, NodeRefused
from kvstore.client.node import NodeClient
from kvstore.keys import BlockKey, Namespace

NS = Namespace("version-model", "uint8", 4)


def _frame(h: dict) -> bytes:
    body = msgpack.packb(h, use_bin_type=True)
    return struct.pack(">I", len(body)) + body


async def _node(answer) -> tuple[asyncio.AbstractServer, int, list[dict]]:
    """A node that answers HELLO with ``answer(hello)`` and then closes; what it was sent."""
    seen: list[dict] = []

    async def serve(reader, writer):
        try:
            (n,) = struct.unpack(">I", await reader.readexactly(4))
            h = msgpack.unpackb(await reader.readexactly(n), raw=False)
            seen.append(h)
            writer.write(_frame(answer(h)))
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], seen


def _v3_refusal(h: dict) -> dict:
    # a version-3 daemon's answer to any other version (kvstore/protocol/hello.py, version 3)
    return {
        "rid": h.get("rid", 0),
        "ok": False,
        "code": "bad_version",
        "err": f"client protocol version {h.get('v')!r} is not supported (this node speaks 3)",
    }


def _v3_welcome(h: dict) -> dict:
    # a node that would accept, but says it speaks version 3
    return {"rid": h["rid"], "ok": True, "v": 3, "tenant": "", "salt": "", "ns": [], "node": "old"}


@pytest.mark.parametrize("answer, says", [(_v3_refusal, "node speaks 3"), (_v3_welcome, "version 3 is")])
async def test_a_node_of_another_version_is_one_error_naming_both(answer, says):
    server, port, seen = await _node(answer)
    try:
        with pytest.raises((NodeRefused, P.ProtocolError)) as info:
            await Conn.open("127.0.0.1", port, "", None, [NS])
        text = str(info.value)
        assert info.value.code == P.BAD_VERSION
        assert says in text and f"client speaks {P.PROTOCOL_VERSION}" in text, text
        assert seen and seen[0]["op"] == "HELLO" and seen[0]["v"] == P.PROTOCOL_VERSION == 4
        # the node client: a miss per key, the node down, the reason logged once
        c = NodeClient(f"127.0.0.1:{port}", ClientConfig(namespaces=(NS,), transport="tcp"))
        try:
            assert (await c.lookup([BlockKey(bytes(16)), BlockKey(b"\x01" * 16)])).names() == [None, None]
            assert (await c.lookup(P.ExistsRequest(0, (BlockKey(bytes(16)),)).keys)).tiers == b"\x00"
            assert not c.up and c.counters["node_down"] == 1
        finally:
            await c.close()
    finally:
        server.close()
        await server.wait_closed()
