# Sourced by the device scripts that bring back a results tarball (transfer_gpu.sh, stream_gpu.sh):
# the shell settings, $OUT (what comes back) and $R (where each step writes), `pack`, and the
# serving packages installed from the carried wheels (the device has no registry).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; R=/tmp/res; mkdir -p "$OUT" "$R"
# NOTE: the tarball is rewritten after every step, so a call cut short by its time limit still
# brings back what finished
pack() { tar czf "$OUT/results.tgz" -C "$R" .; }
python3 -m pip install -q --no-index --find-links third_party/wheels pyzmq fastapi uvicorn openai prometheus_client \
  2>&1 | tail -2
