"""The protocol's typed messages and field parsers, and the framed socket channel, without a
daemon."""

from __future__ import annotations

import socket
import struct

import msgpack
import pytest

from kvstore import protocol as P
from kvstore.daemon.auth import TokenTable
from kvstore.errors import ConfigError
from kvstore.keys import Namespace
from kvstore.protocol.fields import req_key_batch
from kvstore.results import PutResult, Status
from rdma.channel import SocketChannel
from rdma.framing import FrameError
from rdma.transport import RemoteDescriptor


def test_req_op_and_unknown_op():
    assert P.req_op({"op": "GET", "rid": 7}) == ("GET", 7)
    with pytest.raises(P.ProtocolError) as e:
        P.req_op({"op": "FROB", "rid": 1})
    assert e.value.code == P.UNKNOWN_OP
    with pytest.raises(P.ProtocolError) as e:
        P.req_op({"op": "GET", "rid": -1})
    assert e.value.code == P.BAD_REQUEST
    assert set(P.REQUESTS) == P.OPS and len(P.OPS) == 12


def test_keys_and_limits():
    k = b"k" * 16
    assert req_key_batch({"keys": k + k}).raw == k + k
    for bad in ({"keys": b"short"}, {"keys": "nope"}, {"keys": [k]}, {"keys": k * (P.MAX_BATCH + 1)}):
        with pytest.raises(P.ProtocolError, match="keys"):
            req_key_batch(bad)
    # protocol 4: a GET is keys (and caps) only; version 3's expectations are refused, named
    with pytest.raises(P.ProtocolError, match="exp: a GET carries keys only"):
        P.GetRequest.from_wire({"op": "GET", "rid": 1, "keys": k, "exp": [None]})
    assert P.GetRequest.from_wire({"op": "GET", "rid": 1, "keys": k, "exp": None}).keys.raw == k


def test_headers_are_decoded_or_refused(blocks_of, ns):
    [(h, _)] = blocks_of(ns, 1, 64)
    assert P.req_headers({"hdrs": [h.encode()]}) == [h]
    with pytest.raises(P.ProtocolError, match=r"hdrs\[0\]"):
        P.req_headers({"hdrs": [b"\x81\xa1v\x02"]})


def test_hello_version_and_namespace():
    with pytest.raises(P.ProtocolError) as e:
        P.Hello.from_wire({"v": 99, "rid": 0})
    assert e.value.code == P.BAD_VERSION
    ns = Namespace("m", "float16", 16, tp_size=2, tp_rank=1)
    hello = P.Hello.from_wire(P.Hello.of("t", None, [ns.with_tenant("not sent")]).to_wire())
    assert hello.token == "t" and hello.rid == 0 and hello.rdma is None
    [back] = hello.namespaces_with("")
    assert back.id == ns.id
    # the salt comes from the daemon, not the client
    assert hello.namespaces_with("acme")[0].id == ns.with_tenant("acme").id
    bad = P.Hello(0, "", None, ({"model": "m", "dtype": "x", "block_tokens": 0},))
    with pytest.raises(P.ProtocolError, match=r"ns\[0\]"):
        P.Hello.from_wire(bad.to_wire()).namespaces_with("")
    with pytest.raises(P.ProtocolError, match="token"):
        P.Hello.from_wire({**hello.to_wire(), "token": 5})


def _round_trip(msg, *n, plen=0):
    """``msg`` through msgpack and back (what the peer parses); ``plen`` as framing adds it."""
    wire = msgpack.unpackb(msgpack.packb({**msg.to_wire(), "plen": plen}, use_bin_type=True), raw=False)
    return type(msg).from_wire(wire, *n)


