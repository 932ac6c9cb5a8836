"""Admin routes for the inspection CLI (``kvstore ls/show/lookup/verify/evict``), beside the
base routes of :mod:`kvstore.daemon.admin` and behind the same auth middleware.

- ``POST /v1/verify`` ``{"keys": [hex, ...] | null, "repair": bool}``: re-check the checksum of
  every copy (every tier) of the given blocks, or of all blocks when ``keys`` is null/absent;
  with ``repair`` the corrupt copies are dropped. Answers
  ``{"checked": int, "corrupt": ["<key>@<tier>", ...], "dropped": int}``. Paged form (for a
  progress bar): ``{"after": hex|null, "limit": n, "repair": bool}`` checks the next ``n``
  stored keys after ``after`` and adds ``"total"`` (keys stored now), ``"keys"`` (keys in this
  page) and ``"next"`` (the
  ``after`` of the next page, null at the end).
- ``POST /v1/lookup`` ``{"keys": [hex, ...]}``: per key, in order,
  ``{"key", "tier": str|null, "tiers": [...], "payload_len": int|null, "pinned": bool}``
  (``tier`` is the highest tier holding it, where a read would be served from).
- ``POST /v1/evict`` ``{"namespace": hex}``: delete every block of a namespace from every
  tier; answers ``{"deleted": int}``.

At most ``MAX_KEYS`` keys per request; bad input is a 400 naming the field.
"""

from __future__ import annotations

import heapq
import json
import logging
import sys
from typing import Any

from aiohttp import web

from kvstore.daemon.logs import kv
from kvstore.errors import KeyFormatError
from kvstore.keys import BlockKey

log = logging.getLogger("kvstore.daemon.admin")
MAX_KEYS = 10000
_DELETE_CHUNK = 1000


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        doc = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise web.HTTPBadRequest(text=f"body: not JSON: {exc}") from exc
    except RecursionError:  # json's decoder recurses per nesting level
        raise web.HTTPBadRequest(text="body: JSON nested too deeply") from None
    if not isinstance(doc, dict):
        raise web.HTTPBadRequest(text="body: expected a JSON object")
    return doc


def _keys(value: Any, field: str) -> list[BlockKey]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise web.HTTPBadRequest(text=f"{field}: expected a list of hex block keys")
    if len(value) > MAX_KEYS:
        raise web.HTTPBadRequest(text=f"{field}: at most {MAX_KEYS} keys per request, got {len(value)}")
    try:
        return [BlockKey.from_hex(v) for v in value]
    except KeyFormatError as exc:
        raise web.HTTPBadRequest(text=f"{field}: {exc}") from exc


def _page(node, doc: dict[str, Any]) -> tuple[list[BlockKey], dict[str, Any]]:
    """The next ``limit`` stored keys (every tier, key order) after ``after``."""
    limit = doc["limit"]
    if not isinstance(limit, int) or not 1 <= limit <= MAX_KEYS:
        raise web.HTTPBadRequest(text=f"limit: expected an integer in [1, {MAX_KEYS}], got {limit!r}")
    after = doc.get("after")
    try:
        lo = BlockKey.from_hex(after).raw if after else b""
    except (KeyFormatError, TypeError) as exc:
        raise web.HTTPBadRequest(text=f"after: {exc}") from exc
    stored = {k for t in node.tiers for k in t.keys()}  # noqa: SIM118 - tiers are not dicts
    keys = heapq.nsmallest(limit, (k for k in stored if k > lo))
    nxt = keys[-1].hex() if len(keys) == limit else None
    return [BlockKey(k) for k in keys], {"total": len(stored), "keys": len(keys), "next": nxt}


def add_inspect_routes(app: web.Application, node_of) -> None:
    """Register the inspection routes on ``app`` (``node_of()``: the NodeStore; the app
    answers 503 before these run while it is None; loop thread only)."""

    async def verify(request: web.Request) -> web.Response:
        doc = await _body(request)
        repair = doc.get("repair", False)
        if not isinstance(repair, bool):
            raise web.HTTPBadRequest(text=f"repair: expected true or false, got {repair!r}")
        page: dict[str, Any] = {}
        if doc.get("keys") is not None:
            keys = _keys(doc["keys"], "keys")
        elif doc.get("limit") is not None:
            keys, page = _page(node_of(), doc)
        else:
            keys = None
        out = {**await node_of().inspector.verify(keys, repair=repair), **page}
        if out["corrupt"]:
            log.warning(kv("admin_verify", corrupt=len(out["corrupt"]), dropped=out["dropped"]))
        return web.json_response(out)

    async def lookup(request: web.Request) -> web.Response:
        doc = await _body(request)
        keys = _keys(doc.get("keys"), "keys")
        tops = await node_of().contains(keys)
        rows = []
        for key, top in zip(keys, tops):
            row: dict[str, Any] = {"key": key.hex, "tier": top, "tiers": [], "payload_len": None}
            row["pinned"] = False
            if top is not None:
                d = await node_of().inspector.describe(key)
                if d is not None:
                    _, info = d
                    row.update(tiers=list(info.tiers), payload_len=info.payload_len, pinned=info.pinned)
            rows.append(row)
        return web.json_response({"blocks": rows})

    async def evict(request: web.Request) -> web.Response:
        doc = await _body(request)
        ns_hex = doc.get("namespace")
        if not isinstance(ns_hex, str):
            raise web.HTTPBadRequest(text="namespace: expected a hex namespace id")
        try:
            ns = BlockKey.from_hex(ns_hex)
        except KeyFormatError as exc:
            raise web.HTTPBadRequest(text=f"namespace: {exc}") from exc
        infos = await node_of().inspector.list_blocks(namespace=ns, limit=sys.maxsize)
        keys = [i.key for i in infos]
        deleted = 0
        for off in range(0, len(keys), _DELETE_CHUNK):
            deleted += sum(await node_of().delete(keys[off : off + _DELETE_CHUNK]))
        log.info(kv("admin_evict", namespace=ns.hex, deleted=deleted))
        return web.json_response({"deleted": deleted})

    app.add_routes(
        [
            web.post("/v1/verify", verify),
            web.post("/v1/lookup", lookup),
            web.post("/v1/evict", evict),
        ]
    )
