"""Hypothesis fuzz of the data port: random bytes, random frames, tampered blocks.

After every example the daemon must still be alive; at the end it must serve a well-behaved
client, and every block it stored must read back as a verified HIT (nothing corrupt got in).
"""

from __future__ import annotations

import asyncio
import socket
import struct

import aiohttp
import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore import protocol as P
from kvstore.block import make_header
from kvstore.client.config import ClientConfig
from kvstore.client.node import NodeClient
from kvstore.client.read import get_into
from kvstore.keys import BlockKey, Namespace
from kvstore.results import Status

NS = Namespace("fuzz-model", "uint8", 4)
KEY = st.binary(min_size=16, max_size=16)
SCALAR = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.binary(max_size=40), st.text(max_size=10)
)
VALUE = st.recursive(
    SCALAR,
    lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=6), c, max_size=4),
    max_leaves=12,
)
FIELDS = st.fixed_dictionaries(
    {},
    optional={
        "keys": st.one_of(st.lists(KEY, max_size=5), st.binary(max_size=90).map(bytes), VALUE),
        "hdrs": st.one_of(st.lists(st.binary(max_size=60), max_size=3), VALUE),
        "descs": st.one_of(
            st.lists(st.lists(st.integers(0, 2**20), min_size=4, max_size=4), max_size=3), VALUE
        ),
        "handles": st.one_of(st.lists(st.integers(0, 10), max_size=3), VALUE),
        "exp": VALUE,
        "caps": st.one_of(st.lists(st.integers(0, 1 << 20), max_size=5), VALUE),
        "ttl": VALUE,
        "v": st.one_of(st.just(1), VALUE),
        "ns": st.one_of(st.just([P.namespace_to_wire(NS)]), VALUE),
    },
)
OP = st.one_of(
    st.sampled_from(sorted(P.OPS)),
    st.text(max_size=8),
    st.integers(-(2**63), 2**63),
    st.lists(SCALAR, max_size=3),  # unhashable: once an `internal` with a traceback
    st.dictionaries(st.text(max_size=4), SCALAR, max_size=2),
)


def _frame(header, payload: bytes = b"") -> bytes:
    if payload and isinstance(header, dict):
        header = {**header, "plen": len(payload)}
    body = msgpack.packb(header, use_bin_type=True)
    return struct.pack(">I", len(body)) + body + payload


@st.composite
def map_frames(draw):
    h = draw(FIELDS)
    h["op"] = draw(OP)
    h["rid"] = draw(st.one_of(st.integers(0, 2**32), VALUE))
    payload = draw(st.binary(max_size=300)) if draw(st.booleans()) else b""
    return _frame(h, payload)


@st.composite
def tampered_puts(draw):
    """A nearly valid PUT: a real block with one thing wrong (or nothing wrong)."""
    size = draw(st.integers(1, 2000))
    tokens = draw(st.lists(st.integers(0, 1000), min_size=4, max_size=4))
    payload = bytearray(draw(st.binary(min_size=size, max_size=size)))
    key = NS.block_keys(tokens)[0]
    h = make_header(
        key=key, parent=NS.id, namespace=NS.id, tokens=tokens, dtype="uint8", shape=[size], payload=payload
    )
    what = draw(st.sampled_from(["none", "flip", "short", "long", "namespace", "plen"]))
    plen = None
    if what == "flip":
        i = draw(st.integers(0, size - 1))
        payload[i] ^= 1 << draw(st.integers(0, 7))
    elif what == "short":
        payload = payload[:-1]
    elif what == "long":
        payload += b"x"
    elif what == "namespace":
        other = BlockKey(draw(KEY))
        h = make_header(
            key=key,
            parent=NS.id,
            namespace=other,
            tokens=tokens,
            dtype="uint8",
            shape=[size],
            payload=payload,
        )
    elif what == "plen":
        plen = draw(st.integers(0, 4000))
    hdr = {"op": "PUT", "rid": 9, "hdrs": [h.encode()]}
    if plen is not None:
        hdr["plen"] = plen
        body = msgpack.packb(hdr, use_bin_type=True)
        return struct.pack(">I", len(body)) + body + bytes(payload), what == "none"
    return _frame(hdr, bytes(payload)), what == "none"


RAW = st.binary(max_size=200)
PREFIXED = st.builds(
    lambda b, n: struct.pack(">I", n) + b, st.binary(max_size=100), st.integers(0, 2**32 - 1)
)
FRAMES = st.lists(
    st.one_of(RAW, PREFIXED, map_frames(), tampered_puts().map(lambda t: t[0])), min_size=1, max_size=4
)


def _exchange(port: int, hello: bool, frames: list[bytes]) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        if hello:
            s.sendall(
                _frame({"op": "HELLO", "rid": 1, "v": P.PROTOCOL_VERSION, "ns": [P.namespace_to_wire(NS)]})
            )
        try:
            for f in frames:
                s.sendall(f)
            s.shutdown(socket.SHUT_WR)
            while s.recv(65536):  # until the daemon closes: it must, and within the timeout
                pass
        except OSError:  # reset, broken pipe, not connected: the daemon hung up first
            pass