def test_every_request_round_trips(blocks_of, ns):
    [(h, _), (h2, _)] = blocks_of(ns, 2, 64)
    d = RemoteDescriptor(3, 0, 64)
    reqs = [
        P.ExistsRequest(1, (h.key,)),
        P.GetRequest(2, (h.key, h2.key), (64, 32)),
        P.GetRequest(3, (h.key,), None),
        P.PutRequest(4, (h, h2)),
        P.DeleteRequest(5, (h.key,)),
        P.LeaseRequest(6, (h.key,), 2.5, True),
        P.LeaseRequest(7, (h.key,)),
        P.ReleaseRequest(8, (3, 4)),
        P.ReadRequest(9, (d,)),
        P.ReserveRequest(10, (h,), True),
        P.WriteRequest(11, (d,)),
        P.CommitRequest(12, (3,)),
        P.StatsRequest(13),
    ]
    assert {type(r).OP for r in reqs} | {"HELLO"} == P.OPS
    for r in reqs:
        wire = r.to_wire()
        assert P.req_op(wire) == (r.OP, r.rid)
        assert P.REQUESTS[r.OP].from_wire(wire) == r, r.OP


@pytest.mark.parametrize(
    "op, field, value, says",
    [
        ("GET", "caps", [1, 2], "caps must be bin of 16 bytes"),
        ("GET", "caps", b"\x00" * 8, "caps must be bin of 16 bytes"),
        ("GET", "keys", [b"k" * 16], "keys must be bin"),
        ("GET", "keys", b"k" * 17, "multiple of 16"),
        ("LEASE", "keys", b"k" * 15, "multiple of 16"),
        ("LEASE", "ttl", 0, "ttl"),
        ("LEASE", "rdma", 1, "rdma must be true, false or nil"),
        ("READ", "descs", [[1, 2]], r"descs\[0\]"),
        ("RELEASE", "handles", ["x"], r"handles\[0\]"),
        ("PUT", "hdrs", [b"junk"], r"hdrs\[0\]"),
        ("STATS", "rid", "x", "rid"),
    ],
)
def test_a_bad_request_field_is_named(op, field, value, says):
    k = b"k" * 16
    base = {"op": op, "rid": 1, "keys": k + k, "descs": [], "handles": [], "hdrs": []}
    with pytest.raises(P.ProtocolError, match=says) as e:
        P.REQUESTS[op].from_wire({**base, field: value})
    assert e.value.code == P.BAD_REQUEST


def test_every_reply_round_trips(blocks_of, ns):
    [(h, _)] = blocks_of(ns, 1, 64)
    raw = h.encode()
    d = RemoteDescriptor(3, 0, 64)
    get = _round_trip(P.GetReply.of(1, 2, [0], b"\x00", [raw], b"\x02"), 2, plen=64)
    assert (get.codes, get.tiers, get.headers, get.blocks) == (b"\x00\x01", b"\x02\x00", raw, (h, None))
    lease = _round_trip(P.LeaseReply(2, (P.LeaseEntry(Status.HIT, raw, "disk", desc=d),)), 1)
    assert lease.entries[0].desc == d and lease.entries[0].block == h
    res = (P.ReserveEntry(desc=d), P.ReserveEntry(Status.EXISTS), P.ReserveEntry())
    assert _round_trip(P.ReserveReply(3, res), 3).entries == res
    puts = (PutResult(Status.STORED, "dram", True), PutResult(Status.INVALID))
    assert _round_trip(P.PutReply(4, puts), 2).results == puts
    assert _round_trip(P.CommitReply(4, puts), 2).results == puts
    for cls in (P.ReleaseReply, P.WriteReply):
        assert _round_trip(cls(5, (True, False)), 2).res == (True, False)
    assert _round_trip(P.DeleteReply(5, b"\x01\x00"), 2).res == (True, False)
    assert _round_trip(P.ExistsReply(6, b"\x02\x00\x03"), 3).tiers == ("dram", None, "disk")
    assert _round_trip(P.StatsReply(7, {"tenant": {"hits": 1}})).stats == {"tenant": {"hits": 1}}
    hello = P.HelloReply(0, "acme", "s", (b"n" * 16,), "node-a", 1 << 20)
    assert _round_trip(hello) == hello
    err = P.ErrorReply(8, P.BAD_REQUEST, "keys must be a list")
    assert P.check_reply(err.to_wire(), 8) == err
    assert P.check_reply(P.StatsReply(9, {}).to_wire(), 9) is None
    with pytest.raises(P.ProtocolError, match="expected 10"):
        P.check_reply(P.StatsReply(9, {}).to_wire(), 10)


