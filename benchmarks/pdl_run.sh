#!/usr/bin/env bash
# One device call (nvidia-h200, carry third_party) for programmatic dependent launch (kernels/pdl.py):
#   GPU tests of the kernels and the graph paths with PDL on ($TESTS), the batch-1 layer chain with and
#   without PDL and with the GEMVs' weight prefetch (pdl_gpu.py), `pd-ssm bench engine` with
#   PD_SSM_PDL=0 and with PDL, and the SSD sweep's variants in $SSD_ONLY (skipped when empty).
# Results under $OUT; a summary on stdout.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --find-links third_party/wheels pyzmq 2>&1 | tail -1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$OUT/gpu.txt"
timeout 150 python3 benchmarks/pdl_gpu.py ${PDL_SWEEP:+--sweep} > "$OUT/pdl.txt" 2>&1; echo "pdl rc $?" >> "$OUT/pdl.txt"
for round in $(seq 1 "${ENGINE_ROUNDS:-1}"); do  # interleaved: the machine drifts between runs
  PD_SSM_PDL=0 timeout 170 python3 -m pd_ssm.cli bench engine --json "$OUT/engine_nopdl$round.json" \
    >> "$OUT/engine_nopdl.txt" 2>&1
  timeout 170 python3 -m pd_ssm.cli bench engine --json "$OUT/engine_pdl$round.json" >> "$OUT/engine_pdl.txt" 2>&1
done
TESTS=${TESTS:-tests/kernels tests/engine/test_cuda_graphs.py tests/engine/test_gpu_numerics.py tests/engine/test_prefill_graphs.py tests/models}
[ -z "${SKIP_TESTS:-}" ] && { timeout 300 python3 -m pytest -q -p no:cacheprovider -x $TESTS > "$OUT/tests.txt" 2>&1
  echo "tests rc $?" >> "$OUT/tests.txt"; }
if [ -n "${SSD_ONLY:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site third_party/wheels/*.whl
  PYTHONPATH=$PWD:$PWD/third_party/baseline:/tmp/site timeout 200 python3 benchmarks/ssd_sweep_gpu.py --only "$SSD_ONLY" \
    > "$OUT/ssd.txt" 2>&1; echo "ssd rc $?" >> "$OUT/ssd.txt"
fi
for f in pdl engine_nopdl engine_pdl tests ssd; do
  [ -f "$OUT/$f.txt" ] && { echo "== $f"; grep -v "Warning\|warn(\|^\[bench\]\|^step \|^ceilings\|^pd-ssm bench" "$OUT/$f.txt" | tail -30; }
done
