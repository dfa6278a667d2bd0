#!/usr/bin/env bash
# `pd-ssm bench serve --launch both` on one H200: a Mamba2-2.7B-shaped model (dummy weights, bf16,
# fp32 state) served colocated (1 worker) and disaggregated (1 prefill + 1 decode worker sharing
# the GPU, states over the ZMQ connector through the host), the same seeded workload against each.
# One GPU cannot pair NCCL ranks, so this measures what the disaggregated path costs on one device,
# not what it buys on two (benchmarks/disagg_gpu.sh and kind nvidia-h200-x2 for that).
#
# Usage (device tool, kind nvidia-h200, carry third_party/serve_wheels: cp312 wheels of pyzmq,
# fastapi, starlette, pydantic, pydantic_core, typing_inspection, annotated_types, annotated_doc,
# anyio, sniffio, idna, typing_extensions, uvicorn, h11, click, prometheus_client):
#   bash benchmarks/serve_gpu.sh            (RATE=8 PROMPTS=64 IN=1024 OUTLEN=128 by default)
# Writes $OUT/serve_gpu.{json,txt,err} and both servers' logs; exits as `pd-ssm bench serve`.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PY=${PYTHON:-python3}
NEED="pyzmq fastapi starlette pydantic pydantic_core typing_inspection annotated_types annotated_doc anyio sniffio idna typing_extensions uvicorn h11 click prometheus_client"
if ! $PY -c "import zmq, fastapi, uvicorn, prometheus_client, h11" 2>/dev/null; then
  # shellcheck disable=SC2086
  $PY -m pip install -q --no-index --find-links third_party/serve_wheels $NEED || exit 2
fi
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader > "$OUT/gpu.txt"
MODEL=${MODEL:-/tmp/mamba2-2.7b}
if [ ! -f "$MODEL/config.json" ]; then
  $PY -c "import sys; from pd_ssm.bench.shapes import write_shape; write_shape('mamba2-2.7b', sys.argv[1])" "$MODEL" \
    || exit 2
fi
ARGS="--model $MODEL --load-format dummy --device cuda --gpus 0,0 --num-prefill 1 --num-decode 1 --connector zmq"
ARGS+=" --gpu-memory-utilization 0.35 --max-num-seqs ${SEQS:-64} ${EXTRA:-}"
$PY -m pd_ssm.cli bench serve --launch both --launch-timeout 420 --serve-args "$ARGS" \
  --num-prompts "${PROMPTS:-64}" --input-len "${IN:-1024}" --output-len "${OUTLEN:-128}" \
  --request-rate "${RATE:-8}" --json "$OUT/serve_gpu.json" 2> "$OUT/serve_gpu.err" | tee "$OUT/serve_gpu.txt"
rc=${PIPESTATUS[0]}
for log in $(grep -o "its log: [^)]*" "$OUT/serve_gpu.err" | cut -d' ' -f3); do
  cp "$log" "$OUT/$(basename "$(dirname "$log")")-$(basename "$log")" 2>/dev/null
done
tail -5 "$OUT/serve_gpu.err"
exit "$rc"
