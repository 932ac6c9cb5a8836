"""Admin routes for the inspection CLI (``kvstore ls/show/lookup/verify/evict``), beside the
base routes of :mod:`kvstore.daemon.admin` and behind the same auth middleware.

- ``GET /v1/blocks?tier=&namespace=&after=&limit=``: one page of blocks in key order,
  ``{"blocks": [...], "next": hex|null}``. ``next`` is the cursor of the next page (the last
  key this page looked at); a page may be short, even empty, and not be the last: only
  ``next`` null ends a listing, and a listing followed to its end holds every block stored
  for its whole duration (kvstore/node/listing.py).
- ``POST /v1/verify`` ``{"keys": [hex, ...] | null, "repair": bool}``: re-check the checksum of
  every copy (every tier) of the given blocks, or of all blocks when ``keys`` is null/absent;
  with ``repair`` the corrupt copies are dropped. Answers
  ``{"checked": int, "corrupt": ["<key>@<tier>", ...], "dropped": int}``. Paged form (for a
  progress bar): ``{"after": hex|null, "limit": n, "repair": bool}`` checks the next ``n``
  keys of the key order after the cursor ``after`` (those still stored) and adds ``"total"``
  (keys stored when the pass began), ``"keys"`` (keys checked in this page) and ``"next"``
  (the cursor of the next page, null only at the end).
- ``POST /v1/lookup`` ``{"keys": [hex, ...]}``: per key, in order,
  ``{"key", "tier": str|null, "tiers": [...], "payload_len": int|null, "pinned": bool}``
  (``tier`` is the highest tier holding it, where a read would be served from).
- ``POST /v1/evict`` ``{"namespace": hex}``: delete every block of a namespace from every
  tier; answers ``{"deleted": int}``.

At most ``MAX_KEYS`` keys per request; bad input is a 400 naming the field. Every route runs
on the daemon's event loop in slices (kvstore.node.listing.LoopSlices): a listing, a verify or
an evict of a large node never holds the data port for more than a slice, and a page's
body is sent in pieces of ``_SEND_ROWS`` rows (a page of 10,000 rows is ~2.5 MB of JSON:
made or sent in one step it would hold the loop for milliseconds).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
from typing import Any

from aiohttp import web

from kvstore.daemon.auth import OPERATOR
from kvstore.daemon.logs import kv
from kvstore.errors import KeyFormatError
from kvstore.keys import BlockKey
from kvstore.node.listing import LoopSlices
from kvstore.results import BlockInfo

log = logging.getLogger("kvstore.daemon.admin")
MAX_KEYS = 10000
_EVICT_PAGE = 1000  # blocks an evict lists at a time, each page deleted before the next
_DELETE_CHUNK = 32  # blocks deleted per call (~0.4 ms: a delete of 1,000 held the loop ~5 ms)
_TIERS = ("hbm", "dram", "disk")
_SEND_ROWS = 256  # rows of a page joined, encoded and written at a time (~64 KB)


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


def hex_key(text: Any, field: str) -> BlockKey:
    """The block key ``text`` spells in hex; 400 naming ``field`` otherwise."""
    try:
        return BlockKey.from_hex(text)
    except (KeyFormatError, TypeError) as exc:
        raise web.HTTPBadRequest(text=f"{field}: {exc}") from exc


async def _keys(value: Any, field: str) -> list[BlockKey]:
    """The hex keys of a request's list, parsed in slices (10,000 of them take milliseconds)."""
    if not isinstance(value, list):
        raise web.HTTPBadRequest(text=f"{field}: expected a list of hex block keys")
    if len(value) > MAX_KEYS:
        raise web.HTTPBadRequest(text=f"{field}: at most {MAX_KEYS} keys per request, got {len(value)}")
    out: list[BlockKey] = []
    slices = LoopSlices()
    for v in value:
        if not isinstance(v, str):
            raise web.HTTPBadRequest(text=f"{field}: expected a list of hex block keys")
        out.append(hex_key(v, field))
        await slices.tick()
    return out


def _limit(value: Any) -> int:
    if isinstance(value, str):
        try:
            value = int(value)
        except ValueError:
            raise web.HTTPBadRequest(text=f"limit: not an integer: {value!r}") from None
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_KEYS:
        raise web.HTTPBadRequest(text=f"limit: expected an integer in [1, {MAX_KEYS}], got {value!r}")
    return value


def block_json(info: BlockInfo) -> dict[str, Any]:
    """A block's row in the admin API (``GET /v1/blocks`` and ``/v1/blocks/{key}``)."""
    return {
        "key": info.key.hex,
        "namespace": info.namespace.hex,
        "tiers": list(info.tiers),
        "payload_len": info.payload_len,
        "num_tokens": info.num_tokens,
        "created": info.created,
        "last_access": info.last_access,
        "leases": info.leases,
        "pinned": info.pinned,
    }


def _float_json(x: float) -> str:
    return repr(x) if math.isfinite(x) else json.dumps(x)


# a row's tiers as JSON, made once per set of tiers (listed top first, in the stack's order)
_TIERS_JSON = {ts: json.dumps(list(ts)) for n in range(4) for ts in itertools.combinations(_TIERS, n)}


def _tiers_json(tiers: tuple[str, ...]) -> str:
    text = _TIERS_JSON.get(tiers)
    return json.dumps(list(tiers)) if text is None else text


