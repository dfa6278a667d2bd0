"""`pd-ssm bench engine` with another decode step: the other sides of an A/B in one device call.

Mamba2 blocks defer the gated norm's scale and run the state update + gate as one kernel
(kernels/mixer_decode.py) in steps with fewer than mixer2.DEFER_BELOW_DECODE_ROWS decode rows
(larger decode batches take the three-kernel path either way). `--variant unfused` runs every
mixer on the three-kernel path (conv update, state update, gated norm); `tile:P/W` keeps the
deferred norm with the gated state update's tile BLOCK_P = P, W warps.

    python benchmarks/decode_fusion_ab_gpu.py --variant unfused [--json FILE]      (CUDA only)
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import pd_ssm.kernels.mixer_decode_triton as decode_step
from pd_ssm.bench.engine import EngineBenchOptions, format_table, run_engine_bench
from pd_ssm.layers.mixer2 import Mamba2Mixer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", default="unfused", help="unfused | tile:P/W")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.variant == "unfused":
        init = Mamba2Mixer.__init__

        def unfused_init(self: Mamba2Mixer, *a: Any, **kw: Any) -> None:
            init(self, *a, **kw)
            self.defer_norm_scale = False

        Mamba2Mixer.__init__ = unfused_init  # type: ignore[method-assign]
    else:
        block_p, warps = (int(v) for v in args.variant.split(":")[1].split("/"))

        def config(*_: Any) -> decode_step.SSUConfig:  # the tile whatever the batch
            return decode_step.SSUConfig(block_p, warps)

        decode_step.default_config = config  # type: ignore[assignment]
    result = run_engine_bench(EngineBenchOptions())
    result["variant"] = args.variant
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
