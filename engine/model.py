"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2) over a paged KV cache.

Parameter names equal Hugging Face's (``model.layers.0.self_attn.q_proj.weight``...), so a
checkpoint loads by plain assignment. Numerics follow transformers' implementation (RMSNorm
in fp32, rotate-half RoPE with an fp32 table) so fp32 logits match it to ~1e-6.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention_meta import AttnMetadata
from engine.config import ModelConfig, RopeConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies for ``rope`` (default / linear / llama3 / dynamic-within-range)."""
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        inv = inv / rope.factor
    elif rope.rope_type == "llama3":
        old = rope.original_max_position
        low_wl, high_wl = old / rope.low_freq_factor, old / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wl, inv / rope.factor, inv)
        smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wl) * ~(wavelen > low_wl)
        inv = torch.where(medium, smoothed, scaled)
    return inv


def rope_table(rope: RopeConfig, head_dim: int, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables ``[max_len, head_dim]`` in fp32 (cast to the model dtype at use)."""
    inv = rope_inv_freq(rope, head_dim)
    freqs = torch.arange(max_len, dtype=torch.float32)[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)

    def forward(self, x, cos, sin, layer_kv, meta: AttnMetadata, backend) -> torch.Tensor:
        """``layer_kv``: ``(k_cache, v_cache)`` or ``(k_cache, v_cache, k_scale, v_scale)``
        (engine/kv_cache.py ``LayerKV``; scales for fp8 caches)."""
        k_cache, v_cache, *scales = layer_kv
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        o = backend.forward(q, k, v, k_cache, v_cache, meta, *scales)  # no scales: (None, None) or none
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, layer_kv, meta, backend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, layer_kv, meta, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """Decoder + LM head. ``forward`` computes the step's tokens (any mix of prefill chunks and
    decode tokens, flattened) and returns logits only at ``logits_indices``."""

    def __init__(self, cfg: ModelConfig, max_len: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Decoder(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        cos, sin = rope_table(cfg.rope, cfg.head_dim, max_len)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def tie_weights(self) -> None:
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list,
        meta: AttnMetadata,
        backend,
        logits_indices: torch.Tensor,
        before_layer: Callable[[int], None] | None = None,
        after_layers: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """``kv_caches``: per layer ``(k_cache, v_cache[, k_scale, v_scale])`` (``KVCache.layers()``).
        ``before_layer(l)``, when given, runs before layer ``l`` (the KV transfer's wait
        for that layer's loaded pages; with layer timing also the timer's marks).
        ``after_layers()``, when given, runs once after the last layer, before the final norm
        and the LM head (the layer timer's end mark)."""
        x = self.model.embed_tokens(input_ids)
        cos = self.rope_cos[positions].to(x.dtype)[:, None, :]
        sin = self.rope_sin[positions].to(x.dtype)[:, None, :]
        for i, (layer, layer_kv) in enumerate(zip(self.model.layers, kv_caches)):
            if before_layer is not None:
                before_layer(i)
            x = layer(x, cos, sin, layer_kv, meta, backend)
        if after_layers is not None:
            after_layers()
        x = self.model.norm(x[logits_indices])
        return self.lm_head(x).float()
