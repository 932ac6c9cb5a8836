"""Registers the inspection subcommands (the cmd_*.py modules) on the ``kvstore`` parser. The
subcommands share kvstore/inspect/context.py, never this module, so no command module imports
back here."""

from __future__ import annotations

__all__ = ["add_inspect_commands"]


def add_inspect_commands(sub) -> None:
    """Register ls, show, lookup, stats, verify, evict, pin and unpin on ``sub``."""
    from kvstore.inspect import cmd_blocks, cmd_lookup, cmd_manage, cmd_stats, cmd_verify

    cmd_blocks.register(sub)
    cmd_lookup.register(sub)
    cmd_stats.register(sub)
    cmd_verify.register(sub)
    cmd_manage.register(sub)
