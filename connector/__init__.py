"""connector: the engine's KV connector on top of tierkv's store. ``create`` is the factory the
engine's connector registry imports lazily for the ``kvstore://``, ``local://`` and ``etcd://``
schemes."""


def create(url: str, ctx):
    """Build a :class:`connector.store_connector.StoreConnector` for ``url``. Raises the
    engine's ConnectorError naming the URL when it or its options are bad: this is the seam
    between the store's errors and the engine's, so ``kvengine`` reports it as a usage error."""
    from connector.config import parse_connector_url
    from connector.store_connector import StoreConnector
    from engine.errors import ConnectorError
    from kvstore.client import ConfigError

    try:
        return StoreConnector(ctx, parse_connector_url(url))
    except ConfigError as exc:
        raise ConnectorError(str(exc)) from exc
