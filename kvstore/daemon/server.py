"""The daemon: a NodeStore behind a data port and an admin port, until SIGTERM.

``Daemon.start(cfg)`` binds the data port (a busy port fails at once), starts the admin port
(``/readyz`` 503), opens the node (rebuilding the disk index), only then listens on the data
port (before, a connect is refused rather than left hanging; port 0: ephemeral), writes ``server.port_file`` (JSON ``{"host", "data_port", "admin_port", "pid"}``,
atomically) and serves. SIGHUP reloads the token file (a bad file keeps the old table and is
logged) and closes the connections whose token it no longer holds; SIGTERM/SIGINT stop accepting, let in-flight requests finish and close the node
(which flushes the disk tier). Without ``auth.token_file`` the daemon binds to loopback only.
Everything runs on one event loop; nothing here is thread-safe.
"""

from __future__ import annotations

import asyncio
import gc
import ipaddress
import json
import logging
import os
import signal
import socket

from aiohttp import web

from kvstore.config import StoreConfig
from kvstore.daemon.admin import make_app
from kvstore.daemon.admin_listener import AdminListener, RequestErrorLog
from kvstore.daemon.auth import TokenTable
from kvstore.daemon.dataport import DataServer
from kvstore.daemon.logs import kv
from kvstore.daemon.metrics import DaemonMetrics
from kvstore.daemon.slab_rdma import SlabRdma, decide, start_rdma
from kvstore.errors import ConfigError

log = logging.getLogger("kvstore.daemon")
GRACE_S = 30.0


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _bind(host: str, port: int) -> socket.socket:
    """Bind (a busy port fails the start at once) but do not listen: until :meth:`Daemon.start`
    calls ``listen`` a connect is refused, which clients retry, instead of hanging in a
    backlog nobody serves while the node opens."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"server: cannot bind {host}:{port}: {exc.strerror}") from exc
    return sock


def _raise_nofile() -> None:
    """Lift the soft limit on open files to the hard one: the connection limits, not the
    default 1024, decide how many clients the daemon holds."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, ValueError, OSError) as exc:
        log.warning(kv("nofile_unchanged", error=exc))


