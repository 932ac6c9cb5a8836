"""The admin port under denial-of-service (issue 22), against a real daemon: behind the same
kind of limits as the data port (a connection cap that drops the flooder's oldest, header and
request deadlines, a body limit), and ``/healthz`` answers while it is flooded."""

from __future__ import annotations

import json
import resource
import socket
import time
import urllib.error
import urllib.request

import pytest
from daemonutil import RawPeer, closed_by_peer

TOK_OP = "tok-operator1"


@pytest.fixture
def admin(authed_daemon):
    def start(**limits):
        return authed_daemon({"tok-tenant-a1": "alpha", TOK_OP: "*"}, limits=limits)

    return start


def port(d) -> int:
    return d.ports["admin_port"]


def connect(d, source: str = "127.0.0.1", timeout: float = 10.0) -> socket.socket:
    s = socket.socket()
    s.bind((source, 0))
    s.settimeout(10.0)
    s.connect(("127.0.0.1", port(d)))
    s.settimeout(timeout)
    return s


def healthz(d) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port(d)}/healthz", timeout=10) as r:
        return r.status


def post(d, path: str, body: bytes) -> tuple[int, str]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port(d)}{path}", data=body, method="POST",
        headers={"Authorization": f"Bearer {TOK_OP}", "Content-Type": "application/json"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_idle_and_slowloris_admin_connections_are_closed(admin):
    d = admin(admin_header_timeout_s=1.0)
    idle = connect(d)
    slow = connect(d)
    slow.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
    shut, end = False, time.monotonic() + 15
    while not shut and time.monotonic() < end:  # one header byte every 0.25 s, never done
        try:
            slow.sendall(b"X")
        except (BrokenPipeError, ConnectionResetError):
            shut = True
        time.sleep(0.25)
    assert shut
    assert closed_by_peer(idle)
    assert healthz(d) == 200


def test_a_flood_of_admin_connections_is_capped_and_healthz_answers(admin):
    d = admin(admin_max_connections=16)
    flood = [connect(d, "127.0.0.2", timeout=0.5) for _ in range(200)]
    assert [healthz(d) for _ in range(20)] == [200] * 20  # the liveness probe, from elsewhere
    shut = sum(closed_by_peer(s) for s in flood)
    assert shut >= 200 - 16, shut
    for s in flood:
        s.close()


def test_admin_bodies_are_bounded_and_deep_json_is_a_400(admin):
    d = admin(admin_request_timeout_s=2.0)
    status, text = post(d, "/v1/lookup", b"[" * 100_000 + b"]" * 100_000)
    assert status == 400 and len(text.strip().splitlines()) == 1, (status, text[:200])
    # a Content-Length of 50 MB with no body behind it: 413 at once (over admin_max_body)
    s = connect(d, timeout=15)
    s.sendall(
        f"POST /v1/lookup HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOK_OP}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {50 * 10**6}\r\n\r\n".encode()
    )
    assert s.recv(1 << 16).startswith(b"HTTP/1.1 413")
    assert closed_by_peer(s)
    # a small Content-Length with no body behind it: closed at the request deadline
    s = connect(d, timeout=15)
    s.sendall(
        f"POST /v1/lookup HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOK_OP}\r\n"
        "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n".encode()
    )
    assert closed_by_peer(s)
    status, text = post(d, "/v1/lookup", json.dumps({"keys": []}).encode())
    assert status == 200, text
    assert "Traceback" not in d.logs()


def test_failed_accepts_are_logged_rate_limited_without_tracebacks(admin, ns):
    """The daemon's nofile limit is lowered to 200 (prlimit) and both ports are flooded past
    it (pre-auth and admin connections, then authenticated ones): accept fails with EMFILE
    for seconds, and the log holds at most a few rate-limited lines for it and no traceback
    (before: one line per failure on the data port, one traceback per failure on the admin
    port)."""
    d = admin(max_unauthenticated=64, admin_max_connections=64, hello_timeout_s=60.0)
    try:
        resource.prlimit(d.proc.pid, resource.RLIMIT_NOFILE, (200, 200))
    except (OSError, ValueError) as exc:
        pytest.skip(f"cannot lower the daemon's nofile limit here: {exc}")
    held = []
    for _ in range(64):
        held.append(connect(d, "127.0.0.2"))
    for _ in range(120):  # authenticated: these count against the tenant cap, not a pre-auth share
        try:
            p = RawPeer(d.data_port, timeout=2)
            p.hello("tok-tenant-a1", ns)
            held.append(p.sock)
        except (AssertionError, ConnectionError, OSError):
            break
    extra = []
    end = time.monotonic() + 4
    while time.monotonic() < end:  # keep knocking on both ports while the fds are spent
        for p in (d.data_port, port(d)):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", p))
            extra.append(s)
        time.sleep(0.01)
    logs = d.logs()
    assert logs.count("event=accept_failed") >= 1  # the fds were spent indeed
    assert logs.count("event=accept_failed") <= 40, logs.count("event=accept_failed")
    assert "Traceback" not in logs
    for s in held + extra:
        s.close()
    assert healthz(d) == 200
