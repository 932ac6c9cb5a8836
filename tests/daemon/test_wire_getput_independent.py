"""A client written from docs/protocol.md alone (a raw socket, msgpack and xxh3) streams PUT
and GET batches to a real daemon: packed keys and caps, payloads back to back, one status
byte per block, pipelined requests answered in order. Only the protocol version number is
taken from the code (it is what the node speaks)."""

from __future__ import annotations

import os
import socket
import struct

import msgpack
import xxhash

from kvstore.protocol import PROTOCOL_VERSION

LEN = struct.Struct(">I")
STORED, EXISTS, HIT, MISS, MISMATCH, BUF_TOO_SMALL = 5, 6, 0, 1, 3, 4
DRAM = 2  # a PUT reply's tier code


class Wire:
    def __init__(self, port: int) -> None:
        self.s = socket.create_connection(("127.0.0.1", port), timeout=20)

    def frame(self, header: dict, payload: bytes = b"") -> bytes:
        if payload:
            header = {**header, "plen": len(payload)}
        body = msgpack.packb(header, use_bin_type=True)
        return LEN.pack(len(body)) + body + payload

    def exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.s.recv(n - len(buf))
            assert chunk, f"closed after {len(buf)} of {n} bytes"
            buf += chunk
        return bytes(buf)

    def reply(self) -> dict:
        (n,) = LEN.unpack(self.exact(4))
        return msgpack.unpackb(self.exact(n), raw=False)


def header(key: bytes, ns_id: bytes, payload: bytes) -> bytes:
    """A block header as docs/protocol.md (Frames) and the block format describe it."""
    return msgpack.packb(
        {
            "v": 1,
            "key": key,
            "parent": ns_id,
            "ns": ns_id,
            "tokens": struct.pack("<4i", 1, 2, 3, 4),
            "dtype": "uint8",
            "shape": [len(payload)],
            "len": len(payload),
            "xxh3": xxhash.xxh3_64_intdigest(payload),
            "created": 0.0,
        },
        use_bin_type=True,
    )


def test_an_independent_client_streams_put_and_get_batches(start_daemon):
    d = start_daemon(use_disk=False, dram={"capacity": "64MiB", "slab_size": "2MiB"})
    w = Wire(d.data_port)
    ns = {
        "model": "indep",
        "dtype": "uint8",
        "block_tokens": 4,
        "layout": "",
        "tp": [1, 0],
        "hash": "xxh3_128",
        "v": 1,
    }
    w.s.sendall(w.frame({"op": "HELLO", "rid": 0, "v": PROTOCOL_VERSION, "token": "", "ns": [ns]}))
    hello = w.reply()
    assert hello["ok"], hello
    [ns_id] = hello["ns"]
    payloads = [os.urandom(n) for n in (300_000, 1 << 20, 5)]
    keys = [os.urandom(16) for _ in payloads]
    hdrs = [header(k, ns_id, p) for k, p in zip(keys, payloads)]

    # PUT: headers, then the payloads back to back; one status, tier and durable byte per block
    w.s.sendall(w.frame({"op": "PUT", "rid": 1, "hdrs": hdrs}, b"".join(payloads)))
    rep = w.reply()
    assert rep["rid"] == 1 and rep["ok"]
    assert rep["st"] == bytes([STORED] * 3) and rep["tier"] == bytes([DRAM] * 3) and rep["dur"] == bytes(3)

    # two GETs pipelined (one write), then the second PUT of a block: answered in order
    missing = os.urandom(16)
    caps = struct.pack("<3Q", 1 << 20, 4096, 1 << 20)
    get2 = {"op": "GET", "rid": 2, "keys": keys[0] + missing + keys[2], "caps": caps}
    get3 = {"op": "GET", "rid": 3, "keys": keys[1], "caps": struct.pack("<Q", 1000)}  # too small
    again = w.frame({"op": "PUT", "rid": 4, "hdrs": hdrs[2:]}, payloads[2])
    w.s.sendall(w.frame(get2) + w.frame(get3) + again)

    rep = w.reply()
    assert rep["rid"] == 2 and rep["ok"]
    st = [e[0] for e in rep["res"]]
    assert st == [HIT, MISS, HIT] and rep["res"][1][1:] == [None, None]
    assert rep["res"][0][1] == hdrs[0] and rep["res"][0][2] == "dram"
    lens = [msgpack.unpackb(e[1])["len"] for e in rep["res"] if e[0] == HIT]
    assert rep["plen"] == sum(lens) == len(payloads[0]) + len(payloads[2])
    for n, want in zip(lens, (payloads[0], payloads[2])):
        got = w.exact(n)  # each HIT's payload, in key order, exactly its header's len
        assert (
            got == want and xxhash.xxh3_64_intdigest(got) == msgpack.unpackb(hdrs[0 if n > 5 else 2])["xxh3"]
        )

    rep = w.reply()
    assert rep["rid"] == 3 and [e[0] for e in rep["res"]] == [BUF_TOO_SMALL] and rep.get("plen", 0) == 0

    rep = w.reply()
    assert rep["rid"] == 4 and rep["st"] == bytes([EXISTS])
    w.s.close()


def test_the_daemon_judges_each_blocks_expectation_itself(start_daemon):
    """A GET's ``exp`` (per key ``[parent, tokens]``) is checked by the daemon against the
    stored header: a block whose parent or token ids differ is MISMATCH and its payload is not
    sent; nil fields are not checked."""
    d = start_daemon(use_disk=False, dram={"capacity": "64MiB", "slab_size": "2MiB"})
    w = Wire(d.data_port)
    ns = {
        "model": "exp",
        "dtype": "uint8",
        "block_tokens": 4,
        "layout": "",
        "tp": [1, 0],
        "hash": "xxh3_128",
        "v": 1,
    }
    w.s.sendall(w.frame({"op": "HELLO", "rid": 0, "v": PROTOCOL_VERSION, "token": "", "ns": [ns]}))
    hello = w.reply()
    assert hello["ok"], hello
    [ns_id] = hello["ns"]
    payloads = [os.urandom(4096) for _ in range(4)]
    keys = [os.urandom(16) for _ in payloads]
    hdrs = [header(k, ns_id, p) for k, p in zip(keys, payloads)]
    w.s.sendall(w.frame({"op": "PUT", "rid": 1, "hdrs": hdrs}, b"".join(payloads)))
    assert w.reply()["st"] == bytes([STORED] * 4)
    tokens = struct.pack("<4i", 1, 2, 3, 4)
    exp = [[ns_id, tokens], [os.urandom(16), None], [None, struct.pack("<4i", 9, 9, 9, 9)], [None, None]]
    w.s.sendall(w.frame({"op": "GET", "rid": 2, "keys": b"".join(keys), "exp": exp}))
    rep = w.reply()
    assert [e[0] for e in rep["res"]] == [HIT, MISMATCH, MISMATCH, HIT]
    assert rep["plen"] == 2 * 4096
    assert w.exact(4096) == payloads[0] and w.exact(4096) == payloads[3]
    w.s.close()
