"""What a serving benchmark reports, from its requests' timings (client.RequestResult): throughput,
and TTFT, TPOT, ITL and end-to-end latency as mean and percentiles, in vLLM benchmark_serving's
definitions, so the figures compare with runs of that client against vLLM or SGLang:

  TTFT   time from sending a request to its first token
  TPOT   (latency - TTFT) / (output tokens - 1), a request's mean time per token after the first
  ITL    the gaps between a request's consecutive token events
  E2E    time from sending a request to its last event
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from pd_ssm.bench.client import RequestResult

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True, slots=True)
class Distribution:
    """Milliseconds: mean and percentiles (nan where no value was measured)."""

    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, seconds: list[float]) -> Distribution:
        if not seconds:
            return cls(math.nan, math.nan, math.nan, math.nan)
        ms = sorted(1e3 * s for s in seconds)
        return cls(sum(ms) / len(ms), *(_percentile(ms, p) for p in PERCENTILES))


def _percentile(sorted_ms: list[float], p: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    k = (len(sorted_ms) - 1) * p / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(sorted_ms) - 1)
    return sorted_ms[lo] + (sorted_ms[hi] - sorted_ms[lo]) * (k - lo)


@dataclass(frozen=True, slots=True)
class ServingMetrics:
    completed: int
    failed: int
    duration_s: float
    input_tokens: int
    output_tokens: int
    request_throughput: float  # completed requests a second
    output_throughput: float  # generated tokens a second
    total_token_throughput: float  # prompt + generated tokens a second
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2e_ms: Distribution

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(results: list[RequestResult], duration_s: float) -> ServingMetrics:
    """The benchmark's figures over its completed requests (failed ones are only counted)."""
    done = [r for r in results if r.ok]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    itls = [b - a for r in done for a, b in zip(r.token_times, r.token_times[1:], strict=False)]
    n_in = sum(r.prompt_tokens for r in done)
    n_out = sum(r.output_tokens for r in done)
    per_s = 1.0 / duration_s if duration_s > 0 else math.nan
    return ServingMetrics(
        completed=len(done), failed=len(results) - len(done), duration_s=duration_s, input_tokens=n_in,
        output_tokens=n_out, request_throughput=len(done) * per_s, output_throughput=n_out * per_s,
        total_token_throughput=(n_in + n_out) * per_s, ttft_ms=Distribution.of([r.ttft for r in done]),
        tpot_ms=Distribution.of(tpots), itl_ms=Distribution.of(itls), e2e_ms=Distribution.of([r.latency for r in done]),
    )


def format_table(m: ServingMetrics, title: str) -> str:
    lines = [
        title,
        f"requests: {m.completed} completed, {m.failed} failed, in {m.duration_s:.2f} s",
        f"tokens: {m.input_tokens} in, {m.output_tokens} out",
        f"throughput: {m.request_throughput:.2f} req/s, {m.output_throughput:.1f} output tok/s, "
        f"{m.total_token_throughput:.1f} total tok/s",
        f"{'ms':<6}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}",
    ]
    for name, d in (("TTFT", m.ttft_ms), ("TPOT", m.tpot_ms), ("ITL", m.itl_ms), ("E2E", m.e2e_ms)):
        lines.append(f"{name:<6}{d.mean:>10.2f}{d.p50:>10.2f}{d.p90:>10.2f}{d.p99:>10.2f}")
    return "\n".join(lines)


def format_comparison(runs: list[tuple[str, ServingMetrics]]) -> str:
    """The same workload's figures on several deployments, side by side."""
    lines = [f"{'':<22}" + "".join(f"{name:>14}" for name, _ in runs)]
    rows: list[tuple[str, str]] = [("req/s", "request_throughput"), ("output tok/s", "output_throughput")]
    for label, attr in rows:
        lines.append(f"{label:<22}" + "".join(f"{getattr(m, attr):>14.2f}" for _, m in runs))
    for name in ("ttft", "tpot", "itl", "e2e"):
        for p in ("p50", "p99"):
            lines.append(f"{name.upper() + ' ' + p + ' (ms)':<22}"
                         + "".join(f"{getattr(getattr(m, name + '_ms'), p):>14.2f}" for _, m in runs))
    lines.append(f"{'failed':<22}" + "".join(f"{m.failed:>14d}" for _, m in runs))
    return "\n".join(lines)
