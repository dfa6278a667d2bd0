"""A `pd-ssm bench engine | kernels | serve` result (its `--json FILE`) as a PNG.

    python scripts/plot_bench.py engine.json --out engine.png
    python scripts/plot_bench.py kernels.json --out kernels.png
    python scripts/plot_bench.py serve.json --out serve.png

engine: each step's time as a multiple of its roofline floor (weights + state + KV bytes over the
copy bandwidth, or FLOPs over the matmul rate for prefill), coloured by its target (met, missed,
none), with the milliseconds beside each bar. kernels: each kernel's share of the ceiling that
bounds it (copy bandwidth or bf16 matmul rate, measured in the same run) and its speedup over
mamba_ssm where the baseline ran. serve: the distributions (CDFs) of TTFT and TPOT over the
completed requests, with the throughput in the title. Needs matplotlib (not a pd_ssm dependency).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

MET, MISSED, NONE = "#2e7d32", "#c62828", "#757575"


def read_result(path: Path) -> tuple[str, dict[str, Any]]:
    """('engine' | 'kernels' | 'serve', the JSON) of a bench result file; a clear error for anything else."""
    result = json.loads(path.read_text())
    if _is_serve(result):
        return "serve", {"runs": [result]}
    if isinstance(result, dict) and result.get("runs") and all(_is_serve(r) for r in result["runs"]):
        return "serve", result  # `bench serve --launch both`: one run per deployment
    rows = result.get("rows") if isinstance(result, dict) else None
    if not rows:
        raise ValueError(f"{path}: no 'rows': not a `pd-ssm bench engine|kernels|serve --json` file")
    if all("measured_ms" in r and "floor_ms" in r for r in rows):
        return "engine", result
    if all("kernel" in r and "ms" in r for r in rows):
        return "kernels", result
    raise ValueError(f"{path}: rows are neither `bench engine`'s nor `bench kernels`'s")


def _is_serve(result: Any) -> bool:
    return isinstance(result, dict) and "metrics" in result and "requests" in result


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # no display on build machines
    import matplotlib.pyplot as plt

    return plt


def plot_engine(result: dict[str, Any], out: Path) -> None:
    plt = _pyplot()
    rows = result["rows"]
    names = [r["name"] for r in rows]
    ratios = [r["measured_ms"] / r["floor_ms"] for r in rows]
    colors = [NONE if r["met"] is None else MET if r["met"] else MISSED for r in rows]
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(rows) + 1.6), dpi=120)
    ys = range(len(rows))[::-1]  # the first row on top
    ax.barh(list(ys), ratios, color=colors)
    for y, r, ratio in zip(ys, rows, ratios, strict=True):
        ax.text(ratio, y, f"  {r['measured_ms']:.3g} ms (floor {r['floor_ms']:.3g}, {r['floor_kind']})",
                va="center", fontsize=8)
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_yticks(list(ys), names, fontsize=9)
    ax.set_xlabel("time / roofline floor  (green: target met, red: missed, grey: no target)")
    ax.set_xlim(0, max(ratios) * 1.6)
    ax.set_title(f"pd-ssm bench engine: {result.get('model', '?')} on {result.get('device', '?')}, "
                 f"{result.get('dtype', '?')}", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    _save(fig, plt, out)


def plot_kernels(result: dict[str, Any], out: Path) -> None:
    plt = _pyplot()
    rows = result["rows"]
    labels = [f"{r['kernel']}  {r['shape']}" for r in rows]
    # the ceiling that bounds a kernel is the one it comes closer to
    shares = [max(r.get("pct_copy") or 0.0, r.get("pct_mma") or 0.0) for r in rows]
    which = ["mma" if (r.get("pct_mma") or 0.0) > (r.get("pct_copy") or 0.0) else "copy" for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 0.32 * len(rows) + 1.8), dpi=120, sharey=True,
                                      gridspec_kw={"width_ratios": [3, 2]})
    ys = range(len(rows))[::-1]
    left.barh(list(ys), shares, color=["#1565c0" if w == "copy" else "#ef6c00" for w in which])
    for y, share, w in zip(ys, shares, which, strict=True):
        left.text(share, y, f" {share:.0f}% {w}", va="center", fontsize=7)
    left.set_yticks(list(ys), labels, fontsize=7)
    left.set_xlim(0, 115)
    left.set_xlabel(f"% of the ceiling (blue: copy {result.get('copy_gbps', 0):.0f} GB/s, orange: bf16 matmul "
                    f"{result.get('bf16_mma_tflops', 0):.0f} TFLOP/s)", fontsize=8)
    left.grid(axis="x", alpha=0.3)
    speedups = [r.get("speedup") for r in rows]
    right.barh([y for y, s in zip(ys, speedups, strict=True) if s],
               [s for s in speedups if s], color="#6a1b9a")
    for y, s, r in zip(ys, speedups, rows, strict=True):  # the log axis has no 0: the rows without one at 1
        right.text(s or 1.0, y, f" {s:.2f}x" if s else f" {r.get('note') or 'no mamba_ssm kernel'}", va="center",
                   fontsize=7, color="black" if s else NONE)
    right.axvline(1.0, color="black", lw=0.8)
    right.set_xscale("log")
    right.set_xlabel("speedup over mamba_ssm (same run; log scale)", fontsize=8)
    right.grid(axis="x", alpha=0.3)
    fig.suptitle(f"pd-ssm bench kernels on {result.get('device', '?')}", fontsize=10)
    _save(fig, plt, out)


def plot_serve(result: dict[str, Any], out: Path) -> None:
    """TTFT and TPOT CDFs, one curve per run (deployment), with each run's p50 and p99 marked."""
    plt = _pyplot()
    runs = result["runs"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), dpi=120)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, run in enumerate(runs):
        done = [r for r in run["requests"] if r["ok"]]
        ttft = sorted(1e3 * r["ttft"] for r in done)
        tpot = sorted(1e3 * (r["latency"] - r["ttft"]) / (r["output_tokens"] - 1) for r in done
                      if r["output_tokens"] > 1)
        m, color = run["metrics"], colors[k % len(colors)]
        name = run.get("deployment") or f"run {k + 1}"
        label = f"{name}: {m['request_throughput']:.2f} req/s" if len(runs) > 1 else None
        for ax, values, metric in ((axes[0], ttft, "TTFT"), (axes[1], tpot, "TPOT")):
            if not values:
                continue
            ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], drawstyle="steps-post",
                    color=color, label=label)
            for p, ls in (("p50", "--"), ("p99", ":")):  # the figures of the run's table
                v = m[f"{metric.lower()}_ms"][p]
                ax.axvline(v, color=color, ls=ls, lw=0.8, label=f"{p} {v:.1f} ms")
    for ax, metric in ((axes[0], "TTFT"), (axes[1], "TPOT")):
        ax.set_xlabel(f"{metric} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_xscale("log")
        # plain milliseconds, not powers of ten; between the decades only 2 and 5 (the rest crowd)
        ax.xaxis.set_major_formatter(lambda v, _: f"{v:g}")
        ax.xaxis.set_minor_formatter(lambda v, _: f"{v:g}" if f"{v:e}"[0] in "25" else "")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    first = runs[0]
    m, w = first["metrics"], first["workload"]
    what = (f"{m['request_throughput']:.2f} req/s, {m['output_throughput']:.0f} output tok/s" if len(runs) == 1
            else " vs ".join(r.get("deployment") or "?" for r in runs))
    fig.suptitle(f"pd-ssm bench serve: {first.get('model', '?')}, {m['completed']} requests ({m['failed']} failed) "
                 f"of ~{w['input_len']} -> ~{w['output_len']} tokens at {w['request_rate']} req/s: {what}",
                 fontsize=9)
    _save(fig, plt, out)


def _save(fig: Any, plt: Any, out: Path) -> None:
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("result", type=Path, help="the JSON written by `pd-ssm bench engine|kernels|serve --json FILE`")
    p.add_argument("--out", type=Path, required=True, help="the PNG to write")
    a = p.parse_args(argv)
    try:
        kind, result = read_result(a.result)
    except (OSError, ValueError) as e:
        print(f"plot_bench: {e}", file=sys.stderr)
        return 2
    {"engine": plot_engine, "kernels": plot_kernels, "serve": plot_serve}[kind](result, a.out)
    print(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
