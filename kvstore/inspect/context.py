"""What every inspection subcommand shares: global options, its parser, one aiohttp session per
run, and the exit-status contract (0 success, 1 the thing asked for is absent, 2 usage or
connection error with a message naming the node and what failed). The subcommand modules
(cmd_*.py) import this one; kvstore/inspect/command.py registers them."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # rich and aiohttp load when a command runs, not for `kvstore serve`
    from kvstore.inspect.admin_client import AdminClient
    from kvstore.inspect.output import Output

EXIT_CODES = """exit status: 0 success; 1 the block (or blocks) asked for is absent on every node;
2 usage error, or a node that cannot be reached or refuses (the message names the node)."""


@dataclass
class Context:
    """What a command's coroutine gets: parsed args, the printer and one client per node."""

    args: argparse.Namespace
    out: Output
    nodes: list[AdminClient]


Command = Callable[[Context], Awaitable[int]]


def common_options() -> argparse.ArgumentParser:
    """The global options every inspection subcommand takes (after the subcommand name)."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("global options")
    g.add_argument(
        "--node",
        action="append",
        default=[],
        metavar="URL",
        help="admin URL of a node, e.g. http://127.0.0.1:7401 (repeatable: the command asks every node)",
    )
    g.add_argument(
        "--cluster",
        metavar="etcd://HOST:PORT/NAME",
        help="ask every node registered in this etcd cluster (kvstore serve --join); combines with --node",
    )
    g.add_argument(
        "--token-file",
        metavar="PATH",
        help="file holding the operator token (first word of its first non-comment line)",
    )
    g.add_argument(
        "--json", action="store_true", help="print one JSON document (see docs/cli.md) instead of tables"
    )
    g.add_argument(
        "--timeout", type=float, default=10.0, metavar="SECONDS", help="per-request deadline (default 10)"
    )
    return p


def _cluster_admin_urls(url: str, timeout_s: float) -> list[str]:
    """Admin URLs of the nodes registered under an ``etcd://`` cluster URL (the store facade's
    :func:`kvstore.client.members`). UsageError naming the URL when it is bad, etcd does not
    answer, or no node registered an admin address."""
    from kvstore.client import ConfigError, members
    from kvstore.inspect.admin_client import UsageError

    try:
        found = asyncio.run(members(url, timeout_s))
    except ConfigError as exc:
        raise UsageError(f"--cluster: {exc}") from exc
    except ConnectionError as exc:
        raise UsageError(f"--cluster {url}: {exc}") from exc
    urls = [f"http://{m.admin}" for m in found if m.admin]
    if not urls:
        raise UsageError(f"--cluster {url}: no node of this cluster registered an admin address")
    return urls


def _resolve(args: argparse.Namespace) -> tuple[list[str], str]:
    from kvstore.inspect.admin_client import UsageError, normalize_url, read_token

    if args.cluster:
        args.node = [*(args.node or []), *_cluster_admin_urls(args.cluster, args.timeout)]
    if not args.node:
        raise UsageError(
            "no node given: pass --node URL (the admin URL of a node, e.g. http://127.0.0.1:7401)"
        )
    if not args.timeout > 0:
        raise UsageError(f"--timeout {args.timeout}: must be > 0")
    urls = list(dict.fromkeys(normalize_url(u) for u in args.node))
    token = read_token(args.token_file) if args.token_file else ""
    return urls, token


def runner(prog: str, fn: Command) -> Callable[[argparse.Namespace], int]:
    """Wrap a command coroutine into an argparse ``func`` returning the exit status."""

    def run(args: argparse.Namespace) -> int:
        from kvstore.inspect.admin_client import NodeError, UsageError
        from kvstore.inspect.output import Output

        out = Output(args.json)
        try:
            urls, token = _resolve(args)
            return asyncio.run(_session(fn, args, out, urls, token))
        except UsageError as exc:
            out.error(prog, str(exc))
            return 2
        except NodeError as exc:
            out.error(prog, str(exc), exc.node)
            return 2
        except KeyboardInterrupt:
            out.error(prog, "interrupted")
            return 130

    return run


async def _session(fn: Command, args, out: Output, urls: list[str], token: str) -> int:
    from kvstore.inspect.admin_client import AdminClient, make_session

    async with make_session(token, args.timeout) as session:
        nodes = [AdminClient(u, session, args.timeout) for u in urls]
        return await fn(Context(args, out, nodes))


def add_parser(sub, name: str, help_: str, description: str, json_doc: str) -> argparse.ArgumentParser:
    """A subcommand parser with the global options, a description and the JSON/exit epilog."""
    return sub.add_parser(
        name,
        help=help_,
        description=description,
        epilog=f"--json output: {json_doc}\n\n{EXIT_CODES}",
        parents=[common_options()],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


async def gather_nodes(ctx: Context, fn: Callable[[AdminClient], Awaitable]) -> list:
    """Run ``fn`` on every node concurrently; the first NodeError (in node order) propagates."""
    results = await asyncio.gather(*(fn(n) for n in ctx.nodes), return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results
