"""A small etcd v3 client over etcd's JSON gateway (``/v3/...`` over HTTP, aiohttp), and the
``etcd://host:port[,host:port...]/CLUSTER`` URL.

Why the gateway: it ships with every etcd 3.x server, needs no generated protobuf code and no
extra dependency (aiohttp is already ours). Keys and values are base64 in JSON; 64-bit ids
are decimal strings. Only what membership and registration need is here: range, put, delete,
lease grant/keepalive/revoke, and a streaming watch.

Every call has a timeout and tries each endpoint in turn; :class:`EtcdError` names the
endpoint and the failure (callers on the data path catch it and keep their last view).

Security (:class:`kvstore.client.etcd_security.EtcdSecurity`, the ``cluster.etcd_*`` keys): HTTPS with a CA bundle and a
client certificate, and etcd's user auth (``/v3/auth/authenticate`` gives a token sent as the
``Authorization`` header of every call; a token etcd no longer accepts is renewed once).
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvstore.address import parse_host_port
from kvstore.client.etcd_security import EtcdSecurity
from kvstore.client.membership import MembershipError
from kvstore.errors import AddressError

KEY_ROOT = "/tierkv/clusters"


class EtcdError(RuntimeError):
    """etcd did not answer or refused; names the endpoint and the operation."""


class EtcdWatchIdle(EtcdError):
    """A watch saw nothing for ``watch_idle_s``: reopened (after a fresh list) in case its
    connection died silently."""


@dataclass(frozen=True)
class EtcdTarget:
    """A parsed ``etcd://`` URL: endpoints (``host:port``) and the cluster name."""

    endpoints: tuple[str, ...]
    cluster: str

    @property
    def prefix(self) -> str:
        return f"{KEY_ROOT}/{self.cluster}/nodes/"


def parse_etcd_url(url: str) -> EtcdTarget:
    """``etcd://h:p[,h:p...]/CLUSTER`` (the scheme may be left off). MembershipError naming
    the URL when it has no endpoint, a bad endpoint, or no cluster name."""
    rest = url.removeprefix("etcd://")
    hosts, sep, cluster = rest.partition("/")
    cluster = cluster.strip("/")
    if not sep or not cluster or "/" in cluster:
        raise MembershipError(f"etcd URL {url!r}: expected etcd://host:port[,host:port...]/CLUSTER")
    endpoints = tuple(h for h in hosts.split(",") if h)
    if not endpoints:
        raise MembershipError(f"etcd URL {url!r}: no host:port")
    for e in endpoints:
        try:
            parse_host_port(e, "endpoint")
        except AddressError as exc:
            raise MembershipError(f"etcd URL {url!r}: {exc}") from exc
    return EtcdTarget(endpoints, cluster)


def b64(s: str | bytes) -> str:
    return base64.b64encode(s.encode() if isinstance(s, str) else s).decode()


def unb64(s: str) -> bytes:
    return base64.b64decode(s)


