"""A throwaway etcd server for tests: its own data dir, ports picked at run time, on a given
host (loopback, or the test bridge's address so namespaced daemons reach it)."""

from __future__ import annotations

import shutil
import ssl
import subprocess
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from cluster.etcd_tls import TlsFiles
from daemonutil import stop_process
from polling import until, until_async
from ports import free_port

if TYPE_CHECKING:
    from kvstore.client.etcd_membership import EtcdMembership

ETCD_MISSING = "etcd is not installed (Debian: etcd-server; `make test` installs it when run as root)"


async def until_view(
    m: EtcdMembership,
    what: str,
    want: Iterable[str] | None = None,
    ok: Callable[[list[str]], bool] | None = None,
    deadline_s: float = 30.0,
) -> list[str]:
    """Await ``m``'s view (its members' addresses, sorted) being ``want``'s addresses, or
    satisfying ``ok``; woken by each change of the view. Returns that view."""
    wanted = sorted(want) if want is not None else None
    return await until_async(
        lambda: sorted(x.addr for x in m.members),
        deadline_s,
        what,
        ok=ok or (lambda got: got == wanted),
        interval_s=0.2,
        wait=lambda pause_s: m.wait_changed(m.version, pause_s),
    )


def etcd_missing() -> str:
    """The one skip reason of every test that needs etcd ('' when it is installed)."""
    return "" if shutil.which("etcd") else ETCD_MISSING


class Etcd:
    def __init__(self, workdir: Path, host: str = "127.0.0.1", tls: TlsFiles | None = None) -> None:
        """``tls``: serve HTTPS only and require a client certificate signed by ``tls.ca``."""
        self.workdir = workdir
        self.host = host
        self.tls = tls
        self.client_port = free_port(host)
        self.peer_port = free_port(host)
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    def url(self, cluster: str) -> str:
        return f"etcd://{self.endpoint}/{cluster}"

    def start(self, timeout_s: float = 30.0) -> None:
        exe = shutil.which("etcd")
        if exe is None:
            raise RuntimeError(ETCD_MISSING)  # callers skip first (etcd_missing)
        scheme = "https" if self.tls else "http"
        c, p = f"{scheme}://{self.endpoint}", f"http://{self.host}:{self.peer_port}"
        tls_args = (
            [
                f"--cert-file={self.tls.server_cert}",
                f"--key-file={self.tls.server_key}",
                f"--trusted-ca-file={self.tls.ca}",
                "--client-cert-auth",
            ]
            if self.tls
            else []
        )
        log = open(self.workdir / "etcd.log", "ab")  # noqa: SIM115 - closed with the process
        self.proc = subprocess.Popen(
            [
                exe,
                "--name=t",
                f"--data-dir={self.workdir / 'etcd-data'}",
                f"--listen-client-urls={c}",
                f"--advertise-client-urls={c}",
                f"--listen-peer-urls={p}",
                f"--initial-advertise-peer-urls={p}",
                f"--initial-cluster=t={p}",
                *tls_args,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()

        def healthy() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited: {(self.workdir / 'etcd.log').read_text(errors='replace')}")
            try:
                with urllib.request.urlopen(f"{c}/health", timeout=1, context=self.ssl_context()) as r:
                    return b"true" in r.read()
            except OSError:
                return False

        try:
            until(healthy, timeout_s, "etcd healthy")
        except AssertionError as exc:
            raise RuntimeError(
                f"etcd did not start ({exc}): {(self.workdir / 'etcd.log').read_text(errors='replace')}"
            ) from None

    def ssl_context(self) -> ssl.SSLContext | None:
        """A client context for the test itself (CA + client certificate), None without TLS."""
        if not self.tls:
            return None
        ctx = ssl.create_default_context(cafile=str(self.tls.ca))
        ctx.load_cert_chain(str(self.tls.client_cert), str(self.tls.client_key))
        return ctx

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, 10.0)
