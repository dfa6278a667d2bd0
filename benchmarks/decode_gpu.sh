#!/usr/bin/env bash
# One device call (nvidia-h200, carry third_party) for the decode step with the deferred norm scale:
#   GPU tests of the kernels and the graph paths at real shapes, `pd-ssm bench engine` with the
#   default step and the same bench on the other paths in $VARIANTS (decode_fusion_ab_gpu.py), the
#   per-layer sweep of the step's variants (decode_step_gpu.py), and with PROFILE=1 / LINEAR=1 the
#   per-kernel profile of a step and the cuBLAS layout sweep of the decode linears.
# Results under $OUT; a summary on stdout.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --find-links third_party/wheels pyzmq 2>&1 | tail -1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$OUT/gpu.txt"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_mixer_decode.py tests/kernels/test_rmsnorm_triton.py \
  tests/kernels/test_add_rmsnorm.py tests/kernels/test_ssu_triton.py tests/kernels/test_conv1d_triton.py \
  tests/engine/test_cuda_graphs.py tests/engine/test_gpu_numerics.py tests/engine/test_prefill_graphs.py \
  tests/state_transfer/test_block_sums_triton.py > "$OUT/tests.txt" 2>&1; echo "tests rc $?" >> "$OUT/tests.txt"
timeout 170 python3 -m pd_ssm.cli bench engine --json "$OUT/engine_deferred.json" > "$OUT/engine_deferred.txt" 2>&1
for v in ${VARIANTS:-unfused}; do  # decode_fusion_ab_gpu.py --variant: unfused | tile:P/W
  timeout 170 python3 benchmarks/decode_fusion_ab_gpu.py --variant "$v" --json "$OUT/engine_${v//[:\/]/_}.json" \
    > "$OUT/engine_${v//[:\/]/_}.txt" 2>&1
done
timeout 150 python3 benchmarks/decode_step_gpu.py > "$OUT/decode_step.txt" 2>&1
[ -n "${PROFILE:-}" ] && timeout 120 python3 benchmarks/profile_engine_gpu.py --out "$OUT/profile" > "$OUT/profile.txt" 2>&1
[ -n "${LINEAR:-}" ] && timeout 120 python3 benchmarks/linear_layouts_gpu.py > "$OUT/linear_layouts.txt" 2>&1
for f in "$OUT"/tests.txt "$OUT"/engine_*.txt "$OUT"/decode_step.txt; do echo "== $f"; grep -v "Warning\|warn(" "$f" | tail -14; done
[ -f "$OUT/profile.txt" ] && { echo "== profile"; head -60 "$OUT/profile.txt"; }
