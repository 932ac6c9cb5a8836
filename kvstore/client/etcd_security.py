"""How a node or client authenticates to etcd: TLS files and an etcd user (the
``cluster.etcd_*`` keys; docs/cluster.md). Bad files are ConfigErrors naming the key."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import Any

from kvstore.errors import ConfigError


@dataclass(frozen=True)
class EtcdSecurity:
    """TLS files (PEM) and etcd user; all empty: plain HTTP without auth."""

    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    user: str = ""
    password_file: str = ""

    def __post_init__(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ConfigError("cluster.etcd_cert_file and cluster.etcd_key_file: set both or neither")
        if bool(self.user) != bool(self.password_file):
            raise ConfigError("cluster.etcd_user and cluster.etcd_password_file: set both or neither")

    @classmethod
    def of(cls, section: Any) -> EtcdSecurity:
        """From a config section with the ``etcd_*`` keys (kvstore.config.ClusterSection)."""
        return cls(
            section.etcd_ca_file,
            section.etcd_cert_file,
            section.etcd_key_file,
            section.etcd_user,
            section.etcd_password_file,
        )

    @property
    def tls(self) -> bool:
        return bool(self.ca_file or self.cert_file)

    def ssl_context(self) -> ssl.SSLContext | None:
        """None for plain HTTP; ConfigError naming the key whose file cannot be used."""
        if not self.tls:
            return None
        try:
            ctx = ssl.create_default_context(cafile=self.ca_file or None)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"cluster.etcd_ca_file: cannot use {self.ca_file!r}: {exc}") from exc
        if self.cert_file:
            try:
                ctx.load_cert_chain(self.cert_file, self.key_file)
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError(
                    f"cluster.etcd_cert_file/etcd_key_file: cannot use {self.cert_file!r}: {exc}"
                ) from exc
        return ctx

    def password(self) -> str:
        try:
            with open(self.password_file, encoding="utf-8") as f:
                return f.read().strip()
        except OSError as exc:
            raise ConfigError(
                f"cluster.etcd_password_file: cannot read {self.password_file!r}: {exc}"
            ) from exc
