#!/usr/bin/env bash
# One device call: GPU tests at real shapes, then `bench kernels` and `bench engine`.
# Usage (device tool, kind nvidia-h200, carry third_party for the mamba_ssm baseline):
#   bash benchmarks/gpu_run.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -d third_party/wheels ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site third_party/wheels/*.whl
  export PYTHONPATH=$PWD:$PWD/third_party/baseline:/tmp/site
else
  export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
python3 -m pytest -q -x -p no:cacheprovider tests/kernels tests/engine/test_cuda_graphs.py \
  tests/engine/test_sampler.py 2>&1 | tail -25 | tee "$OUT/tests.txt"
python3 -m pd_ssm.cli bench kernels --json "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.txt"
python3 -m pd_ssm.cli bench engine --json "$OUT/engine.json" 2>&1 | tee "$OUT/engine.txt"
