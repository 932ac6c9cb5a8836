"""connector: the engine's KV connector on top of tierkv's store. ``create`` is the factory the
engine's connector registry imports lazily for the ``kvstore://``, ``local://`` and ``etcd://``
schemes."""


def create(url: str, ctx):
    """Build a :class:`connector.store_connector.StoreConnector` for ``url``. Raises
    ConfigError naming the URL when it or its options are bad."""
    from connector.config import parse_connector_url
    from connector.store_connector import StoreConnector

    return StoreConnector(ctx, parse_connector_url(url))
