"""Real ``kvstore serve`` daemons for tests: subprocesses on ephemeral loopback ports, each
with its own config and data under a tmp dir. Used by the ``start_daemon`` fixture
(tests/conftest.py)."""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import msgpack
from polling import until

from kvstore import protocol as P
from kvstore.keys import Namespace
from kvstore.results import Status

REPO = Path(__file__).resolve().parents[1]
_LEN = struct.Struct(">I")


def stop_process(proc: subprocess.Popen, timeout_s: float = 30.0) -> int:
    """SIGTERM ``proc`` (if it runs), SIGKILL it if it has not exited within ``timeout_s``;
    its exit status."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


class Daemon:
    def __init__(self, proc: subprocess.Popen, ports: dict, workdir: Path, log: Path) -> None:
        self.proc = proc
        self.ports = ports
        self.workdir = workdir
        self.log = log

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.ports['data_port']}"

    @property
    def data_port(self) -> int:
        return self.ports["data_port"]

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.ports['admin_port']}"

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 30.0) -> int:
        return stop_process(self.proc, timeout)

    def kill9(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def logs(self) -> str:
        return self.log.read_text(errors="replace")


def _toml(value) -> str:
    return (
        json.dumps(value)
        if isinstance(value, str)
        else str(value).lower()
        if isinstance(value, bool)
        else str(value)
    )


def launch_daemon(wd: Path, use_disk: bool = True, env: dict[str, str] | None = None, **sections) -> Daemon:
    """Write a config into ``wd``, start ``kvstore serve`` on ephemeral loopback ports, wait
    for its port file. ``sections`` override config tables ({"auth": {...}}); ``env``: the
    daemon's environment (default: this process's; ``TIERKV_*`` variables are dropped either
    way). RuntimeError with the daemon's log when it does not come up (``wait_serving``)."""
    wd.mkdir(parents=True, exist_ok=True)
    cfg = {
        "dram": {"capacity": "64MiB", "slab_size": "4MiB"},
        "disk": {"enabled": True, "path": str(wd / "disk"), "capacity": "256MiB", "sync": False},
        "server": {"port_file": str(wd / "ports.json")},
    }
    for sec, values in sections.items():
        cfg.setdefault(sec, {}).update(values)
    if not use_disk:
        cfg["disk"] = {"enabled": False}
    text = "".join(
        f"[{sec}]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in vals.items()) for sec, vals in cfg.items()
    )
    (wd / "node.toml").write_text(text)
    port_file = wd / "ports.json"
    port_file.unlink(missing_ok=True)
    log = wd / "daemon.log"
    env = {k: v for k, v in (os.environ if env is None else env).items() if not k.startswith("TIERKV_")}
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvstore.cli", "serve", "--config", str(wd / "node.toml")],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    return Daemon(proc, wait_serving(proc, port_file, log), wd, log)


def wait_serving(proc: subprocess.Popen, port_file: Path, log: Path, deadline_s: float = 60.0) -> dict:
    """The ports a starting ``kvstore serve`` wrote to ``port_file``, once it did (a generous
    bound: a loaded host imports slowly). RuntimeError with its log when it exits first or
    does not serve within ``deadline_s`` (it is killed then)."""

    def serving() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(
                f"daemon exited ({proc.returncode}) before serving:\n{log.read_text(errors='replace')}"
            )
        return port_file.exists()

    try:
        until(serving, deadline_s, f"the daemon to write {port_file.name}")
    except AssertionError as exc:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"daemon did not start ({exc}):\n{log.read_text(errors='replace')}") from None
    return json.loads(port_file.read_text())


# ---------------------------------------------------------------- a raw data-port peer
# Attack tests speak the frame format by hand on blocking sockets, so they can stop reading or
# writing in the middle of a frame (what a hostile or stalled client does).


def frame(header: dict[str, Any], plen: int = 0) -> bytes:
    """A frame's length prefix and header (the caller sends ``plen`` payload bytes after it)."""
    if plen:
        header = {**header, "plen": plen}
    body = msgpack.packb(header, use_bin_type=True)
    return _LEN.pack(len(body)) + body


