"""The ``kvstore serve`` subcommand: parse flags, load the config, run the daemon."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from kvstore.daemon.logs import kv, setup_logging
from kvstore.errors import ConfigError, TierKVError


def add_serve_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run a storage node daemon (data port + admin port)")
    p.add_argument("--config", help="TOML config file (see docs/operations.md)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config key (repeatable), e.g. --set dram.capacity=1GiB",
    )
    p.add_argument("--join", metavar="etcd://HOST:PORT/CLUSTER", help="register in etcd (cluster.join)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.set_defaults(func=run_serve)


def _overrides(items: list[str]) -> dict[str, object]:
    import tomllib

    out: dict[str, object] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item!r}: expected SECTION.KEY=VALUE")
        try:  # TOML literal (numbers, booleans, quoted strings); bare words stay strings
            out[key.strip()] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            out[key.strip()] = value
    return out


def run_serve(args: argparse.Namespace) -> int:
    from kvstore.config import load_store_config
    from kvstore.daemon.server import serve

    setup_logging(args.log_level)
    log = logging.getLogger("kvstore.daemon")
    try:
        sets = _overrides(args.set)
        if getattr(args, "join", None):
            sets["cluster.join"] = args.join
        cfg = load_store_config(args.config, sets)
        if cfg.cluster.join or cfg.cluster.peers:  # a member: registration and repair around it
            from kvstore.daemon.member import serve_member

            asyncio.run(serve_member(cfg))
        else:
            asyncio.run(serve(cfg))
    except TierKVError as exc:  # bad config, token file, tier path or device: say which, exit 2
        log.error(kv("start_failed", error=exc))
        print(f"kvstore serve: {exc}", file=sys.stderr)
        return 2
    return 0
