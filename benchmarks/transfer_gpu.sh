#!/usr/bin/env bash
# One device call on nvidia-h200-x2 for the state-transfer work (carry third_party: the wheels):
#   GPU tests of the transfer path, the NCCL connector check (64 x 168 MB in flight, bit-exact),
#   `pd-ssm bench transfer` (NCCL between cuda:0 and cuda:1, layer-wise streaming of a 2.7B-shaped
#   prefill over ZMQ, ZMQ against a raw socket), and `pd-ssm serve --disagg` on both GPUs over NCCL
#   (benchmarks/disagg_gpu.sh: every answer equal to a colocated engine's); the streamed prefill's
#   cost split (profile_transfer_gpu.py stream) and the NCCL per-step split (nccl_overhead_gpu.py).
# Results: $OUT/results.tgz (every log and JSON); a summary on stdout.
# SKIP_PROFILE=1 leaves out the stream profile; BENCH_ROUNDS=N (default 1) runs the NCCL and ZMQ
# benches N times, to see how far the host-bound ratios move between rounds of one call.
# shellcheck source=benchmarks/device_results.sh
source benchmarks/device_results.sh
nvidia-smi --query-gpu=index,name,clocks.sm,temperature.gpu --format=csv > "$R/gpu.txt"

timeout 240 python3 -m pytest -q -p no:cacheprovider tests/state_transfer/test_engine_streaming.py \
  tests/state_transfer/test_nccl_gpu_check.py tests/state_transfer/test_block_sums_triton.py tests/state_transfer/test_nccl_pinned.py tests/cache/test_pages.py \
  tests/engine/test_prefill_graphs.py \
  > "$R/tests.txt" 2>&1; echo "tests rc $?" >> "$R/tests.txt"
pack
OUT=$R timeout 150 python3 benchmarks/nccl_gpu_check.py > "$R/nccl.txt" 2>&1; echo "nccl rc $?" >> "$R/nccl.txt"
pack
for round in $(seq 1 "${BENCH_ROUNDS:-1}"); do
  conn=nccl,stream; [ "$round" -gt 1 ] && conn=nccl  # the streaming case once
  timeout 200 python3 -m pd_ssm.cli bench transfer --device cuda --connectors $conn --repeats 5 \
    --json "$R/transfer_nccl$round.json" >> "$R/transfer_nccl.txt" 2>&1; echo "transfer rc $?" >> "$R/transfer_nccl.txt"
  pack
  timeout 150 python3 -m pd_ssm.cli bench transfer --connectors zmq --repeats 5 \
    --json "$R/transfer_zmq$round.json" >> "$R/transfer_zmq.txt" 2>&1; echo "zmq rc $?" >> "$R/transfer_zmq.txt"
  pack
done
OUT=$R/disagg timeout 300 bash benchmarks/disagg_gpu.sh > "$R/disagg.txt" 2>&1; echo "disagg rc $?" >> "$R/disagg.txt"
pack
OUT=$R timeout 120 python3 benchmarks/nccl_overhead_gpu.py > "$R/nccl_overhead.txt" 2>&1
echo "nccl overhead rc $?" >> "$R/nccl_overhead.txt"
pack
if [ -z "${SKIP_PROFILE:-}" ]; then
  OUT=$R timeout 150 python3 benchmarks/profile_transfer_gpu.py stream > "$R/stream_profile.txt" 2>&1
  echo "stream profile rc $?" >> "$R/stream_profile.txt"
  pack
fi
for f in tests nccl transfer_nccl transfer_zmq disagg nccl_overhead stream_profile; do echo "== $f"; [ -f "$R/$f.txt" ] && grep -v "Warning\|return func\|warn(" "$R/$f.txt" | tail -28; done
