"""Loading model folders: clear errors naming the bad input; memory-mapped weights; CLI."""

from __future__ import annotations

import json
import os
import shutil
import struct

import pytest
import torch

from engine.cli import main
from engine.config import EngineConfig, ModelConfig
from engine.errors import ConfigError, ModelLoadError, UnsupportedModelError
from engine.llm import LLMEngine
from engine.loader import Tokenizer, iter_safetensors
from kvstore.config import parse_size


@pytest.fixture
def model_copy(tiny_model_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_model_dir("llama-tiny"), d)
    return d


def test_engine_missing_config(model_copy):
    os.remove(model_copy / "config.json")
    with pytest.raises(ModelLoadError, match="config.json"):
        LLMEngine(model_copy, EngineConfig(num_pages=8))


def test_engine_unknown_architecture(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        ModelConfig.from_dir(model_copy)
    cfg.update(architectures=["LlamaForCausalLM"], rope_scaling={"rope_type": "yarn", "factor": 4.0})
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="yarn"):
        ModelConfig.from_dir(model_copy)


def test_engine_bad_safetensors(model_copy):
    path = model_copy / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        LLMEngine(model_copy, EngineConfig(num_pages=8))
    os.remove(path)
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        LLMEngine(model_copy, EngineConfig(num_pages=8))


def test_engine_missing_tensor_and_tokenizer(model_copy, tiny_model_dir):
    from safetensors.torch import load_file, save_file

    st = load_file(model_copy / "model.safetensors")
    del st["model.layers.1.mlp.up_proj.weight"]
    save_file(st, model_copy / "model.safetensors")
    with pytest.raises(ModelLoadError, match="up_proj"):
        LLMEngine(model_copy, EngineConfig(num_pages=8))
    os.remove(model_copy / "tokenizer.json")
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer(model_copy)


def test_engine_weights_are_memory_mapped(tiny_model_dir):
    if not os.path.exists("/proc/self/maps"):
        pytest.skip("needs /proc/self/maps to see mappings")
    d = tiny_model_dir("llama-tiny")
    tensors = dict(iter_safetensors(os.path.join(d, "model.safetensors")))
    eng = LLMEngine(d, EngineConfig(num_pages=8))
    w = eng.model.model.embed_tokens.weight
    assert torch.equal(w, tensors["model.embed_tokens.weight"])
    # fp32 file on CPU: the parameter lives inside a mapping of the weight file, not a copy
    target = os.path.realpath(os.path.join(d, "model.safetensors"))
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            if line.rstrip().endswith(target):
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                ranges.append((lo, hi))
    ptr = w.data_ptr()
    assert any(lo <= ptr < hi for lo, hi in ranges)


def test_engine_config_errors():
    with pytest.raises(ConfigError, match="page_size"):
        EngineConfig(page_size=12)
    with pytest.raises(ConfigError, match="attention_backend"):
        EngineConfig(attention_backend="magic")
    assert parse_size("2GiB") == 2 << 30 and parse_size("512MiB") == 512 << 20


def test_engine_cli_make_tiny_and_generate(tmp_path, capsys):
    d = str(tmp_path / "t")
    assert main(["make-tiny-model", d, "--preset", "qwen2-tiny"]) == 0
    assert (
        main(
            [
                "generate",
                "--model",
                d,
                "--prompt",
                "hi",
                "--max-tokens",
                "5",
                "--num-pages",
                "16",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    assert "ttft_s=" in capsys.readouterr().err
    assert main(["generate", "--model", str(tmp_path / "none"), "--prompt", "hi", "--device", "cpu"]) == 2


def test_engine_from_random_weights():
    from engine.config import RopeConfig
    from engine.sequence import SamplingParams

    mc = ModelConfig("LlamaForCausalLM", 300, 64, 128, 2, 4, 2, 16, 1e-5, 512, RopeConfig(theta=1e4))
    eng = LLMEngine.from_random(mc, EngineConfig(num_pages=16))
    [s] = eng.generate([[1, 2, 3] * 10], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert len(s.output_tokens) == 5 and eng.bm.namespace is None
    eng.check_integrity()
