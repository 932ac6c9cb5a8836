"""The model with its weights on the device: from a model folder (:func:`load_model`) or random
(:func:`random_model`, for benchmarks of real model shapes without a checkpoint)."""

from __future__ import annotations

import os

import torch

from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.loader import load_state
from engine.model import CausalLM, rope_table

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model(
    model_dir: str | os.PathLike, cfg: ModelConfig, dtype: torch.dtype, device: str, max_len: int
) -> CausalLM:
    """Build the model and assign the folder's weights (memory-mapped; converted only when
    the dtype or device differs). Raises ModelLoadError naming missing or misshapen tensors."""
    state = load_state(model_dir)
    state = {k: v.to(device=device, dtype=dtype) if v.is_floating_point() else v for k, v in state.items()}
    with torch.device("meta"):
        model = CausalLM(cfg, max_len)
    try:
        result = model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as exc:
        raise ModelLoadError(f"{os.fspath(model_dir)}: weights do not fit config.json: {exc}") from exc
    missing = [k for k in result.missing_keys if not (k == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing:
        raise ModelLoadError(f"{os.fspath(model_dir)}: missing tensors {missing[:5]}")
    return _ready(model, cfg, device, max_len)


def random_model(cfg: ModelConfig, dtype: torch.dtype, device: str, max_len: int, seed: int) -> CausalLM:
    """The model over random weights (seeded), created directly on the device in ``dtype``."""
    torch.manual_seed(seed)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # create weights in the target dtype: no fp32 transient
    try:
        with torch.device(device):
            model = CausalLM(cfg, max_len)
    finally:
        torch.set_default_dtype(prev)
    for name, p in model.named_parameters():
        with torch.no_grad():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    return _ready(model, cfg, device, max_len)


def _ready(model: CausalLM, cfg: ModelConfig, device: str, max_len: int) -> CausalLM:
    """The rotary tables on the device, the tied head, eval mode."""
    cos, sin = rope_table(cfg.rope, cfg.head_dim, max_len)
    model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
    model.tie_weights()
    return model.eval()
