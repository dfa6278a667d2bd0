#!/usr/bin/env bash
# `pd-ssm serve --disagg` on two GPUs: 1 prefill worker on cuda:0, 1 decode worker on cuda:1, the
# NCCL connector between them; the official openai client queries it (completions and chat,
# streamed or not, greedy and seeded) and every answer must equal LLM.generate on a colocated
# engine over the same checkpoint (the embedded tiny default model unless MODEL=dir).
#
# Usage (device tool, kind nvidia-h200-x2, carry third_party/wheels):
#   bash benchmarks/disagg_gpu.sh
#   EXTRA="--stream-layers --stream-bytes 65536" bash benchmarks/disagg_gpu.sh   (layer-wise streaming)
# Writes $OUT/disagg_gpu.json (every request: tokens, match, TTFT, transfer figures from /metrics),
# $OUT/disagg_gpu.txt (summary) and $OUT/serve.log; exits 1 on any mismatch or error, 2 when the
# deployment does not come up.
#
# The GPU image has torch, triton, safetensors, tokenizers, msgpack and jinja2, but not the
# serving stack. Carry these wheels in third_party/wheels (installed with
# `pip install --no-index --find-links third_party/wheels ...` below):
#   pyzmq; fastapi, starlette, pydantic, pydantic_core, typing_inspection, annotated_types,
#   annotated_doc, opentelemetry_api, anyio, sniffio, idna, typing_extensions; uvicorn, h11, click;
#   prometheus_client; openai, httpx2, httpcore2, truststore, jiter
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PY=${PYTHON:-python3}

NEED="pyzmq fastapi starlette pydantic pydantic_core typing_inspection annotated_types annotated_doc anyio sniffio idna typing_extensions uvicorn h11 click prometheus_client openai httpx2 httpcore2 truststore jiter"
if ! $PY -c "import zmq, fastapi, uvicorn, openai, prometheus_client" 2>/dev/null; then
  [ -d third_party/wheels ] || { echo "serving packages missing and no third_party/wheels carried" >&2; exit 2; }
  # shellcheck disable=SC2086
  $PY -m pip install -q --no-index --find-links third_party/wheels $NEED || exit 2
fi
DEVICE=${DEVICE:-cuda}  # DEVICE=cpu: the same check with gloo, to try the script without GPUs
if [ "$DEVICE" = cuda ]; then
  nvidia-smi --query-gpu=index,name --format=csv | tee "$OUT/gpu.txt"
  [ "$(nvidia-smi -L | wc -l)" -ge 2 ] || { echo "needs two GPUs (kind nvidia-h200-x2)" >&2; exit 2; }
fi

MODEL=${MODEL:-$($PY -c "from pd_ssm.default_model import default_model_dir; print(default_model_dir())")}
FLAGS=(--device "$DEVICE" --max-num-seqs 8 --gpu-memory-utilization 0.3)
# shellcheck disable=SC2206  # EXTRA: more serve flags, e.g. EXTRA="--stream-layers --stream-bytes 65536"
FLAGS+=(${EXTRA:-})
$PY -m pd_ssm.cli serve --disagg --num-prefill 1 --num-decode 1 --connector nccl --gpus 0,1 \
    --model "$MODEL" --port 0 "${FLAGS[@]}" > "$OUT/serve.out" 2> "$OUT/serve.log" &
SERVE=$!
trap 'kill -TERM $SERVE 2>/dev/null; wait $SERVE 2>/dev/null' EXIT
URL=""
for _ in $(seq 300); do  # the launcher prints its address at once; workers load after
  URL=$(grep -o 'http://[0-9.:]*' "$OUT/serve.out" | head -1)
  [ -n "$URL" ] && break
  kill -0 $SERVE 2>/dev/null || break
  sleep 0.2
done
[ -n "$URL" ] || { echo "no address from pd-ssm serve" >&2; tail -30 "$OUT/serve.log" >&2; exit 2; }

URL=$URL MODEL=$MODEL OUT=$OUT DEVICE=$DEVICE timeout ${CHECK_TIMEOUT:-400} $PY - <<'PYEOF'
"""Wait for both workers, query through the openai client, compare with a colocated engine."""
import json, os, random, re, sys, time, urllib.request

import openai

from pd_ssm import LLM, SamplingParams

url, model_dir, out = os.environ["URL"], os.environ["MODEL"], os.environ["OUT"]


def get(path: str) -> str:
    with urllib.request.urlopen(url + path, timeout=10) as r:
        return r.read().decode()


deadline = time.monotonic() + 300
while True:
    try:
        health = json.loads(get("/health"))
        if sum(w["status"] == "healthy" for w in health["workers"]) == 2:
            break
    except OSError:
        pass
    if time.monotonic() > deadline:
        sys.exit("the deployment did not come up within 300 s (see serve.log)")
    time.sleep(0.5)
print("workers:", health["workers"], flush=True)

