"""`pd-ssm bench engine` with the fused decode step switched off: the A side of an A/B in one call.

Mamba2 blocks defer the gated norm's scale and run conv update + state update + gate as one kernel
(kernels/mixer_decode.py). This runs the same bench with every mixer on the three-kernel path, so
the fused figures (`python -m pd_ssm.cli bench engine`) can be compared in the same device call.

    python benchmarks/decode_fusion_ab_gpu.py [--json FILE]      (CUDA only)
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from pd_ssm.bench.engine import EngineBenchOptions, format_table, run_engine_bench
from pd_ssm.layers.mixer2 import Mamba2Mixer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    init = Mamba2Mixer.__init__

    def unfused_init(self: Mamba2Mixer, *a: Any, **kw: Any) -> None:
        init(self, *a, **kw)
        self.defer_norm_scale = False

    Mamba2Mixer.__init__ = unfused_init  # type: ignore[method-assign]
    result = run_engine_bench(EngineBenchOptions())
    result["variant"] = "unfused (conv update, state update, gated norm as three kernels)"
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
