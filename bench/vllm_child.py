"""One fresh vLLM process of bench/vllm_ttft.py: ``vllm_child.py SPEC.json OUT.json``.

SPEC: ``model`` (an HF folder), ``dtype``, ``kv_transfer`` (a KVTransferConfig's fields, or
null), ``prompts`` (lists of token ids), ``runs`` (indices into ``prompts``, in order),
``max_tokens``, ``warmup`` (unrelated prompts, each run twice first, uncounted: on this CPU
the first prefill of a shape -- a query length over a context length -- costs seconds more
than the next, so a fresh process is first brought to where a serving one is). Each run is timed from ``add_request`` to the
first output token through the engine's own step loop (so a connector's asynchronous load
is inside the time); OUT gets, per run, ``ttft_s``, the greedy ``tokens`` and vLLM's
``cached_tokens`` (its prefix cache plus a connector's external hit). Run with
.venv-vllm's Python (``make vllm-venv``); the parent sets VLLM_* in the environment.
"""

from __future__ import annotations

import json
import sys
import time


def _run(engine, rid: str, ids: list[int], params) -> dict:
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    engine.add_request(rid, TokensPrompt(prompt_token_ids=ids), params)
    ttft, final = None, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id != rid:
                continue
            if ttft is None and out.outputs and out.outputs[0].token_ids:
                ttft = time.perf_counter() - t0
            if out.finished:
                final = out
    if final is None or ttft is None:
        raise RuntimeError(f"request {rid} finished without output")
    return {
        "ttft_s": round(ttft, 4),
        "tokens": list(final.outputs[0].token_ids),
        "cached_tokens": int(final.num_cached_tokens or 0),
    }


def main(spec_path: str, out_path: str) -> int:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    with open(spec_path) as f:
        spec = json.load(f)
    kv = spec.get("kv_transfer")
    t0 = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        dtype=spec["dtype"],
        enforce_eager=True,
        enable_prefix_caching=True,
        hf_overrides={"architectures": ["LlamaForCausalLM"]},
        kv_transfer_config=KVTransferConfig(**kv) if kv else None,
        seed=0,
    )
    start_s = time.perf_counter() - t0
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True)
    for n, ids in enumerate(spec["warmup"]):
        for k in range(2):  # cold, then a prefix-cache hit: both shapes seen
            _run(engine, f"warmup{n}.{k}", ids, params)
    runs = [_run(engine, f"r{n}", spec["prompts"][i], params) for n, i in enumerate(spec["runs"])]
    # the connector's writes behind must reach the store before this process ends
    engine.engine_core.shutdown()
    with open(out_path, "w") as f:
        json.dump({"engine_start_s": round(start_s, 2), "runs": runs}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
