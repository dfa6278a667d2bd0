#!/usr/bin/env bash
# Two source trees measured side by side in one device call, rounds alternating A B A B ...: the
# GPU host's speed moves between calls (and within one), so a change to a host-bound path (the
# NCCL connector, RESULTS.md session 6) is judged only against its parent measured alongside it.
#
#   here:   git archive <ref A> | tar -x -C third_party/a; git archive <ref B> | tar -x -C third_party/b
#   device: A=third_party/a B=third_party/b ROUNDS=3 CMD="bench transfer --device cuda --connectors nccl \
#           --repeats 5" bash benchmarks/ab_gpu.sh          (carry third_party; any pd-ssm command with --json)
#
# Each run: `python3 -m pd_ssm.cli $CMD --json $OUT/{a,b}<round>.json` from inside its tree. Then a
# table per row of the JSON's "rows" (`bench transfer`: ratio to raw; `bench engine`: ms): every
# round's figure for A and for B. More than two trees: TREES="a=third_party/a b=. c=third_party/c"
# (one-letter names) in place of A and B.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
: "${CMD:?CMD=<pd-ssm command>}"
if [ -z "${TREES:-}" ]; then
  : "${A:?A=<tree>}" "${B:?B=<tree>}"
  TREES="a=$A b=$B"
fi
HERE=$PWD
python3 -m pip install -q --no-index --find-links third_party/wheels pyzmq fastapi uvicorn openai prometheus_client \
  2>&1 | tail -1
for round in $(seq 1 "${ROUNDS:-3}"); do
  for pair in $TREES; do
    side=${pair%%=*}; tree=${pair#*=}
    # shellcheck disable=SC2086  # CMD is a list of arguments
    (cd "$tree" && PYTHONPATH=$PWD timeout "${RUN_TIMEOUT:-200}" python3 -m pd_ssm.cli $CMD \
      --json "$OUT/$side$round.json" > "$OUT/$side$round.txt" 2>&1)
    echo "$side round $round rc $?"
  done
done
cd "$HERE" && python3 - "$OUT" <<'EOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
figures: dict[str, dict[str, list[str]]] = {}
for f in sorted(out.glob("[a-z][0-9]*.json")):
    for row in json.loads(f.read_text()).get("rows", []):
        key = row.get("name") or " ".join(str(row.get(k)) for k in ("connector", "pages", "state_dtype"))
        value = row.get("ratio", row.get("measured_ms"))
        figures.setdefault(key, {}).setdefault(f.name[0], []).append(f"{value:.3f}")
for key, sides in figures.items():
    print(f"{key:32} " + " ".join(f"{side.upper()} {' '.join(v):28}" for side, v in sorted(sides.items())))
EOF