def row_json(info: BlockInfo) -> str:
    """``json.dumps(block_json(info))``, the same text, by one format string: a listing
    makes one row per block (a third of the cost; tests/store/test_listing_pages.py holds them equal)."""
    return (
        f'{{"key": "{info.key.raw.hex()}", "namespace": "{info.namespace.raw.hex()}", '
        f'"tiers": {_tiers_json(info.tiers)}, "payload_len": {int(info.payload_len)}, '
        f'"num_tokens": {int(info.num_tokens)}, "created": {_float_json(info.created)}, '
        f'"last_access": {_float_json(info.last_access)}, "leases": {int(info.leases)}, '
        f'"pinned": {"true" if info.pinned else "false"}}}'
    )


async def send_rows(request: web.Request, head: str, rows: list[str], tail: str) -> web.StreamResponse:
    """Answer ``head``, the JSON texts ``rows`` comma-separated, then ``tail``, in pieces of
    ``_SEND_ROWS`` rows with the loop served between them (one join, encode or socket write
    of a whole page would hold it for milliseconds). A peer that stops reading holds only its
    own request, until the listener's deadline."""
    resp = web.StreamResponse(headers={"Content-Type": "application/json"})
    await resp.prepare(request)
    slices = LoopSlices()
    await resp.write(head.encode())
    for off in range(0, len(rows), _SEND_ROWS):
        piece = ("," if off else "") + ",".join(rows[off : off + _SEND_ROWS])
        await resp.write(piece.encode())  # waits while the peer's socket buffer is full
        await slices.tick()
    await resp.write(tail.encode())
    await resp.write_eof()
    return resp


def _json_or_null(value: int | str | None) -> str:
    return "null" if value is None else json.dumps(value)


def add_inspect_routes(app: web.Application, node_of) -> None:
    """Register the inspection routes on ``app`` (``node_of()``: the NodeStore; the app
    answers 503 before these run while it is None; loop thread only)."""

    async def blocks(request: web.Request) -> web.Response:
        q = request.query
        tier = q.get("tier") or None
        if tier not in (None, *_TIERS):
            raise web.HTTPBadRequest(text=f"tier: expected hbm, dram or disk, got {tier!r}")
        ns = hex_key(q["namespace"], "namespace") if q.get("namespace") else None
        after = hex_key(q["after"], "after") if q.get("after") else None
        limit = _limit(q.get("limit", "100"))
        try:
            page = await node_of().inspector.page(
                tier=tier, namespace=ns, after=after, limit=limit, row=row_json
            )
        except ValueError as exc:  # a tier this node does not have
            raise web.HTTPBadRequest(text=f"tier: {exc}") from exc
        nxt = json.dumps(None if page.next is None else page.next.hex)
        return await send_rows(request, '{"blocks": [', page.blocks, f'], "next": {nxt}}}')

    async def verify(request: web.Request) -> web.Response:
        doc = await _body(request)
        repair = doc.get("repair", False)
        if not isinstance(repair, bool):
            raise web.HTTPBadRequest(text=f"repair: expected true or false, got {repair!r}")
        page: dict[str, Any] = {}
        if doc.get("keys") is not None:
            keys = await _keys(doc["keys"], "keys")
        elif doc.get("limit") is not None:
            limit = _limit(doc["limit"])
            after = hex_key(doc["after"], "after") if doc.get("after") else None
            kp = await node_of().inspector.key_page(after, limit)
            keys = kp.keys
            page = {"total": kp.total, "keys": len(kp.keys), "next": None if kp.next is None else kp.next.hex}
        else:
            keys = None
        out = {**await node_of().inspector.verify(keys, repair=repair), **page}
        if out["corrupt"]:
            log.warning(kv("admin_verify", corrupt=len(out["corrupt"]), dropped=out["dropped"]))
        return web.json_response(out)

    async def lookup(request: web.Request) -> web.Response:
        doc = await _body(request)
        keys = await _keys(doc.get("keys"), "keys")
        rows: list[str] = []
        slices = LoopSlices()
        for key, (tiers, size, pinned) in zip(keys, await node_of().inspector.where(keys)):
            rows.append(
                f'{{"key": "{key.raw.hex()}", "tier": {_json_or_null(tiers[0] if tiers else None)}, '
                f'"tiers": {_tiers_json(tiers)}, "payload_len": {_json_or_null(size)}, '
                f'"pinned": {"true" if pinned else "false"}}}'
            )
            await slices.tick()
        return await send_rows(request, '{"blocks": [', rows, "]}")

    async def evict(request: web.Request) -> web.Response:
        doc = await _body(request)
        ns_hex = doc.get("namespace")
        if not isinstance(ns_hex, str):
            raise web.HTTPBadRequest(text="namespace: expected a hex namespace id")
        ns = hex_key(ns_hex, "namespace")
        deleted = 0
        cursor = None
        slices = LoopSlices()
        while True:  # page by page: each page's blocks deleted before the next is listed
            page = await node_of().inspector.page(namespace=ns, after=cursor, limit=_EVICT_PAGE)
            keys = [i.key for i in page.blocks]  # tombstoned as the operator's eviction
            for off in range(0, len(keys), _DELETE_CHUNK):
                deleted += sum(
                    await node_of().delete(keys[off : off + _DELETE_CHUNK], by=OPERATOR, cause="evict")
                )
                await slices.rest()
            if page.next is None:
                break
            cursor = page.next
        log.info(kv("admin_evict", namespace=ns.hex, deleted=deleted))
        return web.json_response({"deleted": deleted})

    app.add_routes(
        [
            web.get("/v1/blocks", blocks),
            web.post("/v1/verify", verify),
            web.post("/v1/lookup", lookup),
            web.post("/v1/evict", evict),
        ]
    )