def _reply(s: socket.socket) -> dict:
    def exact(n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = s.recv(n - len(buf))
            assert chunk, "the daemon closed a well-behaved connection"
            buf += chunk
        return buf

    (n,) = struct.unpack(">I", exact(4))
    return msgpack.unpackb(exact(n), raw=False)


def test_fuzz_data_port(start_daemon):
    d = start_daemon(server={"max_frame": "1MiB"})
    # a well-behaved client on its own long-lived connection, served between every example
    sentinel = socket.create_connection(("127.0.0.1", d.data_port), timeout=5)
    sentinel.sendall(
        _frame({"op": "HELLO", "rid": 1, "v": P.PROTOCOL_VERSION, "ns": [P.namespace_to_wire(NS)]})
    )
    assert _reply(sentinel)["ok"]

    @settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(hello=st.booleans(), frames=FRAMES)
    def run(hello, frames):
        _exchange(d.data_port, hello, frames)
        assert d.proc.poll() is None, d.logs()[-3000:]
        sentinel.sendall(_frame({"op": "EXISTS", "rid": 2, "keys": NS.id.raw}))
        assert _reply(sentinel) == {"rid": 2, "ok": True, "tiers": b"\x00"}

    run()
    sentinel.close()
    asyncio.run(_verify_store(d))
    assert "Traceback" not in d.logs(), d.logs()[-5000:]


async def _verify_store(d) -> None:
    c = NodeClient(d.addr, ClientConfig(namespaces=(NS,)))
    tokens = [1, 2, 3, 4]
    payload = b"sentinel" * 100
    key = NS.block_keys(tokens)[0]
    h = make_header(
        key=key, parent=NS.id, namespace=NS.id, tokens=tokens, dtype="uint8", shape=[800], payload=payload
    )
    await c.delete([key])
    assert (await c.put([(h, payload)]))[0].status is Status.STORED
    async with aiohttp.ClientSession(d.admin) as s:
        listed = (await (await s.get("/v1/blocks", params={"limit": "10000"})).json())["blocks"]
    keys = [BlockKey.from_hex(b["key"]) for b in listed]
    assert key in keys and all(b["namespace"] == NS.id.hex for b in listed)
    got = await get_into(c, keys, [bytearray(b["payload_len"]) for b in listed])
    assert [g.status for g in got] == [Status.HIT] * len(keys)  # the client verified every checksum
    assert c.counters["errors"] == 0
    await c.close()


MALFORMED = [
    {"op": ["GET"], "rid": 3},
    {"op": {"GET": 1}, "rid": 3},
    {"op": "GET", "rid": 3, "keys": {"a": 1}},
    {"op": "GET", "rid": 3, "keys": b"x" * 16, "exp": {"x": 1}},
    {"op": "GET", "rid": 3, "keys": b"x" * 16, "caps": [[1]]},
    {"op": "PUT", "rid": 3, "hdrs": [[1, 2]]},
    {"op": "LEASE", "rid": 3, "keys": b"x" * 16, "ttl": [1]},
    {"op": "LEASE", "rid": 3, "keys": b"x" * 16, "rdma": "yes"},
    {"op": "READ", "rid": 3, "descs": [{"a": 1}]},
    {"op": "RELEASE", "rid": 3, "handles": [-1]},
    {"op": "COMMIT", "rid": 3, "handles": {"a": 1}},
    {"op": "EXISTS", "rid": 3, "keys": [b"x" * 16]},
    {"op": "EXISTS", "rid": 3, "keys": b"x" * 17},
    {"op": "DELETE", "rid": 3, "keys": b"x" * 16 * (P.MAX_EXISTS_KEYS + 1)},
    {
        "op": "HELLO",
        "rid": 3,
        "v": P.PROTOCOL_VERSION,
        "ns": [{"model": ["m"], "dtype": "u8", "block_tokens": "4"}],
    },
    {
        "op": "HELLO",
        "rid": 3,
        "v": P.PROTOCOL_VERSION,
        "ns": [{"model": "m", "dtype": "u8", "block_tokens": [4]}],
    },
    {"op": "HELLO", "rid": 3, "v": P.PROTOCOL_VERSION, "token": {"t": 1}},
]


def test_every_malformed_field_is_a_typed_bad_request_and_logging_is_bounded(start_daemon):
    """Before and after HELLO, each malformed field answers bad_request or unknown_op (never
    internal), the connection stays usable, nothing is logged as a traceback, and a flood of
    bad frames logs a bounded number of lines (the counters carry the volume)."""
    d = start_daemon(use_disk=False)
    for hello in (False, True):
        with socket.create_connection(("127.0.0.1", d.data_port), timeout=5) as s:
            if hello:
                s.sendall(
                    _frame(
                        {"op": "HELLO", "rid": 1, "v": P.PROTOCOL_VERSION, "ns": [P.namespace_to_wire(NS)]}
                    )
                )
                assert _reply(s)["ok"]
            # before HELLO any well-formed op but HELLO is refused (auth) and closes the connection
            for h in (
                MALFORMED
                if hello
                else [h for h in MALFORMED if h["op"] in ("HELLO", None) or not isinstance(h["op"], str)]
            ):
                s.sendall(_frame(h))
                r = _reply(s)
                assert r["ok"] is False and r["code"] in (P.BAD_REQUEST, P.UNKNOWN_OP), (h, r)
    for _ in range(300):
        with socket.create_connection(("127.0.0.1", d.data_port), timeout=5) as s:
            s.sendall(b"\0\0\0\5garbage")
            _reply(s)
    logs = d.logs()
    assert "Traceback" not in logs and "internal" not in logs
    assert logs.count("event=bad_frame") <= 30, logs.count("event=bad_frame")
