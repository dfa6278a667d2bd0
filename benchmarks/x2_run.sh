#!/usr/bin/env bash
# One device call on nvidia-h200-x2 (carry third_party: wheels + the mamba_ssm baseline):
#   GPU 1, in the background: train the embedded default model (scripts/train_default_model.py)
#   GPU 0: the SSD variant sweep against mamba_ssm, then `pd-ssm bench engine`
#   both GPUs: the NCCL connector check (64 x 168 MB in flight) and `pd-ssm bench transfer`
# Results: $OUT/results.tgz (every log and JSON) and $OUT/model.safetensors (the trained weights).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; R=/tmp/res; mkdir -p "$OUT" "$R"
MINUTES=${MINUTES:-3.5}
python3 -m pip install -q --no-index --find-links third_party/wheels pyzmq fastapi uvicorn openai prometheus_client \
  einops 2>&1 | tail -2
nvidia-smi --query-gpu=index,name,clocks.sm,temperature.gpu --format=csv > "$R/gpu.txt"

CUDA_VISIBLE_DEVICES=1 timeout $((${MINUTES%.*} * 60 + 150)) python3 scripts/train_default_model.py \
  --minutes "$MINUTES" --out "$R/train" > "$R/train.txt" 2>&1 &
TRAIN=$!

CUDA_VISIBLE_DEVICES=0 OUT=$R PYTHONPATH=$PWD:$PWD/third_party/baseline timeout 200 \
  python3 benchmarks/ssd_sweep_gpu.py > "$R/ssd_sweep.txt" 2>&1
echo "ssd sweep rc $?" >> "$R/ssd_sweep.txt"
CUDA_VISIBLE_DEVICES=0 timeout 150 python3 -m pd_ssm.cli bench engine --json "$R/engine.json" > "$R/engine.txt" 2>&1
wait $TRAIN; echo "train rc $?" >> "$R/train.txt"

OUT=$R timeout 150 python3 benchmarks/nccl_gpu_check.py > "$R/nccl.txt" 2>&1; echo "nccl rc $?" >> "$R/nccl.txt"
timeout 170 python3 -m pd_ssm.cli bench transfer --device cuda --json "$R/transfer.json" > "$R/transfer.txt" 2>&1
echo "transfer rc $?" >> "$R/transfer.txt"

[ -f "$R/train/default_model/model.safetensors" ] && mv "$R/train/default_model/model.safetensors" "$OUT/"
tar czf "$OUT/results.tgz" -C "$R" .
for f in ssd_sweep engine train nccl transfer; do echo "== $f"; tail -25 "$R/$f.txt"; done
