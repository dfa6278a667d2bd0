"""Host time of eager SSD scan calls with FastKernel's direct launches against Triton's own launch
path, alternated in one process (the lent hosts' speed drifts by 2x within a call: only an
interleaved A/B in one process says anything).

    PYTHONPATH=. python3 benchmarks/launch_host_gpu.py      # on the GPU machine; $OUT/launch_host.json
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from typing import Any

sys.argv = [sys.argv[0]]  # the sweep module parses its own options at import
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ssd_host_gpu as host  # noqa: E402
import ssd_sweep_gpu as sw  # noqa: E402
import torch  # noqa: E402

from pd_ssm.kernels import ssd_triton as st  # noqa: E402

WRAPPED = ("_META", "_SERIAL", "_DT", "_STATE", "_PASSING", "_CB", "_SCAN")


class _Plain:
    """Triton's own launch path: fn[grid](...)."""

    def __init__(self, fast: Any) -> None:
        self.fn = fast._fn

    def __getitem__(self, grid: Any) -> Any:
        return self.fn[grid]


def main() -> None:
    fast = {n: getattr(st, n) for n in WRAPPED}
    plain = {n: _Plain(k) for n, k in fast.items()}
    res: dict[str, Any] = {}
    for case in os.environ.get("LAUNCH_CASES", "1x2048,1x8192,16x1024 aligned").split(","):
        lengths, mode = sw.CASES[case]
        sets = sw.rotating(lengths, mode)
        cfg = sw.default_config(torch.bfloat16, sum(lengths))
        times: dict[str, list[float]] = {"triton": [], "fast": []}
        for _ in range(int(os.environ.get("LAUNCH_ROUNDS", "6"))):
            for name, kernels in (("triton", plain), ("fast", fast)):
                for n, k in kernels.items():
                    setattr(st, n, k)
                times[name].append(host.host_us(lambda s, cfg=cfg: sw.ours(s, cfg), sets))
        res[case] = {k: dict(median_us=statistics.median(v), all_us=v) for k, v in times.items()}
        sw.log(case, {k: round(v["median_us"], 1) for k, v in res[case].items()})
        del sets
        torch.cuda.empty_cache()
    out = os.environ.get("OUT", "/tmp/out")
    os.makedirs(out, exist_ok=True)
    json.dump(res, open(f"{out}/launch_host.json", "w"), indent=1)


if __name__ == "__main__":
    main()
