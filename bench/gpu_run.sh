#!/usr/bin/env bash
# One prepared run on a lent GPU (docs/benchmarks.md, "GPU"), at most 8 minutes: the CUDA
# tests; the TTFT matrix (bench/ttft.py --device cuda: KV dtype bf16 / fp8 x cold, engine
# cache, local DRAM / disk, a daemon it starts on loopback with policy always / auto / one
# layer group per layer; 32K tokens of a Llama-3.1-8B-shaped model, random weights, 256-token
# blocks) to OUTDIR/ttft.json; the engine alone (bench/gpu_engine.py: prefill 32K, decode batch
# 1 and 32 beside their floors) to OUTDIR/gpu_engine.json; the paged attention kernel against
# gather+SDPA (bench/paged_attention.py) to OUTDIR/paged_attention.json. Every step has its own
# time limit, so one hang costs only its own step; a step that fails does not stop the next.
# Wheels of packages the GPU image lacks (lmdb, pytest-asyncio, ...) are installed from .whl/
# when that folder exists.
#
#   bash bench/gpu_run.sh OUTDIR [--tiny]
#
# --tiny: the TTFT and engine steps on CPU with a tiny model and short prompts (a smoke check
# that the script runs end to end; its numbers mean nothing and are not to be committed).
set -u
out=${1:?usage: bench/gpu_run.sh OUTDIR [--tiny]}
tiny=${2:-}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/tierkv-site .whl/*.whl && export PYTHONPATH=/tmp/tierkv-site
fi
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py=${PYTHON:-python3}
status=0
step() {  # step NAME SECONDS CMD...: run CMD under a time limit, log to OUTDIR/NAME.log
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s)"
    timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$out/$name.log"
    [ "$rc" -eq 0 ] || { echo "== $name: exit $rc"; status=1; }
}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "no nvidia-smi"
  $py -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
  $py -c "import triton; print('triton', triton.__version__)" 2>&1 || true
} >"$out/env.txt" 2>&1
cat "$out/env.txt"
ttft="$py bench/ttft.py --kv-dtypes bf16,fp8_e4m3 --json $out/ttft.json"
if [ "$tiny" = "--tiny" ]; then
    step ttft 300 $ttft --device cpu --random tiny --lengths 1024 --reps 2 --url-opts block_tokens=64
    step engine 120 $py bench/gpu_engine.py --tiny --json "$out/gpu_engine.json"
else
    step cuda_tests 110 $py -m pytest -q -p no:cacheprovider -m "not heavy" \
        tests/engine/test_engine_cuda.py tests/engine/test_paged_attention*.py tests/engine/test_fp8*.py \
        tests/store/test_hbm.py tests/connector/test_connector_transfer.py
    step ttft 270 $ttft --device cuda --random llama31_8b --lengths 32768 --reps 2 --kv-cache 12GiB \
        --chunk 8192 --url-opts "block_tokens=256&load_parallel=4"
    step engine 60 $py bench/gpu_engine.py --prefill 32768 --no-transformers --kv-cache 12GiB \
        --json "$out/gpu_engine.json"
    step paged_attention 40 $py bench/paged_attention.py --json "$out/paged_attention.json"
fi
exit $status
