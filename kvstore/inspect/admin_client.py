"""An async client of one daemon's admin HTTP API, and the errors the CLI turns into exit codes.

Contract: :meth:`AdminClient.call` returns the decoded JSON body of a 2xx answer, ``None`` for a
404 when the caller said absence is an answer (``absent_ok``), and raises :class:`NodeError`
(naming the node and what failed) for everything else: refused or reset connections, DNS
failures, timeouts, 401/403 (bad or missing token), other HTTP errors, a body that is not JSON.
One client per node, all sharing one aiohttp session bound to the running event loop.
"""

from __future__ import annotations

from typing import Any

import aiohttp


class UsageError(Exception):
    """Bad command-line input; the message names the option or argument. Exit status 2."""


class NodeError(Exception):
    """A node could not answer. Exit status 2."""

    def __init__(self, node: str, what: str) -> None:
        super().__init__(f"node {node}: {what}")
        self.node = node
        self.what = what


def normalize_url(text: str) -> str:
    """``host:port`` or ``http(s)://host:port[/]`` -> ``http(s)://host:port``; UsageError naming
    the bad ``--node`` value otherwise."""
    from yarl import URL

    raw = text.strip()
    if "://" not in raw:
        raw = "http://" + raw
    try:
        url = URL(raw)
    except ValueError as exc:
        raise UsageError(f"--node {text!r}: not a URL ({exc})") from exc
    if url.scheme not in ("http", "https") or not url.host:
        raise UsageError(f"--node {text!r}: expected the admin URL of a node, like http://127.0.0.1:7401")
    return str(url.origin())


def read_token(path: str) -> str:
    """The operator token in ``path``: the first word of its first line that is neither empty
    nor a ``#`` comment (so a one-line file, or a daemon token file whose first entry is the
    operator's, both work). UsageError naming the file when unreadable or empty."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as exc:
        raise UsageError(f"--token-file {path!r}: cannot read it: {exc.strerror}") from exc
    for line in lines:
        line = line.strip()
        if line and not line.startswith("#"):
            return line.split()[0]
    raise UsageError(f"--token-file {path!r}: holds no token")


def make_session(token: str, timeout_s: float) -> aiohttp.ClientSession:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s))


class AdminClient:
    """Requests to one node's admin port (``url`` as from :func:`normalize_url`)."""

    def __init__(self, url: str, session: aiohttp.ClientSession, timeout_s: float) -> None:
        self.url = url
        self.session = session
        self.timeout_s = timeout_s

    async def call(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, str] | None = None,
        body: Any = None,
        absent_ok: bool = False,
    ) -> Any:
        what = f"{method} {path}"
        try:
            async with self.session.request(method, self.url + path, params=params, json=body) as resp:
                text = await resp.text()
                if resp.status == 404 and absent_ok:
                    return None
                if resp.status in (401, 403):
                    hint = "pass an operator token with --token-file" if resp.status == 401 else ""
                    raise NodeError(
                        self.url,
                        f"{what}: refused ({resp.status} {text.strip()}){'; ' + hint if hint else ''}",
                    )
                if resp.status >= 300:
                    raise NodeError(self.url, f"{what}: HTTP {resp.status}: {text.strip()[:300]}")
                try:
                    return await resp.json(content_type=None)
                except ValueError as exc:
                    raise NodeError(self.url, f"{what}: answer is not JSON: {text[:120]!r}") from exc
        except TimeoutError as exc:
            raise NodeError(self.url, f"{what}: no answer within {self.timeout_s:g} s (--timeout)") from exc
        except aiohttp.ClientConnectorError as exc:
            err = exc.os_error
            why = (
                "connection refused"
                if isinstance(err, ConnectionRefusedError)
                else (err.strerror or str(err))
            )
            raise NodeError(self.url, f"cannot connect: {why}") from exc
        except aiohttp.ClientError as exc:
            raise NodeError(self.url, f"{what}: {type(exc).__name__}: {exc}") from exc
