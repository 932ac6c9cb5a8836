"""A client written from docs/protocol.md alone -- a raw socket and msgpack, no tierkv client
or protocol module -- talks HELLO, EXISTS, GET and DELETE to a real daemon. If the document and
the daemon disagree, this fails. (Blocks are stored beforehand by a separate process that
uses tierkv's own client; that process is not what is tested here.)"""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys

import msgpack
import pytest
import xxhash
from daemonutil import REPO

VERSION = 4  # docs/protocol.md, HELLO
HIT, MISS, BUF_TOO_SMALL = 0, 1, 4  # docs/protocol.md, per-key statuses
ABSENT, HBM, DRAM, DISK = 0, 1, 2, 3  # docs/protocol.md, tier codes
NAMESPACE = {  # a HELLO namespace map: the fields of the doc's HELLO section
    "model": "independent-model",
    "dtype": "uint8",
    "block_tokens": 4,
    "layout": "LKTHD",
    "tp": [1, 0],
    "hash": "xxh3_128",
    "v": 1,
}

_SEED = """
import asyncio, json, sys
import numpy as np
from kvstore.block import make_header
from kvstore.client.config import ClientConfig
from kvstore.client.node import NodeClient
from kvstore.keys import Namespace

async def main(addr, n):
    ns = Namespace("independent-model", "uint8", 4)
    tokens = list(range(100, 100 + 4 * n))
    keys, parent, blocks = ns.block_keys(tokens), ns.id, []
    for i, k in enumerate(keys):
        payload = np.full(64, i, dtype=np.uint8).tobytes()
        blocks.append((make_header(key=k, parent=parent, namespace=ns.id, tokens=tokens[4 * i : 4 * i + 4],
                                   dtype="uint8", shape=[64], payload=payload), payload))
        parent = k
    c = NodeClient(addr, ClientConfig(namespaces=(ns,), transport="tcp"))
    try:
        res = await c.put(blocks)
        assert len(res) == len(blocks) and all(r.status.name == "STORED" for r in res), res
    finally:
        await c.close()
    print(json.dumps([k.hex for k in keys]))

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


class Independent:
    """One connection speaking the documented frame: ``[u32 big-endian H][msgpack map]``."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.rid = 0

    def call(self, fields: dict) -> dict:
        self.rid += 1
        body = msgpack.packb({**fields, "rid": self.rid}, use_bin_type=True)
        self.sock.sendall(struct.pack(">I", len(body)) + body)
        reply = self.read()
        assert reply["rid"] == self.rid or not reply["ok"], reply
        return reply

    def read(self) -> dict:
        (n,) = struct.unpack(">I", self._exact(4))
        return msgpack.unpackb(self._exact(n), raw=False)

    def _exact(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError(f"closed after {len(buf)} of {n} bytes")
            buf += chunk
        return buf

    def closed(self) -> bool:
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True

    def hello(self, version: int = VERSION) -> dict:
        return self.call({"op": "HELLO", "v": version, "token": "", "tenant": None, "ns": [NAMESPACE]})

    def exists(self, keys: list[bytes]) -> bytes:
        r = self.call({"op": "EXISTS", "keys": b"".join(keys)})
        assert r["ok"], r
        codes = r["tiers"]
        assert isinstance(codes, bytes) and len(codes) == len(keys), r
        return codes

    def get(self, keys: list[bytes], caps: list[int]) -> tuple[bytes, bytes, list[bytes | None], list[bytes]]:
        """GET (docs/protocol.md): per key its status and tier code, its header (None without
        one) and the HIT payloads in key order, read off the stream after the reply."""
        r = self.call({"op": "GET", "keys": b"".join(keys), "caps": struct.pack(f"<{len(keys)}Q", *caps)})
        assert r["ok"], r
        st, tier, hdrs, hend = r["st"], r["tier"], r["hdrs"], r["hend"]
        assert len(st) == len(tier) == len(keys) and len(hend) == 4 * len(keys), r
        ends = struct.unpack(f"<{len(keys)}I", hend)
        headers, start = [], 0
        for end in ends:
            headers.append(hdrs[start:end] or None)
            start = end
        assert start == len(hdrs)
        lens = [msgpack.unpackb(h)["len"] for s, h in zip(st, headers) if s == HIT]
        assert r.get("plen", 0) == sum(lens), r
        return st, tier, headers, [self._exact(n) for n in lens]

    def delete(self, keys: list[bytes]) -> bytes:
        r = self.call({"op": "DELETE", "keys": b"".join(keys)})
        assert r["ok"], r
        assert isinstance(r["res"], bytes) and len(r["res"]) == len(keys), r
        return r["res"]

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def stored(start_daemon):
    """A daemon without disk holding 6 blocks of NAMESPACE: (daemon, their keys)."""
    d = start_daemon(use_disk=False)
    out = subprocess.run(
        [sys.executable, "-c", _SEED, d.addr, "6"], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert out.returncode == 0, out.stderr
    keys = [bytes.fromhex(k) for k in json.loads(out.stdout)]
    assert len(keys) == 6
    return d, keys


def test_hello_exists_and_delete_as_documented(stored):
    d, keys = stored
    c = Independent(d.data_port)
    try:
        welcome = c.hello()
        assert welcome["ok"] is True and welcome["v"] == VERSION
        assert len(welcome["ns"]) == 1 and len(welcome["ns"][0]) == 16
        assert welcome["exists_keys"] == 16384  # the most keys one EXISTS may carry
        absent = bytes(16)
        asked = [keys[0], absent, *keys[1:], keys[2]]
        assert c.exists(asked) == bytes([DRAM, ABSENT, *[DRAM] * 5, DRAM])
        assert c.exists([]) == b""
        assert c.delete([keys[1], absent, keys[1]]) == b"\x01\x00\x00"
        assert c.exists(keys) == bytes([DRAM, ABSENT, *[DRAM] * 4])
        # a malformed packed field is bad_request naming the field; the connection stays
        for bad in ([keys[0]], keys[0][:15], keys[0] * 16385):
            r = c.call({"op": "EXISTS", "keys": bad})
            assert r["ok"] is False and r["code"] == "bad_request" and "keys" in r["err"], r
        assert "at most 16384 keys" in r["err"], r  # the bound, named
        assert c.exists([keys[0]] * 16384) == bytes([DRAM]) * 16384  # the most, in one request
        assert c.exists([keys[0]]) == bytes([DRAM])
    finally:
        c.close()


def test_get_as_documented(stored):
    """A GET's reply columns, its payloads after it, and the client's own check of each block:
    key, parent, token ids and checksum, from the header the node sent."""
    d, keys = stored
    c = Independent(d.data_port)
    try:
        c.hello()
        absent = bytes(16)
        st, tier, headers, payloads = c.get([keys[0], absent, keys[1], keys[2]], [64, 64, 64, 63])
        assert list(st) == [HIT, MISS, HIT, BUF_TOO_SMALL]
        assert list(tier) == [DRAM, ABSENT, DRAM, DRAM]
        assert headers[1] is None and len(payloads) == 2
        for i, (h, p) in enumerate(zip([headers[0], headers[2]], payloads)):
            m = msgpack.unpackb(h)
            # the client judges the block: the key asked for, the chain it expects, the bytes
            assert m["key"] == keys[i] and m["parent"] == (keys[i - 1] if i else m["ns"])
            assert m["tokens"] == struct.pack("<4i", *range(100 + 4 * i, 104 + 4 * i))
            assert xxhash.xxh3_64_intdigest(p) == m["xxh3"] and p == bytes([i]) * 64
        assert msgpack.unpackb(headers[3])["len"] == 64  # too small: the header says how large
        # version 3's per-key expectations are refused, naming the field; the connection stays
        r = c.call({"op": "GET", "keys": keys[0], "exp": [[None, None]]})
        assert r["ok"] is False and r["code"] == "bad_request" and "exp" in r["err"], r
        assert c.get([keys[0]], [64])[0] == bytes([HIT])
    finally:
        c.close()


def test_a_namespace_not_declared_reads_as_absent(stored):
    """A connection whose HELLO declares another namespace sees the blocks as absent, and its
    DELETE of them deletes nothing (docs/protocol.md, tenants and namespaces)."""
    d, keys = stored
    c = Independent(d.data_port)
    try:
        r = c.call({"op": "HELLO", "v": VERSION, "token": "", "ns": [{**NAMESPACE, "model": "another"}]})
        assert r["ok"], r
        assert c.exists(keys) == bytes(len(keys))
        assert c.get(keys, [64] * len(keys)) == (bytes([MISS] * len(keys)), bytes(len(keys)), [None] * 6, [])
        assert c.delete(keys) == bytes(len(keys))
    finally:
        c.close()
    owner = Independent(d.data_port)
    try:
        owner.hello()
        assert owner.exists(keys) == bytes([DRAM] * len(keys))
    finally:
        owner.close()


def test_a_client_of_another_version_gets_one_error_naming_both(start_daemon):
    d = start_daemon(use_disk=False)
    for version in (3, 5):
        c = Independent(d.data_port)
        try:
            r = c.hello(version)
            assert r["ok"] is False and r["code"] == "bad_version", r
            assert f"version {version} " in r["err"] and f"speaks {VERSION}" in r["err"], r["err"]
            assert c.closed()
        finally:
            c.close()