def rss_bytes(pid: int) -> int:
    """The resident memory of process ``pid`` (VmRSS), in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def unread_bytes(port: int, local_port: int) -> int | None:
    """Bytes the daemon listening on ``port`` has not yet read from the connection whose client
    end is ``local_port`` (its receive queue in /proc/net/tcp), None when not found."""
    q = _tcp_queues(port, local_port)
    return None if q is None else q[1]


def unsent_bytes(port: int, local_port: int) -> int | None:
    """Bytes the daemon listening on ``port`` has sent to ``local_port`` and not had
    acknowledged (its send queue in /proc/net/tcp), None once that connection is no longer
    established."""
    q = _tcp_queues(port, local_port)
    return None if q is None else q[0]


def _tcp_queues(port: int, local_port: int) -> tuple[int, int] | None:
    """(send queue, receive queue) of the established connection from ``port`` to ``local_port``."""
    with open("/proc/net/tcp") as f:
        for row in (line.split() for line in f.readlines()[1:]):
            here, there = int(row[1].split(":")[1], 16), int(row[2].split(":")[1], 16)
            if here == port and there == local_port and row[3] == "01":
                tx, rx = row[4].split(":")
                return int(tx, 16), int(rx, 16)
    return None


def closed_by_peer(sock: socket.socket) -> bool:
    """True when the peer closed ``sock`` (EOF or reset) within the socket's timeout; any
    bytes it sent before are read and dropped."""
    try:
        while True:
            if not sock.recv(1 << 16):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


class RawPeer:
    """One connection. ``rcvbuf`` shrinks the receive buffer before connecting, so a reader
    that stops reading stalls the sender quickly."""

    def __init__(self, port: int, rcvbuf: int | None = None, timeout: float = 10.0) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(timeout)
        self.sock.connect(("127.0.0.1", port))
        self.port = port
        self._rid = 0

    def hello(self, token: str, ns: Namespace) -> dict[str, Any]:
        """HELLO with ``ns``: its reply, asserted ok."""
        reply = self.hello_reply(token, [ns])
        assert reply.get("ok"), reply
        return reply

    def hello_reply(self, token: str, nss: list[Namespace]) -> dict[str, Any]:
        """HELLO with the namespaces ``nss``: its reply, whatever it says."""
        hello = {"op": "HELLO", "rid": 0, "v": P.PROTOCOL_VERSION, "token": token}
        self.send(frame({**hello, "ns": [P.namespace_to_wire(n) for n in nss]}))
        return self.reply()

    def request(self, header: dict[str, Any], plen: int = 0) -> None:
        """Send a request's header (and announce ``plen`` payload bytes, not sent here)."""
        self._rid += 1
        self.send(frame({**header, "rid": self._rid}, plen))

    def put_each(self, blocks) -> None:
        """PUT each ``(header, payload)`` of ``blocks`` in a request of its own; each must be
        STORED."""
        for h, payload in blocks:
            self.request({"op": "PUT", "hdrs": [h.encode()]}, plen=len(payload))
            self.send(payload)
            st = self.reply()["st"][0]
            assert st == int(Status.STORED), f"PUT of {h.key}: status {st}"

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def until_read(self, what: str, deadline_s: float = 20.0) -> None:
        """Wait until the daemon has read every byte sent on this connection (nothing left in
        its receive queue): ``what`` names it in the failure."""
        until(
            lambda: unread_bytes(self.port, self.sock.getsockname()[1]), deadline_s, what, ok=lambda n: n == 0
        )

    def exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(min(n - len(buf), 1 << 20))
            if not chunk:
                raise ConnectionError(f"closed after {len(buf)} of {n} bytes")
            buf += chunk
        return bytes(buf)

    def reply(self) -> dict[str, Any]:
        (n,) = _LEN.unpack(self.exact(4))
        return msgpack.unpackb(self.exact(n), raw=False)

    def closed_by_peer(self) -> bool:
        """True when the daemon has closed this connection (EOF or reset; a reply frame sent
        before closing is read and dropped)."""
        return closed_by_peer(self.sock)

    def flood(self, data: bytes) -> None:
        """Send ``data`` again and again from a thread of its own, never reading a reply,
        until the daemon closes the connection."""

        def push() -> None:
            try:
                while True:
                    self.send(data)
            except OSError:
                pass  # the daemon closed the connection

        threading.Thread(target=push, daemon=True).start()

    def close(self) -> None:
        self.sock.close()
