"""The storage-node daemon (``kvstore serve``): data port, admin port, auth, metrics.

Import :mod:`kvstore.daemon.server` for the daemon itself; this package file stays light."""
