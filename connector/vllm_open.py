"""One side of the vLLM connector opens the store connector (lookup, loader, saver, store
client: connector/store_connector.py, reused as they are) for a page format, on the side's
event loop, and starts it (connections, the tenant's salt) within the connector's deadlines."""

from __future__ import annotations

import logging

from connector.config import ConnectorConfig
from connector.store_connector import StoreConnector
from connector.vllm_loop import LoopThread
from connector.vllm_pages import VllmPages
from engine.kv_connector import ConnectorContext

log = logging.getLogger("tierkv.connector")


def open_connector(loop: LoopThread, cfg: ConnectorConfig, pages: VllmPages, loads: bool) -> StoreConnector:
    """The started connector. Never raises for a store problem (a store down now is a miss
    later); ConfigError for options the store refuses."""
    fmt = pages.fmt
    ctx = ConnectorContext(
        page_size=fmt.block_size,
        kv=pages,
        namespace=fmt.namespace,
        model_dir="",
        device="cuda" if pages.cuda else "cpu",
        transfer=pages,
    )

    async def make() -> StoreConnector:
        return StoreConnector(ctx, cfg, loads=loads)

    conn = loop.run(make(), None)
    backstop = max(cfg.lookup_deadline_s, cfg.load_deadline_s) + 1.0
    try:
        loop.run(conn.start(), backstop)
    except TimeoutError:
        log.warning("event=connector_start_slow after_s=%.1f", backstop)
    return conn
