"""A client written from docs/protocol.md alone (a raw socket, msgpack and xxh3) streams PUT
and GET batches to a real daemon: packed keys and caps, payloads back to back, one status
byte per block, a GET's headers in one bin with offsets, pipelined requests answered in order. Only the protocol version number is
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


def columns(rep: dict, n: int) -> tuple[list[int], list[int], list[bytes | None]]:
    """A GET reply's columns (docs/protocol.md, GET): status and tier per key, its header."""
    assert len(rep["st"]) == len(rep["tier"]) == n and len(rep["hend"]) == 4 * n, rep
    headers, start = [], 0
    for end in struct.unpack(f"<{n}I", rep["hend"]):
        headers.append(rep["hdrs"][start:end] or None)
        start = end
    assert start == len(rep["hdrs"]), rep
    return list(rep["st"]), list(rep["tier"]), headers


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


def hello(start_daemon, model: str) -> tuple[Wire, bytes]:
    """A DRAM-only daemon and a connection to it past HELLO with one uint8 namespace of
    ``model``: the connection and the namespace's id."""
    d = start_daemon(use_disk=False, dram={"capacity": "64MiB", "slab_size": "2MiB"})
    w = Wire(d.data_port)
    ns = {
        "model": model,
        "dtype": "uint8",
        "block_tokens": 4,
        "layout": "",
        "tp": [1, 0],
        "hash": "xxh3_128",
        "v": 1,
    }
    w.s.sendall(w.frame({"op": "HELLO", "rid": 0, "v": PROTOCOL_VERSION, "token": "", "ns": [ns]}))
    rep = w.reply()
    assert rep["ok"], rep
    [ns_id] = rep["ns"]
    return w, ns_id


def test_an_independent_client_streams_put_and_get_batches(start_daemon):
    w, ns_id = hello(start_daemon, "indep")
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
    st, tier, got_hdrs = columns(rep, 3)
    assert st == [HIT, MISS, HIT] and tier == [DRAM, 0, DRAM] and got_hdrs[1] is None
    assert got_hdrs[0] == hdrs[0] and got_hdrs[2] == hdrs[2]
    lens = [msgpack.unpackb(h)["len"] for s, h in zip(st, got_hdrs) if s == HIT]
    assert rep["plen"] == sum(lens) == len(payloads[0]) + len(payloads[2])
    for n, want in zip(lens, (payloads[0], payloads[2])):
        got = w.exact(n)  # each HIT's payload, in key order, exactly its header's len
        assert (
            got == want and xxhash.xxh3_64_intdigest(got) == msgpack.unpackb(hdrs[0 if n > 5 else 2])["xxh3"]
        )

    rep = w.reply()
    assert rep["rid"] == 3 and columns(rep, 1)[0] == [BUF_TOO_SMALL] and rep.get("plen", 0) == 0

    rep = w.reply()
    assert rep["rid"] == 4 and rep["st"] == bytes([EXISTS])
    w.s.close()


def test_the_daemon_sends_what_it_holds_and_the_client_judges_it(start_daemon):
    """A GET carries keys only: the daemon answers with the stored header, whatever parent
    or token ids the reader had in mind, and the reader compares them itself (docs/protocol.md,
    Frames: every block a client receives is judged by the client). Version 3's ``exp`` is
    refused, naming it, and the connection stays."""
    w, ns_id = hello(start_daemon, "exp")
    payloads = [os.urandom(4096) for _ in range(4)]
    keys = [os.urandom(16) for _ in payloads]
    hdrs = [header(k, ns_id, p) for k, p in zip(keys, payloads)]
    w.s.sendall(w.frame({"op": "PUT", "rid": 1, "hdrs": hdrs}, b"".join(payloads)))
    assert w.reply()["st"] == bytes([STORED] * 4)
    w.s.sendall(w.frame({"op": "GET", "rid": 2, "keys": b"".join(keys), "exp": [[os.urandom(16), None]] * 4}))
    rep = w.reply()
    assert rep["ok"] is False and rep["code"] == "bad_request" and "exp" in rep["err"], rep
    w.s.sendall(w.frame({"op": "GET", "rid": 3, "keys": b"".join(keys)}))
    rep = w.reply()
    st, _, got = columns(rep, 4)
    assert st == [HIT] * 4 and got == hdrs and rep["plen"] == 4 * 4096
    for h, p in zip(got, payloads):
        m = msgpack.unpackb(h)
        body = w.exact(m["len"])
        assert body == p and xxhash.xxh3_64_intdigest(body) == m["xxh3"]
        # what this reader expects of the block (its parent, its tokens) is its own to check
        assert m["parent"] == ns_id and m["tokens"] == struct.pack("<4i", 1, 2, 3, 4)
    w.s.close()
