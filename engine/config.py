"""Frozen configuration: the model's shape (from ``config.json``), the engine's knobs, and
``kvengine``'s settings (``[engine]`` table, ``TIERKV_ENGINE__*``, flags; see EngineSection)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from engine.errors import ConfigError, ModelLoadError, UnsupportedModelError
from kvstore.settings import ConfigError as SettingError
from kvstore.settings import Size

# Architectures this engine implements; all share one decoder (engine/model.py).
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
ROPE_TYPES = ("default", "linear", "llama3", "dynamic")
# --kv-cache-dtype choices; engine/kv_dtype.py maps them to torch dtypes (kept here so that
# parsing a config does not import torch)
KV_CACHE_DTYPES = ("auto", "bf16", "fp16", "fp32", "fp8_e4m3")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters. ``rope_type`` is one of ``ROPE_TYPES``; ``dynamic`` is
    accepted only within ``original_max_position`` (where it equals ``default``)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """The decoder's shape. Built from a Hugging Face ``config.json`` by :meth:`from_hf`."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int
    rope: RopeConfig
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Parse a ``config.json`` dict. Raises UnsupportedModelError naming the architecture or
        rope type, ModelLoadError naming a missing/bad key."""
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            mt = cfg.get("model_type")
            arch = {
                "llama": "LlamaForCausalLM",
                "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM",
            }.get(mt)
        if arch is None:
            raise UnsupportedModelError(
                f"{source}: unknown architecture {archs or cfg.get('model_type')!r}; "
                f"supported: {sorted(ARCHITECTURES)}"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"{source}: hidden_act {cfg.get('hidden_act')!r} is not silu")
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            kv_heads = int(cfg.get("num_key_value_heads") or heads)
            head_dim = int(cfg.get("head_dim") or hidden // heads)
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            max_pos = int(cfg.get("max_position_embeddings", 4096))
            if arch == "MistralForCausalLM" and cfg.get("sliding_window"):
                # Sliding-window attention is not implemented: within the window it is plain
                # causal attention, so cap the context at the window instead of being wrong.
                max_pos = min(max_pos, int(cfg["sliding_window"]))
            rope = _rope_from_hf(cfg, source)
            if rope.rope_type == "dynamic":
                # Dynamic NTK equals the default rope within the original context; beyond it
                # the base would change per length, which is not implemented: cap instead.
                max_pos = min(max_pos, rope.original_max_position)
            model = cls(
                architecture=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                max_position=max_pos,
                rope=rope,
                qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
                o_bias=arch != "Qwen2ForCausalLM" and bool(cfg.get("attention_bias", False)),
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                eos_token_ids=eos_ids,
            )
        except KeyError as exc:
            raise ModelLoadError(f"{source}: missing key {exc.args[0]!r}") from exc
        except (TypeError, ValueError) as exc:
            raise ModelLoadError(f"{source}: bad value: {exc}") from exc
        if heads % kv_heads:
            raise ModelLoadError(
                f"{source}: num_attention_heads {heads} not a multiple of kv heads {kv_heads}"
            )
        return model

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike) -> ModelConfig:
        path = os.path.join(os.fspath(model_dir), "config.json")
        if not os.path.isfile(path):
            raise ModelLoadError(f"missing {path}")
        try:
            with open(path, encoding="utf-8") as f:
                cfg = json.load(f)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot parse {path}: {exc}") from exc
        if not isinstance(cfg, dict):
            raise ModelLoadError(f"{path}: not a JSON object")
        return cls.from_hf(cfg, path)


def _rope_from_hf(cfg: dict[str, Any], source: str) -> RopeConfig:
    # transformers 5 nests everything in rope_parameters; older configs use rope_theta + rope_scaling.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rtype = params.get("rope_type", params.get("type", "default")) or "default"
    if rtype not in ROPE_TYPES:
        raise UnsupportedModelError(f"{source}: rope type {rtype!r} not supported; supported: {ROPE_TYPES}")
    return RopeConfig(
        theta=theta,
        rope_type=rtype,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=int(
            params.get("original_max_position_embeddings", cfg.get("max_position_embeddings", 8192))
        ),
    )


@dataclass(frozen=True)
class EngineConfig:
    """Engine knobs. ``kv_cache_bytes`` sizes the page pool unless ``num_pages`` is given.
    ``max_num_batched_tokens`` is the per-step token budget (decode tokens count one each)."""

    page_size: int = 16
    num_pages: int | None = None
    kv_cache_bytes: int = 256 << 20
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int | None = None
    device: str = "cpu"
    dtype: str | None = None  # None: float32 on CPU, bfloat16 on CUDA
    enable_prefix_cache: bool = True
    attention_backend: str = "auto"  # auto | torch | triton | flash_attn
    # What the KV pages hold (engine/kv_dtype.py): auto (the compute dtype) | bf16 | fp16 |
    # fp32 | fp8_e4m3 (static per-(layer, KV head) scales calibrated at start)
    kv_cache_dtype: str = "auto"
    # AsyncEngine.start runs LLMEngine.warm_up (a tiny request) so the first real request does
    # not pay kernel compilation or library set-up
    warm_up: bool = True

    def __post_init__(self) -> None:
        if self.page_size <= 0 or self.page_size & (self.page_size - 1):
            raise ConfigError(f"page_size must be a positive power of two, got {self.page_size}")
        if self.num_pages is not None and self.num_pages < 2:
            raise ConfigError(f"num_pages must be >= 2, got {self.num_pages}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.attention_backend not in ("auto", "torch", "triton", "flash_attn"):
            raise ConfigError(
                f"attention_backend {self.attention_backend!r} not one of auto/torch/triton/flash_attn"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"kv_cache_dtype {self.kv_cache_dtype!r} not one of {'/'.join(KV_CACHE_DTYPES)}"
            )
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype {self.dtype!r} not one of float32/bfloat16/float16")

    def torch_dtype_name(self) -> str:
        return self.dtype or ("float32" if self.device == "cpu" else "bfloat16")


@dataclass(frozen=True)
class EngineSection:
    """``kvengine serve|generate|bench`` settings: the ``[engine]`` table of ``--config FILE``,
    ``TIERKV_ENGINE__<KEY>`` variables and the flags, loaded by kvstore.settings.load_config
    (flags over environment over file over these defaults). Each key is its flag's name
    (``--kv-cache-bytes`` -> ``kv_cache_bytes``); generate and bench ignore the serve-only
    keys (host .. log_level). A bad value is the loader's ConfigError naming ``engine.<key>``."""

    model: str = ""  # required (from some source)
    device: str | None = None  # None: cuda if available, else cpu
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    page_size: int = 16
    num_pages: int | None = None  # None: as many as kv_cache_bytes holds
    kv_cache_bytes: Size = Size(512 << 20)
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int | None = None
    attention_backend: Literal["auto", "torch", "triton", "flash_attn"] = "auto"
    no_prefix_cache: bool = False
    kv_cache_dtype: Literal[KV_CACHE_DTYPES] = "auto"
    # serve only
    host: str = "127.0.0.1"
    port: int = 8000
    kv_connector: str = "none"
    kv_connector_config: str = ""
    kv_lookup_timeout_s: float | None = None
    timeline_layers: bool = False  # per-layer-group timing of prefill steps (engine/runner.py)
    served_model_name: str = ""
    log_level: str = "warning"

    def __post_init__(self) -> None:
        # EngineConfig's checks, named as this table's keys so that the loader adds the source
        try:
            self.engine_config("cpu")
        except ConfigError as exc:
            raise SettingError(f"engine.{str(exc).split()[0]}: {exc}") from None

    def engine_config(self, device: str) -> EngineConfig:
        """The engine's knobs, on ``device`` (the caller resolves ``device=None``)."""
        return EngineConfig(
            page_size=self.page_size,
            num_pages=self.num_pages,
            kv_cache_bytes=self.kv_cache_bytes,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
            device=device,
            dtype=self.dtype,
            enable_prefix_cache=not self.no_prefix_cache,
            attention_backend=self.attention_backend,
            kv_cache_dtype=self.kv_cache_dtype,
        )


@dataclass(frozen=True)
class EngineSettings:
    """The root kvstore.settings.load_config builds for kvengine: one ``[engine]`` section."""

    engine: EngineSection = field(default_factory=EngineSection)