def test_a_bad_reply_field_is_named(blocks_of, ns):
    [(h, _)] = blocks_of(ns, 1, 64)
    raw = h.encode()
    hit = [int(Status.HIT), raw, "dram"]

    def get(st=b"\x00", tier=b"\x02", hdrs=raw, hend=None):
        return {"st": st, "tier": tier, "hdrs": hdrs, "hend": hend or struct.pack("<I", len(hdrs))}

    cases = [
        (P.GetReply, get(), 2, "st must be bin of 2 bytes"),
        (P.GetReply, get(hdrs=b""), 1, "status 0 with no header"),
        (P.GetReply, get(st=b"\x63"), 1, r"st\[0\] is 99"),
        (P.GetReply, get(st=b"\x03"), 1, r"st\[0\] is 3: a GET answers HIT, MISS or BUF_TOO_SMALL"),
        (P.GetReply, get(hdrs=b"junk"), 1, r"hdrs\[0\]"),
        (P.GetReply, get(tier=b"\x05"), 1, r"tier\[0\] is 5"),
        (P.GetReply, get(st=b"\x01"), 1, "status 1 with header and tier 2"),
        (P.GetReply, get(hend=b"\x00\x00\x00"), 1, "hend must be bin of 4 bytes"),
        (P.GetReply, get(hend=struct.pack("<I", len(raw) + 1)), 1, r"hend\[0\] is"),
        (P.GetReply, get(hdrs=raw + b"x", hend=struct.pack("<I", len(raw))), 1, "1 bytes past the last"),
        (P.GetReply, get(), 1, "payload length does not match"),
        (P.LeaseReply, {"res": [[*hit, [1, 2]]]}, 1, r"res\[0\] descriptor"),
        (P.ReserveReply, {"res": [[6, [1, 0, 4, 0]]]}, 1, "a status and a descriptor"),
        (P.PutReply, {"st": b"\x05", "tier": b"\x00", "dur": b"\x02"}, 1, r"dur\[0\]: unknown code 2"),
        (P.PutReply, {"st": b"\x05\x05", "tier": b"\x00", "dur": b"\x00"}, 1, "st must be 1 bytes"),
        (P.PutReply, {"st": b"\x63", "tier": b"\x00", "dur": b"\x00"}, 1, r"st\[0\]: unknown code 99"),
        (P.DeleteReply, {"res": [1]}, 1, r"res must be bin of 1 bytes"),
        (P.DeleteReply, {"res": b"\x00\x02"}, 2, r"res\[1\] is 2; codes are 0..1"),
        (P.ExistsReply, {"tiers": ["dram"]}, 1, r"tiers must be bin of 1 bytes"),
        (P.ExistsReply, {"tiers": b"\x01"}, 2, r"tiers must be bin of 2 bytes"),
        (P.StatsReply, {"stats": [1]}, 0, "stats must be a map"),
        (P.HelloReply, {"tenant": "", "salt": "", "ns": [b"x"], "v": P.PROTOCOL_VERSION}, 0, "namespace ids"),
        (
            P.HelloReply,
            {"tenant": "", "salt": "", "ns": [], "v": 2},
            0,
            "node protocol version 2 .* speaks 4",
        ),
    ]
    for cls, fields, n, says in cases:
        with pytest.raises(P.ProtocolError, match=says):
            cls.from_wire({"rid": 1, "ok": True, **fields}, *([n] if cls is not P.HelloReply else []))


async def _pair():
    a, b = socket.socketpair()
    return SocketChannel(a), SocketChannel(b)


async def test_frame_round_trip_with_payloads():
    a, b = await _pair()
    big = bytes(range(256)) * 8192  # 2 MiB, bigger than the socket buffer
    import asyncio

    send = asyncio.ensure_future(a.send_frame({"op": "PUT", "rid": 1}, [big, memoryview(b"tail")]))
    h = await b.recv_header(P.MAX_HEADER, 64 << 20)
    assert h == {"op": "PUT", "rid": 1, "plen": len(big) + 4}
    dst = bytearray(len(big))
    await b.recv_into(dst)
    assert dst == big
    assert await b.recv_exact(4) == b"tail"
    await send
    a.close()
    with pytest.raises(ConnectionError):
        await b.recv_header(P.MAX_HEADER, 1 << 20)
    b.close()


