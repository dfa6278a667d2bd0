"""What the prefill graphs' layer events cost (prefill_graphs.py: one external event record node
after each decoder layer, which graph-prefill streaming waits on), and that they change nothing.

Mamba2-2.7B shape (dummy weights), one 2048-token prefill in the (2048, 1) bucket, captured twice
on the same model and pool -- with and without the events -- and replayed alternately; the two
outputs and final states must be equal to the bit. Prints JSON (median ms per replay, each round).

    python benchmarks/prefill_events_gpu.py [--rounds 5] [--replays 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pd_ssm import LLM  # noqa: E402
from pd_ssm.bench.shapes import MAMBA2_2_7B  # noqa: E402
from pd_ssm.engine.prefill_graphs import PrefillGraphs, VarlenRows  # noqa: E402

TOKENS = 2048


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--replays", type=int, default=10)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(MAMBA2_2_7B))
        eng = LLM(model=tmp, device="cuda", load_format="dummy", max_num_seqs=1, max_num_batched_tokens=TOKENS,
                  max_model_len=TOKENS + 16, gpu_memory_utilization=0.5).engine
    own = eng.runner.prefill_graphs  # the engine's, with the events (the default)
    assert own is not None and own.layer_events and own.bucket(TOKENS, 1) == (TOKENS, 1)
    none = PrefillGraphs(eng.model, eng.pool, buckets=[(TOKENS, 1)], scratch_slot=own.scratch_slot, width=own.width,
                         layer_events=False)
    graphs = {True: own, False: none}
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 50000, (TOKENS,), generator=g).tolist()
    rows = VarlenRows(ids, list(range(TOKENS)), [-1] * TOKENS, [0, TOKENS], [0], [0], [[]])
    results: dict[str, list[float]] = {"events": [], "none": []}
    outs: dict[bool, tuple[torch.Tensor, torch.Tensor]] = {}
    for _ in range(args.rounds):
        for on in (True, False):
            pg = graphs[on]
            pg.run(rows)  # warm
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            times = []
            for _ in range(args.replays):
                start.record()
                out = pg.run(rows)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            results["events" if on else "none"].append(statistics.median(times))
            outs[on] = (out.clone(), eng.pool.ssm(0)[0].clone())
    equal = all(torch.equal(a, b) for a, b in zip(outs[True], outs[False], strict=True))
    print(json.dumps({"tokens": TOKENS, "ms_per_replay": results, "equal": equal,
                      "median_events_ms": statistics.median(results["events"]),
                      "median_none_ms": statistics.median(results["none"])}))
    if not equal:
        raise SystemExit("layer events changed the prefill's output or state")


if __name__ == "__main__":
    main()
