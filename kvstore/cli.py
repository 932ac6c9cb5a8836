"""The ``kvstore`` command. Each subcommand registers itself from its own module
(``add_*_command(subparsers)``) and sets ``func``; ``main`` dispatches."""

from __future__ import annotations

import argparse
import sys

from kvstore.daemon.command import add_serve_command
from kvstore.inspect.command import add_inspect_commands


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvstore", description="tierkv storage node and tools")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_command(sub)
    add_inspect_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