@pytest.mark.parametrize(
    "raw, code",
    [
        (struct.pack(">I", 1 << 30), "too_large"),
        (struct.pack(">I", 0), "bad_frame"),
        (struct.pack(">I", 3) + b"\xc1\xc1\xc1", "bad_frame"),
        (struct.pack(">I", 2) + msgpack.packb([1]), "bad_frame"),
        (struct.pack(">I", 9) + msgpack.packb({"plen": -1}), "bad_frame"),
    ],
)
async def test_bad_frames_are_typed(raw, code):
    a, b = await _pair()
    await a.send([raw + b"\x00" * 16])
    with pytest.raises(FrameError) as e:
        await b.recv_header(P.MAX_HEADER, 1 << 20)
    assert e.value.code == code
    a.close()
    b.close()


async def test_frame_over_max_frame_is_refused():
    a, b = await _pair()
    await a.send_frame({"op": "PUT", "rid": 1, "plen": 5000})
    with pytest.raises(FrameError) as e:
        await b.recv_header(P.MAX_HEADER, 4096)
    assert e.value.code == "too_large"
    a.close()
    b.close()


def test_token_table(tmp_path):
    f = tmp_path / "tokens"
    f.write_text("# comment\nsecret-aaaa acme\nsecret-bbbb  globex  # trailing\nroot-token-1 *\n")
    t = TokenTable.load(str(f))
    assert t.enabled
    assert t.tenant_of("secret-aaaa") == "acme"
    assert t.tenant_of("secret-bbbb") == "globex"
    assert t.tenant_of("secret-aaa") is None
    assert TokenTable.load("").tenant_of("anything") == ""
    f.write_text("lonely\n")
    with pytest.raises(ConfigError, match=":1"):
        TokenTable.load(str(f))
    f.write_text("secret-aaaa a\nsecret-aaaa b\n")
    with pytest.raises(ConfigError, match="duplicate"):
        TokenTable.load(str(f))
    with pytest.raises(ConfigError, match="cannot read"):
        TokenTable.load(str(tmp_path / "missing"))


def test_exists_reply_names_a_bad_tier_item():
    assert P.ExistsReply.from_wire({"rid": 1, "ok": True, "tiers": b"\x02\x00"}, 2).tiers == ("dram", None)
    with pytest.raises(P.ProtocolError, match=r"tiers\[1\] is 5; codes are 0..3"):
        P.ExistsReply.from_wire({"rid": 1, "ok": True, "tiers": b"\x02\x05"}, 2)


def test_packed_keys_are_one_bin_field_checked_once(blocks_of, ns):
    [(h, _), (h2, _)] = blocks_of(ns, 2, 64)
    for cls in (P.ExistsRequest, P.DeleteRequest):
        req = cls(3, (h.key, h2.key))
        wire = req.to_wire()
        assert wire["keys"] == h.key.raw + h2.key.raw
        back = cls.from_wire(msgpack.unpackb(msgpack.packb(wire, use_bin_type=True), raw=False))
        assert back == req and list(back.keys) == [h.key, h2.key]
        with pytest.raises(P.ProtocolError, match="keys must be bin"):
            cls.from_wire({**wire, "keys": [h.key.raw]})
        with pytest.raises(P.ProtocolError, match="multiple of 16 bytes"):
            cls.from_wire({**wire, "keys": b"x" * 17})
        most = P.MAX_EXISTS_KEYS  # EXISTS and DELETE: the same bound (docs/protocol.md)
        with pytest.raises(P.ProtocolError, match=f"at most {most} keys"):
            cls.from_wire({**wire, "keys": b"x" * 16 * (most + 1)})
        assert len(cls.from_wire({**wire, "keys": b"x" * 16 * most}).keys) == most