def prefix_end(prefix: str) -> str:
    """The range end covering every key that starts with ``prefix`` (ASCII prefixes)."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


class EtcdClient:
    """Bound to the event loop of its first call. ``timeout_s`` bounds each unary call."""

    def __init__(
        self,
        endpoints: tuple[str, ...],
        timeout_s: float = 2.0,
        watch_idle_s: float = 60.0,
        security: EtcdSecurity | None = None,
    ) -> None:
        self.endpoints = endpoints
        self.timeout_s = timeout_s
        self.watch_idle_s = watch_idle_s
        self.security = security or EtcdSecurity()
        self._ssl = self.security.ssl_context()  # bad files fail here, at construction
        self._password = self.security.password() if self.security.user else ""
        self._scheme = "https" if self.security.tls else "http"
        self._token = ""
        self._session: aiohttp.ClientSession | None = None
        self._next = 0

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=self._ssl) if self._ssl is not None else None
            )
        return self._session

    def _headers(self) -> dict[str, str]:
        return {"Authorization": self._token} if self._token else {}

    async def _post(self, ep: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        async with self._http().post(
            f"{self._scheme}://{ep}/v3/{path}",
            json=body,
            headers=self._headers(),
            timeout=aiohttp.ClientTimeout(total=self.timeout_s),
        ) as r:
            text = await r.text()
        try:
            doc = json.loads(text)
        except ValueError:  # the gateway answers some refusals in plain text
            raise EtcdError(f"etcd {ep} {path}: HTTP {r.status}: {text.strip()[:200]}") from None
        if r.status != 200 or "error" in doc:
            raise EtcdError(f"etcd {ep} {path}: {doc.get('message') or doc.get('error') or r.status}")
        return doc

    async def _authenticate(self, ep: str) -> None:
        doc = await self._post(
            ep, "auth/authenticate", {"name": self.security.user, "password": self._password}
        )
        self._token = str(doc.get("token", ""))

    async def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``body`` to ``/v3/<path>`` on the first endpoint that answers (authenticating
        first when a user is configured and no token is held, or etcd refused the token)."""
        last: Exception | None = None
        for i in range(len(self.endpoints)):
            ep = self.endpoints[(self._next + i) % len(self.endpoints)]
            try:
                for attempt in (0, 1):
                    if self.security.user and not self._token:
                        await self._authenticate(ep)
                    try:
                        doc = await self._post(ep, path, body)
                        break
                    except EtcdError as exc:
                        if attempt or not self.security.user or "token" not in str(exc).lower():
                            raise
                        self._token = ""  # expired or revoked: authenticate again, once
                self._next = (self._next + i) % len(self.endpoints)
                return doc
            except (aiohttp.ClientError, TimeoutError, ValueError, EtcdError) as exc:
                last = exc
        raise EtcdError(f"etcd {','.join(self.endpoints)} {path}: {type(last).__name__}: {last}")

    async def range_prefix(self, prefix: str) -> tuple[list[tuple[bytes, bytes]], int]:
        """All (key, value) under ``prefix`` and the store revision they were read at."""
        doc = await self.call("kv/range", {"key": b64(prefix), "range_end": b64(prefix_end(prefix))})
        kvs = [(unb64(kv["key"]), unb64(kv.get("value", ""))) for kv in doc.get("kvs", [])]
        return kvs, int(doc["header"]["revision"])

    async def put(self, key: str, value: str, lease: int = 0) -> None:
        body: dict[str, Any] = {"key": b64(key), "value": b64(value)}
        if lease:
            body["lease"] = str(lease)
        await self.call("kv/put", body)

    async def delete(self, key: str) -> None:
        await self.call("kv/deleterange", {"key": b64(key)})

    async def grant(self, ttl_s: int) -> int:
        doc = await self.call("lease/grant", {"TTL": str(ttl_s)})
        return int(doc["ID"])

    async def keepalive(self, lease: int) -> int:
        """Refresh ``lease``; its remaining TTL, 0 when the lease no longer exists."""
        doc = await self.call("lease/keepalive", {"ID": str(lease)})
        return int(doc.get("result", {}).get("TTL", 0))

    async def revoke(self, lease: int) -> None:
        await self.call("lease/revoke", {"ID": str(lease)})

    async def watch(self, prefix: str, start_revision: int) -> AsyncIterator[tuple[str, bytes, bytes]]:
        """Events under ``prefix`` from ``start_revision``: ("PUT"|"DELETE", key, value), until
        the stream breaks (then EtcdError). Each endpoint is tried in turn to open it."""
        body = {
            "create_request": {
                "key": b64(prefix),
                "range_end": b64(prefix_end(prefix)),
                "start_revision": str(start_revision),
            }
        }
        ep = self.endpoints[self._next % len(self.endpoints)]
        if self.security.user and not self._token:
            await self.call("kv/range", {"key": b64(prefix), "limit": "1"})  # authenticates first
        try:
            async with self._http().post(
                f"{self._scheme}://{ep}/v3/watch",
                json=body,
                headers=self._headers(),
                timeout=aiohttp.ClientTimeout(
                    total=None,
                    connect=self.timeout_s,
                    sock_connect=self.timeout_s,
                    sock_read=self.watch_idle_s,
                ),
            ) as r:
                if r.status != 200:
                    raise EtcdError(f"etcd {ep} watch: HTTP {r.status}")
                async for line in r.content:
                    if not line.strip():
                        continue
                    doc = json.loads(line)
                    if "error" in doc:
                        raise EtcdError(f"etcd {ep} watch: {doc['error']}")
                    result = doc.get("result", {})
                    if result.get("canceled"):
                        raise EtcdError(f"etcd {ep} watch canceled: {result.get('cancel_reason', '')}")
                    for ev in result.get("events", []):
                        kv = ev.get("kv", {})
                        yield ev.get("type", "PUT"), unb64(kv.get("key", "")), unb64(kv.get("value", ""))
        except TimeoutError as exc:
            raise EtcdWatchIdle(f"etcd {ep} watch: idle for {self.watch_idle_s} s") from exc
        except (aiohttp.ClientError, ValueError, asyncio.IncompleteReadError) as exc:
            self._next += 1
            raise EtcdError(f"etcd {ep} watch: {type(exc).__name__}: {exc}") from exc
        self._next += 1
        raise EtcdError(f"etcd {ep} watch: stream ended")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
