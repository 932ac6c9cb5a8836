"""A TCP proxy in front of a real daemon that makes the path to it slow in the ways a busy
host does: the node's first reply (the HELLO answer) late by ``hello_delay_s``, every later
reply late by ``reply_delay_s``, and the bytes towards the node at most ``rate`` bytes/s.
Runs on the test's event loop, on an ephemeral loopback port."""

from __future__ import annotations

import asyncio
import contextlib


class SlowProxy:
    def __init__(
        self, target: str, hello_delay_s: float = 0.0, reply_delay_s: float = 0.0, rate: float = 0.0
    ) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host, int(port))
        self.hello_delay_s = hello_delay_s
        self.reply_delay_s = reply_delay_s
        self.rate = rate
        self.server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> SlowProxy:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        return self

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _conn(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        nr, nw = await asyncio.open_connection(*self.target)
        up = asyncio.create_task(self._pump(cr, nw, towards_node=True))
        down = asyncio.create_task(self._pump(nr, cw, towards_node=False))
        self._tasks |= {up, down}
        await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
        for t in (up, down):
            t.cancel()
        for w in (cw, nw):
            w.close()

    async def _pump(self, r: asyncio.StreamReader, w: asyncio.StreamWriter, towards_node: bool) -> None:
        first = True
        with contextlib.suppress(ConnectionError, asyncio.CancelledError):
            while data := await r.read(1 << 16):
                if towards_node and self.rate:
                    await asyncio.sleep(len(data) / self.rate)
                elif not towards_node and first and self.hello_delay_s:
                    await asyncio.sleep(self.hello_delay_s)
                elif not towards_node and self.reply_delay_s:
                    await asyncio.sleep(self.reply_delay_s)
                first = False
                w.write(data)
                await w.drain()

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        if self.server is not None:
            self.server.close()
