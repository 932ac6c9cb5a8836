"""The admin port's listener: the data port's kind of limits, for HTTP (docs/security.md).

aiohttp serves the admin routes, but this module accepts the connections and bounds them, as
the data port does its own: at most ``limits.admin_max_connections`` open (a newcomer is
always taken; the oldest connection of the source address holding the most is closed for
it, kvstore.daemon.admission.SourceShares), so a flood of connections costs the flooder its
own oldest ones and a liveness probe from elsewhere still gets ``/healthz``; a request's
header must be complete within ``limits.admin_header_timeout_s`` of the accept or of the
previous reply (a slowloris or idle connection is closed), and a request's body and handler
within ``limits.admin_request_timeout_s`` (a ``Content-Length`` with no body behind it is
closed); a body over ``limits.admin_max_body`` answers 413 unread. Failed accepts (EMFILE)
are logged at most 10 lines per 10 s. One timer task checks every connection's deadline
four times a second (at most ``admin_max_connections`` of them). Loop thread only.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from kvstore.daemon.admission import SourceShares
from kvstore.daemon.logs import RateLimitedLog
from kvstore.daemon.metrics import DaemonMetrics

log = logging.getLogger("kvstore.daemon.admin")
_TICK_S = 0.25


class RequestErrorLog:
    """aiohttp's request-handler logger for the admin port (``AppRunner(logger=...)``): a
    request it cannot parse (a header line over 8,190 bytes, more than 128 headers, a bad
    method) or whose handler failed is one line through the daemon's rate limit and a count
    (``tierkv_admin_request_errors_total{kind="bad_http"|"handler"}``), never a traceback: an
    unauthenticated client can send such requests as fast as the port accepts them. The
    traceback of a handler's failure is kept at DEBUG. Loop thread only."""

    def __init__(self, metrics: DaemonMetrics) -> None:
        self._metrics = metrics
        self._lines = RateLimitedLog(log)

    def exception(self, msg: str, *args: Any, exc_info: Any = True, **_: Any) -> None:
        exc = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1]
        kind = "bad_http" if isinstance(exc, HttpProcessingError) else "handler"
        self._metrics.admin_request_errors.labels(kind).inc()
        self._lines.warning(
            "admin_request_failed", kind=kind, error=type(exc).__name__, detail=f"{exc!s:.120}"
        )
        if kind == "handler" and log.isEnabledFor(logging.DEBUG):
            log.debug("admin handler failure", exc_info=exc)

    error = exception

    def warning(self, msg: str, *args: Any, **_: Any) -> None:
        self._lines.warning("admin_server", message=f"{msg % args if args else msg:.200}")

    def debug(self, msg: str, *args: Any, **kw: Any) -> None:
        exc = kw.get("exc_info")
        if isinstance(exc, BaseException):  # aiohttp's first-request bad method: counted too
            self._metrics.admin_request_errors.labels("bad_http").inc()

    info = debug

    def isEnabledFor(self, level: int) -> bool:  # noqa: N802 (logging.Logger's name)
        return level >= logging.INFO


@dataclass(eq=False)
class _Conn:
    transport: asyncio.Transport
    deadline: float  # monotonic: the header (idle) or the request deadline, whichever runs


class AdminListener:
    """Accepts on the listening ``sock``; put :attr:`middleware` first in the application (it
    moves the deadlines), then :meth:`start` it with aiohttp's protocol factory."""

    def __init__(self, sock: socket.socket, limits: Any, metrics: DaemonMetrics) -> None:
        self.server: Any = None
        self.sock = sock
        self.limits = limits
        self.metrics = metrics
        self._conns = SourceShares()  # of _Conn
        self._by_transport: dict[Any, _Conn] = {}
        self._tasks: list[asyncio.Task] = []
        self._failures = RateLimitedLog(log)
        self._dropped = RateLimitedLog(log)

        async def middleware(request: web.Request, handler):
            return await self._middleware(request, handler)

        self.middleware = web.middleware(middleware)

    def start(self, server: Any) -> None:
        """Serve ``server`` (``AppRunner.server``) on every connection accepted from now."""
        self.server = server
        self.sock.setblocking(False)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._accept_loop()), loop.create_task(self._deadlines())]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except asyncio.CancelledError:
                pass
        self.sock.close()

    async def _middleware(self, request: web.Request, handler):
        conn = self._by_transport.get(request.transport)
        if conn is not None:
            conn.deadline = time.monotonic() + self.limits.admin_request_timeout_s
        try:
            size = request.content_length
            if size is not None and size > self.limits.admin_max_body:
                raise web.HTTPRequestEntityTooLarge(
                    max_size=int(self.limits.admin_max_body), actual_size=size
                )
            return await handler(request)
        except ConnectionError:  # closed at its deadline mid-request: no traceback for it
            return web.Response(status=408, text="request deadline passed")
        finally:
            if conn is not None:  # the reply, then the next request's header, by then
                conn.deadline = time.monotonic() + self.limits.admin_header_timeout_s

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, addr = await loop.sock_accept(self.sock)
            except asyncio.CancelledError:
                raise
            except OSError as exc:  # EMFILE and friends: log (rate-limited), back off
                self._failures.warning("accept_failed", port="admin", error=exc)
                await asyncio.sleep(0.1)
                continue
            self._forget_closed()
            if len(self._conns) >= self.limits.admin_max_connections:
                victim = self._conns.victim()
                self._close(victim)
                self.metrics.refused_connections.labels("admin_limit").inc()
                self._dropped.info("dropped_connection", port="admin", why="admin_max_connections")
            try:
                transport, _ = await loop.connect_accepted_socket(self.server, sock)
            except OSError as exc:
                sock.close()
                self._failures.warning("accept_failed", port="admin", error=exc)
                continue
            conn = _Conn(transport, time.monotonic() + self.limits.admin_header_timeout_s)
            self._conns.add(conn, addr[0] if isinstance(addr, tuple) else str(addr))
            self._by_transport[transport] = conn

    async def _deadlines(self) -> None:
        while True:
            await asyncio.sleep(_TICK_S)
            now = time.monotonic()
            for conn in self._conns:
                if conn.transport.is_closing():
                    self._forget(conn)
                elif conn.deadline < now:
                    self.metrics.timeouts.labels("admin").inc()
                    self._close(conn)

    def _forget_closed(self) -> None:
        for conn in self._conns:
            if conn.transport.is_closing():
                self._forget(conn)

    def _close(self, conn: _Conn) -> None:
        conn.transport.abort()  # no lingering: a peer past its deadline gets nothing more
        self._forget(conn)

    def _forget(self, conn: _Conn) -> None:
        self._conns.remove(conn)
        self._by_transport.pop(conn.transport, None)
