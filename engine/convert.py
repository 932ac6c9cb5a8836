"""Model folders without a download: ``make_tiny_model`` (random weights + a byte-level
tokenizer) and ``import_gguf`` (GGUF -> Hugging Face folder via transformers' GGUF loader)."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from engine.errors import ModelLoadError

TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# name -> config.json overrides of the base tiny Llama
PRESETS: dict[str, dict[str, Any]] = {
    "llama-tiny": {},
    "llama-mha": {"num_key_value_heads": 4},
    "llama-gqa4": {"num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 128},
    "llama-mqa": {"num_key_value_heads": 1},
    "llama3-rope": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    },
    "llama-linear-rope": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    "qwen2-tiny": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "num_key_value_heads": 2},
    "llama-small": {
        "hidden_size": 512,
        "intermediate_size": 1408,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
    },
}


def _byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    specials = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {t: i for i, t in enumerate(specials)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok


def make_tiny_model(
    out_dir: str | os.PathLike, preset: str = "llama-tiny", seed: int = 0, dtype: str = "float32"
) -> str:
    """Write a random-weight Llama-family folder (config.json, model.safetensors,
    tokenizer.json, tokenizer_config.json). Weights are scaled so logits are peaked enough
    for greedy decoding to be stable. Returns the folder path."""
    from safetensors.torch import save_file

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    out = os.fspath(out_dir)
    os.makedirs(out, exist_ok=True)
    tok = _byte_tokenizer()
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": tok.get_vocab_size(),
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": dtype,
    }
    cfg.update(PRESETS[preset])
    if cfg["model_type"] == "qwen2":
        cfg.update(use_sliding_window=False, sliding_window=None)
    g = torch.Generator().manual_seed(seed)
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh, kvh = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = h // nh

    def lin(o: int, i: int) -> torch.Tensor:
        return torch.randn(o, i, generator=g) / i**0.5

    st: dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.randn(v, h, generator=g)}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        st[p + "self_attn.q_proj.weight"] = lin(nh * hd, h)
        st[p + "self_attn.k_proj.weight"] = lin(kvh * hd, h)
        st[p + "self_attn.v_proj.weight"] = lin(kvh * hd, h)
        st[p + "self_attn.o_proj.weight"] = lin(h, nh * hd)
        if cfg["model_type"] == "qwen2":
            for n, d in (("q", nh * hd), ("k", kvh * hd), ("v", kvh * hd)):
                st[p + f"self_attn.{n}_proj.bias"] = torch.randn(d, generator=g) * 0.1
        st[p + "mlp.gate_proj.weight"] = lin(inter, h)
        st[p + "mlp.up_proj.weight"] = lin(inter, h)
        st[p + "mlp.down_proj.weight"] = lin(h, inter)
        st[p + "input_layernorm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
        st[p + "post_attention_layernorm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    st["model.norm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    st["lm_head.weight"] = lin(v, h) * 4.0
    tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    save_file(
        {k: t.to(tdtype).contiguous() for k, t in st.items()},
        os.path.join(out, "model.safetensors"),
        metadata={"format": "pt"},
    )
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
    tok.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "chat_template": TINY_CHAT_TEMPLATE,
            },
            f,
            indent=2,
        )
    return out


def import_gguf(gguf_file: str | os.PathLike, out_dir: str | os.PathLike) -> str:
    """Convert a GGUF file into a Hugging Face folder (config.json, model.safetensors,
    tokenizer files) with transformers' GGUF loader, which dequantizes and undoes llama.cpp's
    Q/K permutation. Needs the ``gguf`` extra (transformers, gguf). Weights are saved fp32."""
    path = os.fspath(gguf_file)
    if not os.path.isfile(path):
        raise ModelLoadError(f"GGUF file {path} does not exist")
    try:
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise ModelLoadError(f"import-gguf needs the 'gguf' extra (transformers, gguf): {exc}") from exc
    folder, name = os.path.split(os.path.abspath(path))
    try:
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32, local_files_only=True
        )
    except Exception as exc:  # transformers raises many types for a bad file
        raise ModelLoadError(f"{path}: transformers cannot read this GGUF file: {exc}") from exc
    out = os.fspath(out_dir)
    os.makedirs(out, exist_ok=True)
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["torch_dtype"] = "float32"
    tied = bool(cfg.get("tie_word_embeddings"))
    state = {
        k: v.detach().contiguous()
        for k, v in model.state_dict().items()
        if not (tied and k == "lm_head.weight")
    }
    save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
    tok.save_pretrained(out)
    return out
