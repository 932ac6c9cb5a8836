"""One vLLM engine in a child process (run by the vLLM venv's interpreter): runs prompts
through ``LLM(...)`` with tierkv's connector (or none) and prints one JSON line
``{"outputs": [[ids]...], "cached": [n...], "stats": {side: {counter: value}}}``.

argv[1]: a JSON spec: ``model``, ``prompts`` (lists of token ids, run one after another, so a
later one may hit what an earlier one saved), ``max_tokens``, ``dtype``, ``block_size``,
``kv`` (None: no connector; else ``{"role": ..., "extra": {...kv_connector_extra_config}}``,
the counters then read from ``extra["stats_path"]``), ``prefix_caching``."""

from __future__ import annotations

import json
import os
import pathlib
import sys

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main(spec: dict) -> dict:
    from vllm import LLM, SamplingParams

    kw: dict = {}
    kv = spec.get("kv")
    if kv is not None:
        kw["kv_transfer_config"] = {
            "kv_connector": "TierkvConnector",
            "kv_connector_module_path": "connector.vllm",
            "kv_role": kv.get("role", "kv_both"),
            "kv_connector_extra_config": kv["extra"],
        }
    llm = LLM(
        model=spec["model"],
        dtype=spec.get("dtype", "float32"),
        enforce_eager=True,
        hf_overrides={"architectures": ["LlamaForCausalLM"]},
        block_size=spec.get("block_size", 32),
        max_model_len=spec.get("max_model_len", 2048),
        enable_prefix_caching=spec.get("prefix_caching", True),
        seed=0,
        **kw,
    )
    params = SamplingParams(max_tokens=spec.get("max_tokens", 8), temperature=0, ignore_eos=True)
    outputs, cached = [], []
    for prompt in spec["prompts"]:
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        outputs.append(list(out.outputs[0].token_ids))
        cached.append(out.num_cached_tokens or 0)
    llm.llm_engine.engine_core.shutdown()  # the connector's shutdown: saves written
    stats = {}
    if kv is not None and kv["extra"].get("stats_path"):
        for f in sorted(pathlib.Path(kv["extra"]["stats_path"]).glob("*.json")):
            stats[f.stem] = json.loads(f.read_text())
    return {"outputs": outputs, "cached": cached, "stats": stats}


if __name__ == "__main__":
    result = main(json.loads(sys.argv[1]))
    print("RESULT " + json.dumps(result), flush=True)
