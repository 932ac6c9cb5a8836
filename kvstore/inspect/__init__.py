"""The block inspection CLI: ``kvstore ls | show | lookup | stats | verify | evict | pin | unpin``.

Every command talks to the daemons' admin HTTP API (docs/cli.md). Nothing heavy is imported
here; each command module imports what it needs when it runs.
"""
