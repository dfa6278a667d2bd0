#!/usr/bin/env bash
# One device call on nvidia-h200-x2 for layer-wise streaming from a graph prefill (carry
# third_party: the wheels): the GPU tests of the streaming path, what the prefill graphs' layer
# events cost (prefill_events_gpu.py), `pd-ssm bench transfer --connectors stream-nccl,nccl` (a
# 2048-token 2.7B prefill streamed over NCCL, cuda:0 -> cuda:1; the NCCL rows), and
# `pd-ssm serve --disagg` streaming over NCCL (every answer equal to a colocated engine's).
# Results: $OUT/results.tgz; a summary on stdout.
# shellcheck source=benchmarks/device_results.sh
source benchmarks/device_results.sh
timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider tests/state_transfer/test_engine_streaming.py \
  tests/state_transfer/test_nccl_streaming.py tests/state_transfer/test_connector_sink.py \
  tests/state_transfer/test_nccl_gpu_check.py tests/engine/test_prefill_graphs.py \
  > "$R/tests.txt" 2>&1; echo "tests rc $?" >> "$R/tests.txt"
tail -3 "$R/tests.txt"; pack
timeout 150 python3 benchmarks/prefill_events_gpu.py > "$R/events.txt" 2>&1; echo "events rc $?" >> "$R/events.txt"
tail -2 "$R/events.txt"; pack
timeout 250 python3 -m pd_ssm.cli bench transfer --device cuda --connectors stream-nccl,nccl --repeats 5 \
  --json "$R/transfer.json" > "$R/transfer.txt" 2>&1; echo "transfer rc $?" >> "$R/transfer.txt"
tail -14 "$R/transfer.txt"; pack
EXTRA="--stream-layers --stream-bytes 65536" OUT=$R/disagg timeout 300 bash benchmarks/disagg_gpu.sh \
  > "$R/disagg.txt" 2>&1; echo "disagg rc $?" >> "$R/disagg.txt"
tail -4 "$R/disagg.txt"; pack