class Daemon:
    def __init__(self, cfg: StoreConfig) -> None:
        self.cfg = cfg
        self.node = None
        self.tokens = TokenTable.load(cfg.auth.token_file, cfg.auth.salt_secret_file)
        self.host = cfg.server.host
        self.data: DataServer | None = None
        self.metrics: DaemonMetrics | None = None
        self.rdma: SlabRdma | None = None
        self._runner: web.AppRunner | None = None
        self._admin: AdminListener | None = None
        self._stopped = asyncio.Event()
        self.data_port = 0
        self.admin_port = 0
        self.orphans = None  # a cluster member's orphan pass (kvstore/daemon/member.py)

    @classmethod
    async def start(cls, cfg: StoreConfig) -> Daemon:
        """Open everything and start serving. Raises ConfigError (bad token file, port in use,
        ``server.transport = "rdma"`` without a usable device) before serving anything. With
        RDMA the DRAM slab is registered once here (docs/rdma.md)."""
        from kvstore.node.store import NodeStore  # heavy (tiers); only the daemon needs it
        from rdma.verbs import device_available

        self = cls(cfg)
        if not self.tokens.enabled and not _is_loopback(self.host):
            log.warning(kv("no_auth_loopback_only", requested_host=self.host, host="127.0.0.1"))
            self.host = "127.0.0.1"
        elif not self.tokens.enabled:
            log.warning(kv("no_auth", host=self.host, note="no auth.token_file: loopback only"))
        if self.tokens.enabled and not self.tokens.secret:
            log.warning(kv("salt_not_secret", note="no auth.salt_secret_file: tenant salts are tenant names"))
        _raise_nofile()
        chosen = decide(cfg.server, cfg.server.transport != "tcp" and device_available())
        data_sock = _bind(self.host, cfg.server.data_port)
        # the admin port first: /healthz answers and /readyz says 503 while the node opens
        # (prefaulting or pinning a large arena, rebuilding the disk index can take seconds)
        self.metrics = DaemonMetrics(lambda: self.node.inspector.stats() if self.node is not None else {})
        try:
            await self._start_admin()
            self.node = await NodeStore.open(cfg)
            self.rdma = start_rdma(cfg.server, chosen, self.node.dram_buffer)
        except BaseException:
            data_sock.close()
            if self.node is not None:
                await self.node.close()
            if self._admin is not None:
                await self._admin.stop()
            if self._runner is not None:
                await self._runner.cleanup()
            raise
        self.data = DataServer(self.node, data_sock, self.tokens, self.metrics, cfg, self.rdma)
        data_sock.listen(512)  # only now: the node is open and can serve what connects
        self.data.start()
        # what exists now (modules, the opened node's tables) lives as long as the daemon:
        # keep it out of the collector's full passes, which would walk it on the loop (~30 ms
        # per pass beside a 100k-block node, measured in-process; 6 ms after freezing)
        gc.freeze()
        self.data_port = data_sock.getsockname()[1]
        self._write_port_file()
        log.info(
            kv(
                "serving",
                host=self.host,
                data_port=self.data_port,
                admin_port=self.admin_port,
                auth="on" if self.tokens.enabled else "off",
                pid=os.getpid(),
            )
        )
        return self

    async def _start_admin(self) -> None:
        """The admin app behind its own listener (kvstore/daemon/admin_listener.py: the
        connection cap, header and request deadlines, the body limit)."""
        sock = _bind(self.host, self.cfg.server.admin_port)
        sock.listen(128)
        self._admin = AdminListener(sock, self.cfg.limits, self.metrics)
        app = make_app(
            lambda: self.node,
            self.metrics,
            lambda: self.tokens,
            self.ready,
            self.cfg.limits,
            self._admin.middleware,
            lambda: self.orphans,
        )
        # parser errors: one rate-limited, counted line each, never aiohttp's traceback
        self._runner = web.AppRunner(
            app, access_log=None, handle_signals=False, logger=RequestErrorLog(self.metrics)
        )
        await self._runner.setup()
        self._admin.start(self._runner.server)
        self.admin_port = sock.getsockname()[1]
        log.info(kv("admin_listening", host=self.host, admin_port=self.admin_port))

    def ready(self) -> bool:
        """True once the data port listens on an open node, until shutdown begins."""
        return self.data is not None and not self.data.closing

    def _write_port_file(self) -> None:
        path = self.cfg.server.port_file
        if not path:
            return
        doc = {
            "host": self.host,
            "data_port": self.data_port,
            "admin_port": self.admin_port,
            "pid": os.getpid(),
        }
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f)
        os.replace(tmp, path)

    def reload_tokens(self) -> None:
        """SIGHUP: swap in the token file's current content; keep the old table on error."""
        try:
            table = TokenTable.load(self.cfg.auth.token_file, self.cfg.auth.salt_secret_file)
        except ConfigError as exc:
            log.error(kv("token_reload_failed", error=exc))
            return
        if table.enabled != self.tokens.enabled:
            log.error(kv("token_reload_failed", error="auth cannot be switched on or off by reload"))
            return
        self.tokens = table
        closed = 0
        if self.data is not None:
            self.data.tokens = table
            closed = self.data.revoke(table)
        log.info(kv("tokens_reloaded", entries=len(table.entries), connections_closed=closed))

    def install_signals(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.request_stop, "SIGTERM")
        loop.add_signal_handler(signal.SIGINT, self.request_stop, "SIGINT")
        loop.add_signal_handler(signal.SIGHUP, self.reload_tokens)

    def request_stop(self, why: str = "") -> None:
        log.info(kv("stopping", signal=why or "-"))
        self._stopped.set()

    async def stop_requested(self) -> None:
        """Return once a stop was asked (SIGTERM/SIGINT); the caller then calls :meth:`shutdown`
        (a cluster member stops its background passes in between: kvstore/daemon/member.py)."""
        await self._stopped.wait()

    async def run_until_stopped(self) -> None:
        await self.stop_requested()
        await self.shutdown()

    async def shutdown(self) -> None:
        """Stop accepting, finish in-flight requests, close the admin port, close the node."""
        if self.data is not None:
            await self.data.stop(GRACE_S)
        if self._admin is not None:
            await self._admin.stop()
        if self._runner is not None:
            await self._runner.cleanup()
        if self.rdma is not None:
            self.rdma.close()  # after every connection (and its queue pair) has ended
        if self.node is not None:
            await self.node.close()
        log.info(kv("stopped"))


async def serve(cfg: StoreConfig) -> None:
    daemon = await Daemon.start(cfg)
    daemon.install_signals()
    await daemon.run_until_stopped()
