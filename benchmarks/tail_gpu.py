"""The decode step's tail after the last layer: the lm_head's logits and greedy sampling's argmax.

At batch 1 and 32 the tail took ~90 us of a step (RESULTS.md, sessions 18-20): the lm_head (cuBLAS,
bf16 out), a cast-and-copy of its logits into the fp32 buffer, and torch's argmax (13.1-13.7 us at
1 and at 32 rows).  This times, in CUDA graphs, at 1 / 32 / 128 rows of the 2.7B shape (vocab 50280,
hidden 2560):
- the logits: `linear` then `copy_` into fp32 (today) against one `torch.mm(..., out_dtype=fp32,
  out=...)` (one cuBLAS launch, fp32 out);
- the argmax: torch against argmax_triton's kernel at its default split (`GreedyArgmax`) and others
  (programs a row, block, warps; split 1 is one program a row).
Every variant's tokens are checked against torch.argmax first (random logits, ties planted, NaNs).

    PYTHONPATH=. python3 benchmarks/tail_gpu.py        (CUDA only; JSON to $OUT/tail.json)
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.linear_gpu import graph_time_us
from pd_ssm.kernels.argmax_triton import ArgmaxWorkspace, GreedyArgmax, launch_argmax

VOCAB, HID = 50280, 2560
ROWS = (1, 32, 128)
CALLS = 20


def graph_us(fn: Callable[[], object], calls: int = CALLS) -> float:
    """Median µs a call of `calls` back-to-back calls of fn in one CUDA graph."""
    return graph_time_us(lambda _x, _w: fn(), None, [None] * calls)


def planted(n: int, dev: torch.device) -> torch.Tensor:
    """Random fp32 logits [n, VOCAB] with each row's maximum copied to a later and an earlier index, and
    NaNs in every eighth row."""
    x = torch.randn(n, VOCAB, device=dev) * 4
    top = x.max(dim=1)
    for r in range(n):
        j = int(top.indices[r])
        x[r, (j + 12345) % VOCAB] = top.values[r]
        x[r, (j * 7 + 3) % VOCAB] = top.values[r]
        if r % 8 == 5:
            x[r, (j * 3 + 11) % VOCAB] = float("nan")
    return x


def main() -> None:
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(), "argmax": [], "logits": []}

    variants_ = [(s, b, w) for s in (1, 8, 16, 32, 64) for b, w in ((512, 4), (1024, 4), (2048, 8))]
    ws = ArgmaxWorkspace(max(ROWS), dev)
    default = GreedyArgmax()

    def variants() -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
        v: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"torch": lambda x: x.argmax(dim=-1),
                                                                 "default": default}
        for s, b, w in variants_:
            v[f"split {s} b{b} w{w}"] = lambda x, s=s, b=b, w=w: launch_argmax(x, ws, s, block=b, warps=w)
        return v

    bad = []
    for n in (1, 5, 32, 128):
        x = planted(n, dev)
        ref = x.argmax(dim=-1)
        for name, fn in variants().items():
            for _ in range(2):  # twice: the tickets must be back at 0
                if not torch.equal(fn(x), ref):
                    bad.append(f"{name} n={n}")
    res["wrong"] = bad
    print("wrong:", bad or "none", flush=True)

    for n in ROWS:
        x = torch.randn(n, VOCAB, device=dev) * 4
        for name, fn in variants().items():
            us = graph_us(lambda fn=fn, x=x: fn(x))
            res["argmax"].append({"rows": n, "variant": name, "us": us})
            print(f"argmax rows {n:4d} {name:22s} {us:7.2f} us", flush=True)

    w = torch.randn(VOCAB, HID, device=dev, dtype=torch.bfloat16) / HID**0.5
    for n in ROWS:
        h = torch.randn(n, HID, device=dev, dtype=torch.bfloat16)
        buf = torch.empty(n, VOCAB, device=dev, dtype=torch.float32)
        ref = (h.float() @ w.float().t())
        F.linear(h, w)
        try:
            torch.mm(h, w.t(), out_dtype=torch.float32, out=buf)
            err = (buf - ref).abs().max().item()
            have = True
        except (RuntimeError, TypeError) as e:
            print("mm out_dtype:", e)
            err, have = float("nan"), False
        a = graph_us(lambda h=h, buf=buf: buf.copy_(F.linear(h, w)), calls=4)
        b = graph_us(lambda h=h, buf=buf: torch.mm(h, w.t(), out_dtype=torch.float32, out=buf),
                                calls=4) if have else float("nan")
        c = graph_us(lambda h=h: F.linear(h, w), calls=4)
        res["logits"].append({"rows": n, "linear_copy_us": a, "mm_fp32_us": b, "linear_only_us": c, "mm_fp32_err": err})
        print(f"logits rows {n:4d}: linear+copy {a:7.2f}  mm fp32 out {b:7.2f}  linear alone {c:7.2f} us "
              f"(mm max err vs fp32 {err:.2e})", flush=True)
    (out / "tail.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
