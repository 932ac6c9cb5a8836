#!/usr/bin/env bash
# One prepared run on a lent GPU (docs/benchmarks.md, "GPU"), at most 8 minutes: the CUDA
# tests, then the serving cases of issue 11 (bench/gpu_serving.py: the TTFT matrix of KV dtype
# bf16 / fp8 x tier: cold, hbm_hit, remote_hit against a daemon it starts on loopback,
# auto_remote_hit, dram_hit, disk_hit, and the same with _fp8; then decode_b1, decode_b32,
# prefill_32k, each beside a floor measured in the same run) written to OUTDIR/gpu_serving.json
# with each case's engine timeline in OUTDIR/gpu_timeline.json, then the paged attention kernel
# against gather+SDPA (bench/paged_attention.py, OUTDIR/paged_attention.json). Every step has its own time
# limit, so one hang costs only its own step; a step that fails does not stop the next.
# Wheels of packages the GPU image lacks (lmdb, pytest-asyncio, ...) are installed from .whl/
# when that folder exists.
#
#   bash bench/gpu_run.sh OUTDIR [--tiny]
#
# --tiny: the same steps on CPU with a tiny model and short prompts (a smoke check that the
# script runs end to end; its numbers mean nothing and are not to be committed).
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
if [ "$tiny" = "--tiny" ]; then
    step serving 300 $py bench/gpu_serving.py --tiny --json "$out/gpu_serving.json"
else
    step cuda_tests 110 $py -m pytest -q -p no:cacheprovider -m "not heavy" \
        tests/engine/test_engine_cuda.py tests/engine/test_paged_attention*.py tests/engine/test_fp8*.py \
        tests/store/test_hbm.py tests/connector/test_connector_transfer.py
    step serving 330 $py bench/gpu_serving.py --json "$out/gpu_serving.json"
    step paged_attention 40 $py bench/paged_attention.py --json "$out/paged_attention.json"
fi
exit $status
