"""tierkv inside vLLM (v1 KV-connector API, vLLM 0.32): ``TierkvConnector``.

    --kv-transfer-config '{"kv_connector": "TierkvConnector",
        "kv_connector_module_path": "connector.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"url": "kvstore://host:port[,host:port...]", ...}}'

``kv_connector_extra_config``: ``url`` (``kvstore://``, ``etcd://`` or ``local://``, as
kvengine's ``--kv-connector``; its query may carry options too) and any option of kvengine's
connector (connector/config.py: token, token_file, tenant, lookup/load/save deadlines, policy,
...; JSON values of the option's type), plus ``model_fingerprint`` (names the weights when the
model is not in a local folder) and ``stats_path`` (a folder the connector writes its counters
to, as JSON, per side).

This class is the thin part: vLLM's calls, dispatched to the scheduler side
(connector/vllm_scheduler.py) or the worker side (connector/vllm_worker.py), which reuse the
connector's lookup, loader, saver and store facade (connector/store_connector.py). Contract
kept: a failed, late or corrupt load is reported through ``get_block_ids_with_load_errors`` and
recomputed by vLLM -- never wrong output, never an engine error, a counter each time. So this
connector sets vLLM's ``kv_load_failure_policy`` to ``recompute`` (vLLM's default, ``fail``,
would fail a request for a cache miss found at load time) and says so once.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
)

from connector.config import parse_connector_url
from connector.vllm_format import PageFormat, model_identity
from connector.vllm_meta import TierkvHandshake, TierkvMetadata
from connector.vllm_scheduler import SchedulerSide
from connector.vllm_worker import WorkerSide, layer_tensors, page_shape_of
from kvstore.client import ConfigError

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("tierkv.connector")

_OWN_OPTIONS = ("url", "model_fingerprint", "stats_path")


class TierkvConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        tc = self._kv_transfer_config
        extra = dict(tc.kv_connector_extra_config or {})
        url = extra.get("url")
        if not isinstance(url, str) or not url:
            raise ConfigError(
                "kv_connector_extra_config.url is required: kvstore://host:port[,...], etcd://host:port/CLUSTER "
                "or local://PATH"
            )
        self._fingerprint = str(extra.get("model_fingerprint") or "")
        stats_path = str(extra.get("stats_path") or "")
        options = {k: v for k, v in extra.items() if k not in _OWN_OPTIONS}
        self._cfg = parse_connector_url(url, options=options, options_source="kv_connector_extra_config")
        block_size = vllm_config.cache_config.block_size
        loads, saves = tc.is_kv_consumer, tc.is_kv_producer
        if len(kv_cache_config.kv_cache_groups) != 1:
            log.warning("tierkv: models with several KV cache groups are not supported: no loads, no saves")
            loads = saves = False
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            if tc.kv_load_failure_policy != "recompute":
                log.info(
                    "tierkv: kv_load_failure_policy set to 'recompute' (a failed cache load is recomputed)"
                )
                tc.kv_load_failure_policy = "recompute"
            self._scheduler = SchedulerSide(self._cfg, block_size, loads, saves, stats_path)
        else:
            rank, _ = _tp()
            self._worker = WorkerSide(self._cfg, loads, saves, stats_path, rank)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a later miss, never a lost hand-off

    # ==== worker side ===========================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = list(self._kv_cache_config.kv_cache_groups[0].layer_names)
        layers = layer_tensors(names, kv_caches)
        if not layers:
            log.warning("tierkv: no KV tensors registered: no loads, no saves")
            return
        self._worker.register(self._format(layers), layers)

    def _format(self, layers: list[tuple[str, torch.Tensor]]) -> PageFormat:
        vc = self._vllm_config
        mc = vc.model_config
        layer = vc.compilation_config.static_forward_context.get(layers[0][0])
        backend = layer.attn_backend.get_name() if layer is not None else "unknown"
        isa = getattr(layer, "isa", None)
        rank, size = _tp()
        return PageFormat(
            model=model_identity(mc.model, mc.revision, mc.hf_overrides, self._fingerprint),
            compute_dtype=str(mc.dtype).removeprefix("torch."),
            kv_dtype=str(layers[0][1].dtype).removeprefix("torch."),
            backend=f"{backend}/{isa}" if isa else backend,
            kv_layout=str(vc.cache_config.kv_cache_layout or self._kv_cache_config.kv_cache_layout),
            page_shape=page_shape_of(layers),
            layers=len(layers),
            block_size=vc.cache_config.block_size,
            tp_size=size,
            tp_rank=rank,
        )

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        pages = self._worker.pages if self._worker is not None else None
        return TierkvHandshake(pages.fmt) if pages is not None else None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._worker.start_loads(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_loads()

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        self._worker.save_layer(layer_name, self._meta())

    def wait_for_save(self) -> None:
        self._worker.wait_loads()  # a step whose layers never waited: its loads end here
        self._worker.finish_saves(self._meta() if self.has_connector_metadata() else None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.load_errors() if self._worker is not None else set()

    def _meta(self) -> TierkvMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, TierkvMetadata)
        return meta

    # ==== scheduler side ========================================================================
    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        first = metadata.get(0) if metadata else None
        if isinstance(first, TierkvHandshake) and self._scheduler is not None:
            self._scheduler.set_format(first.fmt)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._scheduler.matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        ids = blocks.get_block_ids()[0] if num_external_tokens > 0 else []
        self._scheduler.after_alloc(request, ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler.build_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._scheduler.forget(request.request_id)
        return False, None

    def shutdown(self) -> None:
        for side in (self._scheduler, self._worker):
            if side is not None:
                side.shutdown()


def _tp() -> tuple[int, int]:
    """This worker's tensor-parallel (rank, size); (0, 1) before vLLM's groups exist."""
    from vllm.distributed import parallel_state as ps

    if ps._TP is None:  # the scheduler's process may have no groups
        return 0, 1
    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
