"""The device-free parts of the transports (shared by TCP and verbs), the TCP transport over a
socket pair, and what can be checked of the verbs path without an RDMA device."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

from rdma import verbs
from rdma.transport import QPInfo, RemoteDescriptor, TransportError, batches, check_pairs, select_transport


def test_descriptor_round_trip_and_validation():
    d = RemoteDescriptor(handle=7, addr=2**40, length=4096, rkey=0x1234)
    assert RemoteDescriptor.from_wire(d.to_wire()) == d
    for bad in ([1, 2, 3], [1, 2, 3, -4], [1, 2, 3, 2**64], "x", [True, 1, 1, 1]):
        with pytest.raises(TransportError):
            RemoteDescriptor.from_wire(bad)


def test_qp_info_round_trip_and_validation():
    q = QPInfo(qp_num=0x12, psn=0xABCDE, lid=3, gid=bytes(range(16)), mtu=5)
    assert QPInfo.from_wire(q.to_wire()) == q
    w = q.to_wire()
    for field, value in (("gid", b"short"), ("mtu", 9), ("qpn", 2**24), ("psn", -1)):
        with pytest.raises(TransportError, match="qp info"):
            QPInfo.from_wire({**w, field: value})
    with pytest.raises(TransportError, match="lacks"):
        QPInfo.from_wire({"qpn": 1})


def test_batches_respect_both_limits():
    pairs = [(None, RemoteDescriptor(i, 0, n)) for i, n in enumerate([10, 10, 10, 50, 5, 5, 5, 5])]
    assert list(batches(pairs, max_wr=3, max_bytes=1000)) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert list(batches(pairs, max_wr=100, max_bytes=30)) == [[0, 1, 2], [3], [4, 5, 6, 7]]
    assert list(batches([], 1, 1)) == []
    with pytest.raises(TransportError):
        list(batches(pairs, 0, 10))


def test_selection():
    assert select_transport("tcp", True, True) == "tcp"
    assert select_transport("auto", True, True) == "rdma"
    assert select_transport("auto", True, False) == "tcp"
    assert select_transport("auto", False, True) == "tcp"
    assert select_transport("rdma", True, True) == "rdma"
    with pytest.raises(TransportError, match="no RDMA device"):
        select_transport("rdma", False, True)
    with pytest.raises(TransportError, match="peer"):
        select_transport("rdma", True, False)
    with pytest.raises(TransportError, match="server.transport"):
        select_transport("udp", True, True)


def test_check_pairs_names_short_buffer():
    with pytest.raises(TransportError, match="pair 1"):
        check_pairs([(bytearray(8), RemoteDescriptor(1, 0, 8)), (bytearray(4), RemoteDescriptor(2, 0, 8))])


def test_buffer_address_of_common_buffers():
    arr = np.zeros(1024, np.uint8)
    assert verbs.buffer_address(arr) == (arr.ctypes.data, 1024)
    ba = bytearray(100)
    assert verbs.buffer_address(ba)[1] == 100
    with pytest.raises(TransportError):
        verbs.buffer_address(b"readonly")
    torch = pytest.importorskip("torch")
    t = torch.zeros(16, dtype=torch.bfloat16)
    assert verbs.buffer_address(t) == (t.data_ptr(), 32)
    with pytest.raises(TransportError):
        verbs.buffer_address(torch.zeros(4, 4)[:, 1])


def test_no_device_here_is_reported_cleanly():
    if verbs.device_available():
        pytest.skip("this host has an RDMA device; the device tests below apply")
    with pytest.raises(TransportError):
        verbs.VerbsTransport.open()


@pytest.mark.skipif(not shutil.which("python3"), reason="no system python3")
def test_system_pyverbs_imports_when_installed():
    """Debian's python3-pyverbs is built for the system python, not the venv: import it there."""
    probe = subprocess.run(
        [
            "/usr/bin/python3",
            "-c",
            "import pyverbs.device, pyverbs.qp, pyverbs.mr, pyverbs.wr, pyverbs.enums",
        ],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0 and "No module named 'pyverbs'" in probe.stderr:
        pytest.skip("python3-pyverbs is not installed on this host")
    assert probe.returncode == 0, probe.stderr


@pytest.mark.skipif(
    not verbs.device_available(), reason="needs an RDMA device (none on this host: no kernel RDMA)"
)
async def test_verbs_loopback_read_write():  # pragma: no cover - never ran here
    a, b = verbs.VerbsTransport.open(), verbs.VerbsTransport.open()
    src, dst = np.arange(1 << 20, dtype=np.uint8), np.zeros(1 << 20, np.uint8)
    mr_src = a.register(src)
    b.register(dst)
    a.connect(b.local_info())
    b.connect(a.local_info())
    desc = RemoteDescriptor(0, src.ctypes.data, src.nbytes, mr_src.rkey)
    assert await b.read([(dst, desc)]) == [True]
    assert (dst == src).all()
    await a.close()
    await b.close()


async def test_offloaded_channel_moves_large_payloads_and_cancels_cleanly():
    import asyncio
    import socket
    from concurrent.futures import ThreadPoolExecutor

    from rdma.tcp import SocketChannel

    pool = ThreadPoolExecutor(2)
    a_sock, b_sock = socket.socketpair()
    a, b = SocketChannel(a_sock, offload=pool), SocketChannel(b_sock, offload=pool)
    big = np.random.default_rng(1).integers(0, 256, 3 << 20, dtype=np.uint8)
    send = asyncio.ensure_future(a.send_frame({"op": "PUT", "rid": 1}, [big]))
    h = await b.recv_header(1 << 20, 8 << 20)
    dst = np.zeros(h["plen"], np.uint8)
    await b.recv_into(dst)
    await send
    assert (dst == big).all() and b.bytes_in >= big.nbytes
    # a receive that never completes: cancelling it returns only after the worker stopped
    stuck = asyncio.ensure_future(b.recv_into(bytearray(1 << 20)))
    await asyncio.sleep(0.2)
    stuck.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(stuck, 5)
    a.close()
    b.close()
    pool.shutdown()
