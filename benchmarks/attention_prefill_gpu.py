"""Tiles of the Triton varlen prefill attention against each other and torch SDPA, at a hybrid
model's attention shape (Bamba-9B: 32 query heads on 8 KV heads of 128, KV pages of 16 tokens), bf16.

Per case and tile: median ms (`triton.testing.do_bench`, inputs rotated past L2), TFLOP/s of the
causal query-key pairs, and the output's largest difference from the default tile's and from an
fp32 reference (torch SDPA on upcast dense K/V, where the context fits in memory). torch SDPA
(flash, dense K/V repeated to the query heads beforehand) on the fresh cases is timed too: it is
what `varlen_prefill_attention` would call where it is faster (issue 3's scope).

    OUT=$OUT PYTHONPATH=. python3 benchmarks/attention_prefill_gpu.py    # writes $OUT/attention_prefill.json

Exits 1 when any tile's output differs from the reference by more than bf16's tolerance.
"""

from __future__ import annotations

import functools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pd_ssm.bench.kernels import (  # noqa: E402
    ATT_HEAD_DIM,
    ATT_HEADS,
    ATT_KV_HEADS,
    _bench,
    _causal_keys,
    _offsets,
    _paged_kv,
)
from pd_ssm.kernels.attention_prefill_triton import (  # noqa: E402
    PrefillConfig,
    default_prefill_config,
    launch_prefill,
)

DEV = torch.device("cuda")
TOL = 2e-2  # bf16 outputs (tests/kernels/test_attention_triton.py)
CASES: dict[str, tuple[list[int], list[int]]] = {
    "1x2048": ([2048], [0]), "4x512 after 1536": ([512] * 4, [1536] * 4), "1x8192": ([8192], [0]),
    "1x2048 after 6144": ([2048], [6144]),
}
TILES: dict[str, tuple[int, int, int, int]] = {  # block_m, block_n, warps, stages (session 25: eight more)
    "m64 n64 w4 s2": (64, 64, 4, 2), "m128 n64 w8 s2": (128, 64, 8, 2), "m128 n128 w8 s2": (128, 128, 8, 2),
    "m256 n64 w8 s2": (256, 64, 8, 2),
}


def dense_kv(k_cache: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
    """One sequence's first n keys (or values) from its pages: [1, ATT_HEADS, n, D], heads repeated."""
    kv = k_cache[table.long()].reshape(-1, ATT_KV_HEADS, ATT_HEAD_DIM)[:n]  # [n, Hkv, D]
    return kv.transpose(0, 1)[None].repeat_interleave(ATT_HEADS // ATT_KV_HEADS, dim=1)


def run_case(q_lens: list[int], ctx: list[int], g: torch.Generator) -> tuple[dict[str, object], bool]:
    """Every tile (and SDPA where the case is one fresh sequence) on one case: its row and whether all
    outputs are within tolerance."""
    scale = ATT_HEAD_DIM ** -0.5
    T, seq_lens = sum(q_lens), [c + n for n, c in zip(q_lens, ctx, strict=True)]
    flops = 4.0 * ATT_HEADS * ATT_HEAD_DIM * _causal_keys(q_lens, ctx)
    sets = [_paged_kv(DEV, g, seq_lens) for _ in range(3)]
    qs = [torch.randn(T, ATT_HEADS, ATT_HEAD_DIM, device=DEV, generator=g).bfloat16() for _ in range(3)]
    cu = _offsets(q_lens, DEV)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)

    def ours(cfg: PrefillConfig, k: int) -> torch.Tensor:
        return launch_prefill(qs[k], sets[k][0], sets[k][1], cu, lens, sets[k][2], scale, cfg)

    ref = None
    if len(q_lens) == 1:  # fp32 reference: SDPA's math on upcast dense q, K, V (causal, offset by ctx)
        k0, v0, t0 = sets[0]
        kd, vd = dense_kv(k0, t0[0], seq_lens[0]).float(), dense_kv(v0, t0[0], seq_lens[0]).float()
        qd = qs[0].float().transpose(0, 1)[None]  # [1, H, T, D]
        mask = torch.arange(seq_lens[0], device=DEV)[None, :] <= (ctx[0] + torch.arange(T, device=DEV))[:, None]
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            ref = torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask)[0].transpose(0, 1)
        del kd, vd
    row: dict[str, object] = {}
    ok = True
    base_out = ours(default_prefill_config(torch.bfloat16, torch.bfloat16), 0)
    for name, (bm, bn, w, st) in TILES.items():
        cfg = PrefillConfig(use_dot=True, block_m=bm, block_n=bn, num_warps=w, num_stages=st)
        try:
            o = ours(cfg, 0)
            ms = _bench(functools.partial(ours, cfg), 3)
        except Exception as e:  # noqa: BLE001 - a tile that does not compile (shared memory) is reported
            row[name] = dict(error=repr(e)[:200])
            print(name, row[name], flush=True)
            continue
        d_default = float((o.float() - base_out.float()).abs().max())
        d_ref = None if ref is None else float((o.float() - ref).abs().max())
        good = d_default < TOL * 4 and (d_ref is None or d_ref < TOL * 4)
        ok &= good
        row[name] = dict(ms=ms, tflops=flops / ms / 1e9, max_diff_default=d_default, max_diff_ref=d_ref, ok=good)
        print(name, row[name], flush=True)
    if ctx == [0] and len(q_lens) == 1:
        dense = [(q.transpose(0, 1)[None], dense_kv(k, t[0], T).contiguous(), dense_kv(v, t[0], T).contiguous())
                 for q, (k, v, t) in zip(qs, sets, strict=True)]
        sdpa = torch.nn.functional.scaled_dot_product_attention
        ms = _bench(lambda k: sdpa(*dense[k], is_causal=True), 3)
        row["torch SDPA dense"] = dict(ms=ms, tflops=flops / ms / 1e9)
        print("torch SDPA dense", row["torch SDPA dense"], flush=True)
    return row, ok


def main() -> int:
    out_dir = os.environ.get("OUT", "/tmp/out")
    os.makedirs(out_dir, exist_ok=True)
    g = torch.Generator(device=DEV).manual_seed(0)
    default = default_prefill_config(torch.bfloat16, torch.bfloat16)
    results: dict[str, dict[str, object]] = {}
    ok = True
    for case, (q_lens, ctx) in CASES.items():
        print(case, flush=True)
        results[case], good = run_case(q_lens, ctx, g)
        ok &= good
    with open(os.path.join(out_dir, "attention_prefill.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "default": default._asdict(), "cases": results}, f,
                  indent=2)
    names = [*TILES, "torch SDPA dense"]
    print("| tile | " + " | ".join(CASES) + " |")
    print("|---|" + "---|" * len(CASES))
    for name in names:
        cells = []
        for case in CASES:
            r = results[case].get(name)
            cells.append("-" if not r else ("ERROR" if "error" in r else
                                            f"{r['ms']:.3f} ({r['tflops']:.0f}){'' if r.get('ok', True) else ' *'}"))
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("all outputs within tolerance" if ok else "OUTPUT MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
