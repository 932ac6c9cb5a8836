"""The protocol's field parsers and the framed socket channel, without a daemon."""

from __future__ import annotations

import socket
import struct

import msgpack
import pytest

from kvstore import protocol as P
from kvstore.daemon.auth import TokenTable
from kvstore.errors import ConfigError
from kvstore.keys import Namespace
from kvstore.results import Status
from rdma.tcp import FrameError, SocketChannel


def test_req_op_and_unknown_op():
    assert P.req_op({"op": "GET", "rid": 7}) == ("GET", 7)
    with pytest.raises(P.ProtocolError) as e:
        P.req_op({"op": "FROB", "rid": 1})
    assert e.value.code == P.UNKNOWN_OP
    with pytest.raises(P.ProtocolError) as e:
        P.req_op({"op": "GET", "rid": -1})
    assert e.value.code == P.BAD_REQUEST


def test_keys_expects_and_limits():
    k = b"k" * 16
    assert [x.raw for x in P.req_keys({"keys": [k, k]})] == [k, k]
    for bad in ({"keys": [b"short"]}, {"keys": "nope"}, {"keys": [k] * (P.MAX_BATCH + 1)}):
        with pytest.raises(P.ProtocolError, match="keys"):
            P.req_keys(bad)
    exp = P.req_expects({"exp": [None, [k, b"\x01\x00\x00\x00"]]}, 2)
    assert exp[0] is None and exp[1].parent.raw == k
    with pytest.raises(P.ProtocolError, match="exp"):
        P.req_expects({"exp": [[b"x", None]]}, 1)
    with pytest.raises(P.ProtocolError, match="exp has 1 items"):
        P.req_expects({"exp": [None]}, 2)


def test_headers_are_decoded_or_refused(blocks_of, ns):
    [(h, _)] = blocks_of(ns, 1, 64)
    assert P.req_headers({"hdrs": [h.encode()]}) == [h]
    with pytest.raises(P.ProtocolError, match=r"hdrs\[0\]"):
        P.req_headers({"hdrs": [b"\x81\xa1v\x02"]})


def test_hello_version_and_namespace():
    with pytest.raises(P.ProtocolError) as e:
        P.parse_hello({"v": 99})
    assert e.value.code == P.BAD_VERSION
    ns = Namespace("m", "float16", 16, tp_size=2, tp_rank=1)
    hello = P.parse_hello({"v": P.PROTOCOL_VERSION, "token": "t", "ns": [P.namespace_to_wire(ns)]})
    back = P.namespace_from_wire(hello.namespaces[0], "", "ns[0]")
    assert back.id == ns.id
    # the salt comes from the daemon, not the client
    assert P.namespace_from_wire(hello.namespaces[0], "acme", "ns[0]").id == ns.with_tenant("acme").id
    with pytest.raises(P.ProtocolError, match=r"ns\[0\]"):
        P.namespace_from_wire({"model": "m", "dtype": "x", "block_tokens": 0}, "", "ns[0]")


def test_results_round_trip(blocks_of, ns):
    [(h, _)] = blocks_of(ns, 1, 64)
    st, hdr, tier = P.get_result_from_wire(P.get_result_to_wire(Status.HIT, h, "dram"))
    assert (st, hdr, tier) == (Status.HIT, h, "dram")
    with pytest.raises(P.ProtocolError):
        P.get_result_from_wire([int(Status.HIT), None, None])
    with pytest.raises(P.ProtocolError):
        P.status_from_wire(99)


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
