"""A stub peer of the data port for client tests: it speaks just the framing (a 4-byte
big-endian length, then a msgpack header; payload bytes after it where the reply says so),
says HELLO ok, and answers every other request with what the test's ``answer`` returns. For
peers that lie, or speak an older version: never a stand-in for our own daemon, whose
behaviour tests check against real `kvstore serve` daemons (tests/daemonutil.py)."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Awaitable, Callable

import msgpack

from kvstore import protocol as P


def frame(h: dict) -> bytes:
    """One framed header."""
    body = msgpack.packb(h, use_bin_type=True)
    return struct.pack(">I", len(body)) + body


async def serve(
    answer: Callable[[dict], tuple[bytes, bool] | None], hello: dict | None = None
) -> tuple[asyncio.AbstractServer, int]:
    """A listening stub on a loopback port chosen now: (server, port). HELLO is answered ok
    (protocol version, no tenant, no namespaces, a 64 MiB frame limit; ``hello`` adds or
    replaces fields); any other request ``h`` with ``answer(h)``: (bytes to write, close the
    connection after them), or None to write nothing."""

    async def reply(h: dict, writer: asyncio.StreamWriter) -> bool:
        out = answer(h)
        if out is None:
            return False
        data, close = out
        writer.write(data)
        return close

    return await serve_with(reply, hello)


async def serve_with(
    behaviour: Callable[[dict, asyncio.StreamWriter], Awaitable[bool | None]], hello: dict | None = None
) -> tuple[asyncio.AbstractServer, int]:
    """:func:`serve` for a stub that writes as it goes (parts, pauses): every request ``h``
    but HELLO (its payload, if any, read and dropped) is ``await behaviour(h, writer)``, which
    returns True to close the connection after what it wrote."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                (n,) = struct.unpack(">I", await reader.readexactly(4))
                h = msgpack.unpackb(await reader.readexactly(n), raw=False)
                if h.get("plen"):
                    await reader.readexactly(h["plen"])
                if h["op"] == "HELLO":
                    welcome = {"rid": h["rid"], "ok": True, "v": P.PROTOCOL_VERSION, "tenant": "", "salt": ""}
                    writer.write(frame({**welcome, "ns": [], "max_frame": 1 << 26, **(hello or {})}))
                elif await behaviour(h, writer):
                    await writer.drain()
                    writer.close()
                    return
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]
