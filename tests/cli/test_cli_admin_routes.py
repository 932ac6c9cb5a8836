"""The admin routes added for the CLI (kvstore/daemon/admin_inspect.py): bad input is a 400
naming the field, and the operator-token check covers them."""

from __future__ import annotations

import aiohttp


async def test_bad_input_is_a_400_naming_the_field(start_daemon):
    d = start_daemon(use_disk=False)
    cases = [
        ("/v1/verify", {"keys": "ab"}, "keys:"),
        ("/v1/verify", {"keys": ["zz"]}, "keys:"),
        ("/v1/verify", {"repair": "yes"}, "repair:"),
        ("/v1/verify", {"limit": 0}, "limit:"),
        ("/v1/verify", {"limit": 5, "after": "nothex"}, "after:"),
        ("/v1/lookup", {}, "keys:"),
        ("/v1/lookup", {"keys": ["00" * 16] * 10001}, "at most 10000"),
        ("/v1/evict", {}, "namespace:"),
        ("/v1/evict", {"namespace": "abc"}, "namespace:"),
    ]
    async with aiohttp.ClientSession(d.admin) as s:
        for path, body, needle in cases:
            async with s.post(path, json=body) as r:
                assert r.status == 400, (path, body)
                assert needle in await r.text(), (path, body)
        async with s.post("/v1/lookup", data=b"{not json") as r:
            assert r.status == 400 and "body:" in await r.text()
        async with s.post("/v1/lookup", json={"keys": ["00" * 16]}) as r:
            assert (await r.json())["blocks"] == [
                {"key": "00" * 16, "tier": None, "tiers": [], "payload_len": None, "pinned": False}
            ]
        async with s.post("/v1/verify", json={"after": None, "limit": 10}) as r:
            assert await r.json() == {
                "checked": 0,
                "corrupt": [],
                "dropped": 0,
                "total": 0,
                "keys": 0,
                "next": None,
            }


async def test_routes_need_the_operator_token(start_daemon, tmp_path):
    f = tmp_path / "tokens"
    f.write_text("tok-operator1 *\ntok-acme-0001 acme\n")
    d = start_daemon(use_disk=False, auth={"token_file": str(f)})
    async with aiohttp.ClientSession(d.admin) as s:
        for path in ("/v1/verify", "/v1/lookup", "/v1/evict"):
            async with s.post(path, json={}) as r:
                assert r.status == 401, path
            async with s.post(path, json={}, headers={"Authorization": "Bearer tok-acme-0001"}) as r:
                assert r.status == 403, path
        async with s.post("/v1/verify", json={}, headers={"Authorization": "Bearer tok-operator1"}) as r:
            assert r.status == 200
