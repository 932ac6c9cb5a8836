"""Certificates for a TLS etcd, made at test time with the ``openssl`` CLI: a CA, a server
certificate for 127.0.0.1 and a client certificate, all PEM, in one directory."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

OPENSSL_MISSING = "the openssl CLI is not installed (Debian: openssl); it makes the test certificates"


def openssl_missing() -> str:
    return "" if shutil.which("openssl") else OPENSSL_MISSING


@dataclass(frozen=True)
class TlsFiles:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _run(*args: str, cwd: Path) -> None:
    r = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    if r.returncode:
        raise RuntimeError(f"openssl {' '.join(args)}: {r.stderr.strip()}")


def make_certs(d: Path) -> TlsFiles:
    """The server certificate also allows client auth: etcd's JSON gateway dials its own gRPC
    port with it when client certificates are required."""
    d.mkdir(parents=True, exist_ok=True)
    _run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=tierkv-test-ca",
         "-keyout", "ca-key.pem", "-out", "ca.pem", cwd=d)  # fmt: skip
    (d / "server.ext").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n"
    )
    (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    # the client certificate has no CommonName: etcd 3.4's JSON gateway refuses requests whose
    # certificate has one once auth is on (it would otherwise take the CN for the user)
    for who, subj in (("server", "/CN=tierkv-server"), ("client", "/O=tierkv-client")):
        _run("req", "-newkey", "rsa:2048", "-nodes", "-subj", subj,
             "-keyout", f"{who}-key.pem", "-out", f"{who}.csr", cwd=d)  # fmt: skip
        _run("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.pem", "-CAkey", "ca-key.pem", "-CAcreateserial",
             "-days", "2", "-extfile", f"{who}.ext", "-out", f"{who}.pem", cwd=d)  # fmt: skip
    return TlsFiles(
        d / "ca.pem", d / "server.pem", d / "server-key.pem", d / "client.pem", d / "client-key.pem"
    )
