"""``--kv-cache-dtype`` through the engine: fp8 (and bf16) pages written at prefill and decode,
a hit (HBM prefix cache, the in-process connector) equal to the cold run at that dtype token
for token, chunking that does not change a page's bytes, deterministic scales and namespaces,
and the Triton backend reading fp8 pages like the torch one."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from polling import until_async

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.llm import LLMEngine
from engine.sequence import SamplingParams
from tests.engine.interpret import HAS_CUDA, HAS_TRITON, skip_unless_kernels_run

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
F8 = torch.float8_e4m3fn


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(6, 262, (n,), generator=g).tolist()


def _run(eng: LLMEngine, prompt: list[int]):
    """(tokens, logits per sampled step) of one request."""
    eng.record_logits = {}
    seq = eng.generate([prompt], GREEDY)[0]
    return seq.output_tokens, torch.stack(eng.record_logits[seq.request_id])


@pytest.mark.parametrize("kv", ["fp8_e4m3", "bf16"])
def test_prefix_hit_equals_cold_run_at_that_dtype(tiny_model_dir, engines, kv):
    """A prefix-cache hit reads the pages the cold run wrote; the cold run itself attended
    over those stored values (not its fresh fp32 K/V), so both give the same logits."""
    d = tiny_model_dir("llama-gqa4")
    prompt = _prompt(70, 1)  # 4 full pages of 16 and a tail
    eng = LLMEngine(d, EngineConfig(num_pages=64, kv_cache_dtype=kv))
    engines.append(eng)
    assert eng.kv.dtype == (F8 if kv == "fp8_e4m3" else torch.bfloat16)
    cold, cold_logits = _run(eng, prompt)
    hits = eng.bm.hit_tokens_total
    hit, hit_logits = _run(eng, prompt)
    assert eng.bm.hit_tokens_total - hits == 64
    assert hit == cold
    torch.testing.assert_close(hit_logits, cold_logits, rtol=1e-5, atol=1e-5)
    # the same prompt in 13-token chunks on a fresh engine: same pages' bytes, same output
    chunked = LLMEngine(d, EngineConfig(num_pages=64, kv_cache_dtype=kv, max_num_batched_tokens=13))
    engines.append(chunked)
    toks, logits = _run(chunked, prompt)
    assert toks == cold
    torch.testing.assert_close(logits, cold_logits, rtol=1e-5, atol=1e-5)
    pages = eng.bm.match_prefix(prompt, 4)
    assert torch.equal(
        eng.kv.gather_block(pages).view(torch.uint8),
        chunked.kv.gather_block(chunked.bm.match_prefix(prompt, 4)).view(torch.uint8),
    )


def test_fp8_scales_namespace_and_pool(tiny_model_dir):
    d = tiny_model_dir("llama-gqa4")
    auto = LLMEngine(d, EngineConfig(num_pages=8))
    f1 = LLMEngine(d, EngineConfig(num_pages=8, kv_cache_dtype="fp8_e4m3"))
    f2 = LLMEngine(d, EngineConfig(num_pages=8, kv_cache_dtype="fp8_e4m3"))
    b16 = LLMEngine(d, EngineConfig(num_pages=8, kv_cache_dtype="bf16"))
    mc = auto.model_config
    assert tuple(f1.kv.scales.shape) == (mc.num_layers, 2, mc.num_kv_heads)
    assert torch.equal(f1.kv.scales, f2.kv.scales), "calibration is deterministic"
    s = f1.kv.scales
    assert torch.equal(torch.exp2(torch.log2(s).round()), s), "scales are powers of two"
    assert f1.namespace(16) == f2.namespace(16)
    ns = {e.namespace(16).id for e in (auto, f1, b16)}
    assert len(ns) == 3, "fp8, bf16 and fp32 blocks never share a namespace"
    # auto keeps today's namespace exactly
    from kvstore.keys import Namespace, model_fingerprint

    assert auto.namespace(16) == Namespace(model_fingerprint(d), "float32", 16)
    assert f1.namespace(16).kv_dtype == "float8_e4m3fn"
    # a page of fp8 is a quarter of fp32's bytes and half of bf16's
    assert f1.kv.page_bytes * 4 == auto.kv.page_bytes and f1.kv.page_bytes * 2 == b16.kv.page_bytes
    big = LLMEngine(d, EngineConfig(kv_cache_bytes=8 << 20, kv_cache_dtype="fp8_e4m3"))
    ref = LLMEngine(d, EngineConfig(kv_cache_bytes=8 << 20))
    assert big.kv.num_pages + 1 == 4 * (ref.kv.num_pages + 1), "the same budget holds 4x the pages"
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp8")


async def test_connector_hit_equals_cold_fp8(tiny_model_dir):
    """Through the in-process connector (fp8 blocks with their scales): no local prefix cache,
    so the hit comes from the connector's copy of the block buffers."""
    d = tiny_model_dir("llama-gqa4")
    prompt = _prompt(100, 4)
    cfg = EngineConfig(num_pages=64, enable_prefix_cache=False, kv_cache_dtype="fp8_e4m3")
    ref = LLMEngine(d, cfg).generate([prompt], GREEDY)[0].output_tokens
    aeng = AsyncEngine.from_model(d, cfg, "memory://?block_tokens=32")
    try:
        toks = []
        async for out in aeng.generate(prompt, GREEDY):
            toks.append(out.token_id)
        assert toks == ref
        # the save runs behind the request: wait for it
        await until_async(lambda: aeng.connector.saved_blocks, 15.0, "3 blocks saved", ok=lambda n: n == 3)
        toks, cached = [], 0
        async for out in aeng.generate(prompt, GREEDY):
            toks.append(out.token_id)
            cached = out.cached_tokens
        assert toks == ref and cached == 96
        aeng.check_integrity()
    finally:
        await aeng.stop()


