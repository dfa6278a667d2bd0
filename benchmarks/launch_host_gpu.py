"""Host time and eager time of SSD scan calls: this tree's launcher against an earlier one (a copy
of its ssd_triton.py, LAUNCH_OLD), alternated in one process (the lent hosts' speed drifts by 2x
within a call: only an interleaved A/B in one process says anything).

    git show REV:pd_ssm/kernels/ssd_triton.py > benchmarks/_ssd_triton_old.py   # here, untracked
    PYTHONPATH=.:third_party/baseline:/tmp/site LAUNCH_OLD=benchmarks/_ssd_triton_old.py \
        python3 benchmarks/launch_host_gpu.py                                   # on the GPU machine

Per case (LAUNCH_CASES) and config (LAUNCH_CONFIGS: "default" = default_config for the batch,
"large" = the large-batch config at any size, either with "+field=int" overrides), rounds of: host µs a call (ssd_host_gpu.host_us),
eager do_bench ms, for "old" (when given) and "new"; mamba_ssm's eager ms once a round; the
CUDA-graph replay once per config (device time). $OUT/launch_host.json, a summary printed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import sys
from dataclasses import replace
from typing import Any

sys.argv = [sys.argv[0]]  # the sweep module parses its own options at import
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ssd_host_gpu as host  # noqa: E402
import ssd_sweep_gpu as sw  # noqa: E402
import torch  # noqa: E402

from pd_ssm.kernels import ssd_triton as new  # noqa: E402
from pd_ssm.kernels.ssd_config import LARGE_BATCH_TOKENS, default_config  # noqa: E402


def _load_old() -> Any:
    path = os.environ.get("LAUNCH_OLD")
    if not path:
        return None
    spec = importlib.util.spec_from_file_location("ssd_triton_old", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    old = _load_old()
    launchers = {"old": old, "new": new} if old is not None else {"new": new}
    res: dict[str, Any] = {}
    for case in os.environ.get("LAUNCH_CASES", "1x2048,1x8192,16x1024 aligned").split(","):
        # a case of the sweep by name, or "SxL": S fresh sequences of L tokens
        lengths, mode = sw.CASES[case] if case in sw.CASES else ([int(case.split("x")[1])] * int(case.split("x")[0]),
                                                                 "fresh")
        sets = sw.rotating(lengths, mode)
        for cname in os.environ.get("LAUNCH_CONFIGS", "default,large").split(","):
            # "default" / "large", then any "+field=int" overrides (e.g. "default+scan_tma_min_tokens=0")
            base, *over = cname.split("+")
            cfg = default_config(torch.bfloat16, LARGE_BATCH_TOKENS if base == "large" else sum(lengths))
            cfg = replace(cfg, **{k: int(v) for k, v in (o.split("=") for o in over)})  # never the module's object
            row: dict[str, Any] = {n: dict(host_us=[], eager_ms=[]) for n in launchers}
            row["mamba_ssm"] = dict(eager_ms=[])
            for _ in range(int(os.environ.get("LAUNCH_ROUNDS", "5"))):
                for name, mod in launchers.items():
                    def fn(s: Any, mod: Any = mod, cfg: Any = cfg) -> Any:
                        return mod.ssd_scan_with_config(
                            s.x, s.dt, s.A, s.B, s.C, sw.Q, cu_seqlens=s.cu, context_lens=s.ctx, ssm_state=s.pool,
                            state_indices=s.slots, has_initial_state=s.has_init, D=s.D, dt_bias=s.dt_bias,
                            dt_softplus=True, dt_limit=(0.0, float("inf")), return_boundary_states=False, config=cfg)
                    row[name]["host_us"].append(host.host_us(fn, sets))
                    row[name]["eager_ms"].append(sw.bench(fn, sets))
                if sw.mamba_chunk_scan_combined is not None:
                    row["mamba_ssm"]["eager_ms"].append(sw.bench(sw.mamba, sets))
            row["new"]["graph_ms"] = host.graph_ms(lambda s, cfg=cfg: sw.ours(s, cfg), sets)
            for v in row.values():
                for k in ("host_us", "eager_ms"):
                    if v.get(k):
                        v[k + "_median"] = statistics.median(v[k])
            res[f"{case} {cname}"] = row
            sw.log(case, cname, {n: {k: round(x, 4) for k, x in v.items() if k.endswith("median") or k == "graph_ms"}
                                 for n, v in row.items()})
        del sets
        torch.cuda.empty_cache()
    out = os.environ.get("OUT", "/tmp/out")
    os.makedirs(out, exist_ok=True)
    json.dump(res, open(f"{out}/launch_host.json", "w"), indent=1)


if __name__ == "__main__":
    main()
