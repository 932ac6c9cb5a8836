#!/usr/bin/env bash
# One prepared run on a lent GPU (docs/benchmarks.md, "GPU"): the CUDA tests, the TTFT
# benchmark and the engine benchmark, each under its own time limit so one hang costs only
# its own step. Logs and JSON go to OUTDIR. Wheels of packages the GPU image lacks (lmdb,
# pytest-asyncio, ...) are installed from .whl/ when that folder exists.
#
#   bash bench/gpu_run.sh OUTDIR [test seconds] [ttft seconds] [engine seconds]
set -u
out=${1:?usage: bench/gpu_run.sh OUTDIR}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/tierkv-site .whl/*.whl && export PYTHONPATH=/tmp/tierkv-site
fi
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$out/env.txt"
timeout "${2:-180}" python3 -m pytest -q -p no:cacheprovider tests/engine/test_engine_cuda.py \
    tests/store/test_hbm.py tests/connector/test_connector_transfer.py 2>&1 | tee "$out/cuda_tests.log"
timeout "${3:-240}" python3 bench/gpu_ttft.py --json "$out/gpu_ttft.json" 2>&1 | tee "$out/gpu_ttft.log"
timeout "${4:-200}" python3 bench/gpu_engine.py --json "$out/gpu_engine.json" 2>&1 | tee "$out/gpu_engine.log"