client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
name = client.models.list().data[0].id
# the reference on cuda:0 (beside the prefill worker) with the same engine flags; requests go one at a time on both sides, so
# both run the same batch shapes (batch-size dependent GEMM algorithms would differ otherwise)
ref = LLM(model=model_dir, device=os.environ["DEVICE"], max_num_seqs=8, gpu_memory_utilization=0.3)
rng = random.Random(int(os.environ.get("SEED", random.randrange(1 << 30))))
words = "def class return import self value for while print list dict None True yield".split()
rows, ok = [], True
for i in range(int(os.environ.get("REQUESTS", 16))):
    prompt = " ".join(rng.choice(words) for _ in range(rng.randint(3, 60)))
    case = {"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.9, "top_p": 0.95, "seed": rng.randrange(1 << 30)}
    n, stream, chat = rng.randint(4, 48), i % 4 >= 2, i % 8 >= 4
    extra = {"return_token_ids": True, "ignore_eos": True}
    t0 = time.monotonic()
    ttft = None
    if chat:
        messages = [{"role": "user", "content": prompt}]
        if stream:
            ids = []
            for c in client.chat.completions.create(model=name, messages=messages, max_tokens=n, stream=True,
                                                    extra_body=extra, **case):
                got = c.choices[0].model_extra.get("token_ids") or []
                if got and ttft is None:
                    ttft = time.monotonic() - t0
                ids += got
            prompt_ids = client.chat.completions.create(model=name, messages=messages, max_tokens=1,
                                                        extra_body={"return_token_ids": True}).model_extra["prompt_token_ids"]
        else:
            r = client.chat.completions.create(model=name, messages=messages, max_tokens=n, extra_body=extra, **case)
            ids, prompt_ids = r.choices[0].model_extra["token_ids"], r.model_extra["prompt_token_ids"]
    elif stream:
        ids, prompt_ids = [], None
        for c in client.completions.create(model=name, prompt=prompt, max_tokens=n, stream=True, extra_body=extra, **case):
            if c.choices:
                got = c.choices[0].model_extra["token_ids"]
                if got and ttft is None:
                    ttft = time.monotonic() - t0
                prompt_ids = prompt_ids or c.choices[0].model_extra.get("prompt_token_ids")
                ids += got
    else:
        r = client.completions.create(model=name, prompt=prompt, max_tokens=n, extra_body=extra, **case)
        ids, prompt_ids = r.choices[0].model_extra["token_ids"], r.choices[0].model_extra["prompt_token_ids"]
    seconds = time.monotonic() - t0
    want = ref.generate(prompt_ids, SamplingParams(max_tokens=n, ignore_eos=True, **case))[0].outputs[0].token_ids
    match = ids == want
    ok &= match
    rows.append({"i": i, "chat": chat, "stream": stream, "sampling": case, "max_tokens": n,
                 "prompt_tokens": len(prompt_ids), "match": match, "seconds": round(seconds, 4),
                 "ttft": None if ttft is None else round(ttft, 4), "tokens": ids, "reference": want})
    print(f"[{i}] chat={chat} stream={stream} {case} n={n}: {'OK' if match else 'MISMATCH'} {seconds * 1e3:.1f} ms",
          flush=True)

metrics = get("/metrics")
def metric(pattern: str) -> float | None:
    m = re.search(pattern, metrics, re.M)
    return None if m is None else float(m.group(1))
transfer = {side: {"count": metric(rf'^pd_ssm_transfer_bytes_count{{role="{side}"}} (\S+)$'),
                   "bytes": metric(rf'^pd_ssm_transfer_bytes_sum{{role="{side}"}} (\S+)$'),
                   "seconds": metric(rf'^pd_ssm_transfer_seconds_sum{{role="{side}"}} (\S+)$')}
            for side in ("prefill", "decode")}
pools = {w: {k: metric(rf'^pd_ssm_{k}{{worker="{w}"}} (\S+)$') for k in
             ("state_slots_used", "kv_blocks_used", "state_slots_reserved", "pool_invariant_ok")}
         for w in ("p0", "d0")}
ok &= all(p["state_slots_used"] == 0 and p["kv_blocks_used"] == 0 and p["pool_invariant_ok"] == 1 for p in pools.values())
summary = {"ok": bool(ok), "requests": len(rows), "matches": sum(r["match"] for r in rows),
           "transfer": transfer, "pools_after": pools, "workers": health["workers"], "rows": rows}
with open(f"{out}/disagg_gpu.json", "w") as f:
    json.dump(summary, f, indent=1)
where = "1P (cuda:0) + 1D (cuda:1) over NCCL" if os.environ["DEVICE"] == "cuda" else "1P + 1D over NCCL(gloo), CPU"
lines = [f"disaggregated {where} vs colocated LLM.generate: "
         f"{summary['matches']}/{len(rows)} requests identical",
         f"transfers: {json.dumps(transfer)}", f"pools after: {json.dumps(pools)}",
         f"median request {sorted(r['seconds'] for r in rows)[len(rows) // 2] * 1e3:.1f} ms",
         "RESULT: " + ("PASS" if ok else "FAIL")]
open(f"{out}/disagg_gpu.txt", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
sys.exit(0 if ok else 1)
PYEOF
STATUS=$?
[ $STATUS -ne 0 ] && tail -40 "$OUT/serve.log"
exit $STATUS