@skip_unless_kernels_run()
def test_triton_engine_reads_fp8_pages_like_torch(tiny_model_dir, engines):
    """On CUDA where there is one, else the CPU interpreter."""
    d = tiny_model_dir("llama-gqa4")
    prompt = _prompt(40, 2)
    dev = "cuda" if HAS_CUDA else "cpu"
    got = {}
    for be in ("torch", "triton"):
        cfg = EngineConfig(
            num_pages=32, kv_cache_dtype="fp8_e4m3", attention_backend=be, device=dev, dtype="float32"
        )
        eng = LLMEngine(d, cfg)
        engines.append(eng)
        got[be] = _run(eng, prompt)
        hit = _run(eng, prompt)  # over the cached prefix
        assert hit[0] == got[be][0]
    assert got["triton"][0] == got["torch"][0]
    torch.testing.assert_close(got["triton"][1], got["torch"][1], rtol=1e-4, atol=1e-4)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["torch", "triton", "flash_attn"])
def test_fp8_engine_on_cuda_bf16(tiny_model_dir, engines, backend):
    """bf16 compute over fp8 pages on the GPU, per backend (flash-attn hands fp8 pages to the
    Triton kernel): a prefix hit equals the cold run, and the output stays near bf16 KV's."""
    if backend != "torch" and not HAS_TRITON:
        pytest.skip("triton is not installed")
    if backend == "flash_attn" and importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash-attn is not installed (it builds only from source with nvcc)")
    d = tiny_model_dir("llama-gqa4")
    prompt = _prompt(70, 5)
    out = {}
    for kv in ("auto", "fp8_e4m3"):
        cfg = EngineConfig(
            num_pages=32, device="cuda", dtype="bfloat16", attention_backend=backend, kv_cache_dtype=kv
        )
        eng = LLMEngine(d, cfg)
        engines.append(eng)
        cold = _run(eng, prompt)
        hit = _run(eng, prompt)
        assert hit[0] == cold[0]
        torch.testing.assert_close(hit[1], cold[1], rtol=2e-2, atol=2e-2)
        out[kv] = cold[1].cpu()
    rel = float((out["fp8_e4m3"] - out["auto"]).norm() / out["auto"].norm())
    assert rel < 0.1, rel


def test_cli_generate_with_fp8(tiny_model_dir, capsys):
    from engine.cli import main

    d = tiny_model_dir("llama-tiny")
    argv = ["generate", "--model", d, "--prompt", "hello there", "--max-tokens", "4"]
    assert main([*argv, "--kv-cache-dtype", "fp8_e4m3"]) == 0
    capsys.readouterr()
    assert main([*argv, "--kv-cache-dtype", "int4"]) == 2  # one line naming the key, status 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "engine.kv_cache_dtype" in err and "'int4'" in err, err


@skip_unless_kernels_run()
def test_decode_graph_buffers_over_fp8_pages(tiny_model_dir, engines):
    """Decode steps on the static buffers (CUDA graphs on CUDA; eagerly under the interpreter
    on CPU) read fp8 pages with their scales like the ordinary Triton path."""
    from engine.decode_graphs import DecodeGraphConfig
    from engine.runner import ModelRunner

    d = tiny_model_dir("llama-gqa4")
    dev = "cuda" if HAS_CUDA else "cpu"
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(6, 262, (n,), generator=g).tolist() for n in (3, 20, 7, 12)]
    out = []
    for graphs in (False, True):
        cfg = EngineConfig(
            num_pages=64, device=dev, dtype="float32", attention_backend="triton", kv_cache_dtype="fp8_e4m3"
        )
        eng = LLMEngine(d, cfg)
        engines.append(eng)
        gc = DecodeGraphConfig(max_batch=4, max_context=128, capture=HAS_CUDA) if graphs else None
        eng.runner = ModelRunner(eng.model, eng.kv, eng.backend, dev, eng.transfer, gc, cuda_graphs=graphs)
        eng.record_logits = {}
        seqs = eng.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        if graphs:
            assert eng.runner.graphs.steps > 0
        out.append(
            (
                [s.output_tokens for s in seqs],
                [torch.stack(eng.record_logits[s.request_id]).cpu() for s in seqs],
            )
        )
    assert out[0][0] == out[1][0]
    for a, b in zip(out[0][1], out[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
