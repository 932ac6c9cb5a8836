"""The admin port (aiohttp, JSON): health, readiness, metrics, block listing/detail, stats,
delete and pin. docs/operations.md lists every route.

With auth on, every route except ``/healthz`` and ``/readyz`` needs ``Authorization: Bearer
<token>`` of the operator tenant (``*``); anything else is 401/403 and counted. Handlers run
on the daemon's event loop and call the NodeStore directly.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric

from kvstore.daemon.admin_inspect import add_inspect_routes, hex_key
from kvstore.daemon.admin_inspect import block_json as _info
from kvstore.daemon.auth import OPERATOR, TokenTable
from kvstore.daemon.logs import kv
from kvstore.daemon.metrics import DaemonMetrics, plain
from kvstore.member.passes import PassWithdrawn
from kvstore.node.listing import LoopSlices

log = logging.getLogger("kvstore.daemon.admin")
_OPEN = ("/healthz", "/readyz")


class _OneFamily:
    """One collected metric family, as the registry ``generate_latest`` formats: a scrape's
    text is the families' texts one after the other."""

    def __init__(self, family: Metric) -> None:
        self.family = family

    def collect(self) -> list[Metric]:
        return [self.family]


def make_app(
    node_of: Callable[[], Any],
    metrics: DaemonMetrics,
    tokens: Callable[[], TokenTable],
    ready: Callable[[], bool],
    limits: Any,
    first: Any,
    orphans_of: Callable[[], Any] = lambda: None,
):
    """Build the admin application. ``node_of`` returns the NodeStore, or None while the
    daemon is still opening it (then every route but ``/healthz`` and ``/readyz`` answers
    503); ``tokens`` returns the current table (SIGHUP swaps it); ``ready`` says whether the
    data port serves (``/readyz`` 200, else 503); ``first`` is the middleware that runs
    before any other (the listener's deadlines, kvstore/daemon/admin_listener.py); a body
    is at most ``limits.admin_max_body`` bytes. ``orphans_of`` returns a cluster member's
    orphan pass (kvstore/member/orphans.py), None elsewhere (``POST /v1/orphans/pass``: 404)."""

    @web.middleware
    async def starting(request: web.Request, handler):
        if node_of() is None and request.path not in _OPEN:
            raise web.HTTPServiceUnavailable(text="the node is still opening")
        return await handler(request)

    @web.middleware
    async def auth(request: web.Request, handler):
        table = tokens()
        if table.enabled and request.path not in _OPEN:
            header = request.headers.get("Authorization", "")
            token = header[7:] if header.startswith("Bearer ") else ""
            tenant = table.tenant_of(token) if token else None
            if tenant != OPERATOR:
                metrics.auth_failures.labels("admin").inc()
                log.info(kv("refused", port="admin", path=request.path, peer=request.remote))
                if tenant is None:
                    raise web.HTTPUnauthorized(text="a valid operator token is required")
                raise web.HTTPForbidden(text="tenant tokens cannot use the admin API")
        return await handler(request)

    async def healthz(request):
        return web.json_response({"ok": True})

    async def readyz(request):
        ok = ready()
        return web.json_response({"ready": ok}, status=200 if ok else 503)

    # Both read the node on the loop (bounded: per tenant, the top namespaces) and make their
    # text there too, a family at a time with the loop served between (LoopSlices): a worker
    # thread formatting text holds the interpreter lock the loop needs for up to the switch
    # interval (5 ms) at a time, longer than a data-port round trip
    async def metrics_route(request):
        slices = LoopSlices()
        parts = []
        for family in metrics.registry.collect():  # each collector runs as it is reached
            parts.append(generate_latest(_OneFamily(family)))  # type: ignore[arg-type]
            await slices.tick()
        return web.Response(body=b"".join(parts), content_type="text/plain", charset="utf-8")

    async def stats(request):
        slices = LoopSlices()
        out = plain(node_of().inspector.stats())
        await slices.rest()
        out["daemon"] = metrics.snapshot()
        await slices.rest()
        return web.Response(body=json.dumps(out), content_type="application/json")

    async def block(request):
        key = hex_key(request.match_info["key"], "key")
        d = await node_of().inspector.describe(key)
        if d is None:
            raise web.HTTPNotFound(text=f"block {key.hex} is not stored")
        hdr, info = d
        return web.json_response(
            {
                **_info(info),
                "header": {
                    "parent": hdr.parent.hex,
                    "dtype": hdr.dtype,
                    "shape": list(hdr.shape),
                    "checksum": f"{hdr.checksum:016x}",
                    "tokens": hdr.tokens,
                    "version": hdr.version,
                },
            }
        )

    async def delete(request):
        key = hex_key(request.match_info["key"], "key")
        (ok,) = await node_of().delete([key], by=OPERATOR)  # the operator's, in tombstones
        log.info(kv("admin_delete", key=key.hex, deleted=ok))
        if not ok:
            raise web.HTTPNotFound(text=f"block {key.hex} is not stored (or is leased)")
        return web.json_response({"deleted": True})

    async def pin(request):
        key = hex_key(request.match_info["key"], "key")
        if request.method == "DELETE":
            (ok,) = node_of().state.unpin([key])
        else:
            (ok,) = node_of().state.pin([key])
        if not ok:
            raise web.HTTPNotFound(text=f"block {key.hex} is not stored")
        return web.json_response({"pinned": request.method != "DELETE"})

    async def orphan_pass(request):
        op = orphans_of()
        if op is None:
            raise web.HTTPNotFound(text="no orphan pass: this node is not a cluster member")
        try:  # joins a pass under way; a request cut off stops it unless another joined
            return web.json_response(await op.sweep(gone=lambda: request.transport is None))
        except PassWithdrawn:
            raise web.HTTPRequestTimeout(text="the request was cut off before the pass ended") from None

    app = web.Application(middlewares=[first, auth, starting], client_max_size=int(limits.admin_max_body))
    app.add_routes(
        [
            web.get("/healthz", healthz),
            web.get("/readyz", readyz),
            web.get("/metrics", metrics_route),
            web.get("/v1/stats", stats),
            web.get("/v1/blocks/{key}", block),
            web.delete("/v1/blocks/{key}", delete),
            web.post("/v1/blocks/{key}/pin", pin),
            web.delete("/v1/blocks/{key}/pin", pin),
        ]
    )
    app.add_routes([web.post("/v1/orphans/pass", orphan_pass)])
    add_inspect_routes(app, node_of)  # listing, verify, lookup, evict (kvstore/daemon/admin_inspect.py)
    return app
