"""bench/workload.py and bench/metrics.py: the serving benchmark's requests and figures (no server)."""

from __future__ import annotations

import dataclasses
import math
import random

import numpy as np
import pytest

from pd_ssm.bench.client import RequestResult
from pd_ssm.bench.metrics import Distribution, summarize
from pd_ssm.bench.workload import WorkloadSpec, make_workload


def test_workload_is_seeded_and_within_its_ranges() -> None:
    spec = WorkloadSpec(num_prompts=200, input_len=40, output_len=10, range_ratio=0.5, request_rate=50.0, seed=3,
                        token_low=5, token_high=77)
    reqs = make_workload(spec)
    assert reqs == make_workload(spec) and reqs != make_workload(dataclasses.replace(spec, seed=4))
    assert [r.index for r in reqs] == list(range(200))
    assert all(20 <= len(r.prompt) <= 60 and 5 <= r.max_tokens <= 15 for r in reqs)
    assert all(5 <= t < 77 for r in reqs for t in r.prompt)
    assert len({len(r.prompt) for r in reqs}) > 10  # the lengths do vary
    times = [r.send_at for r in reqs]
    assert times[0] == 0.0 and times == sorted(times)
    mean_gap = times[-1] / (len(times) - 1)  # exponential gaps of mean 1 / rate = 20 ms
    assert 0.014 < mean_gap < 0.026


def test_workload_all_at_once_and_fixed_lengths() -> None:
    reqs = make_workload(WorkloadSpec(num_prompts=7, input_len=9, output_len=4))
    assert all(r.send_at == 0.0 and len(r.prompt) == 9 and r.max_tokens == 4 for r in reqs)


@pytest.mark.parametrize("bad", [dict(num_prompts=0), dict(input_len=0), dict(output_len=-1), dict(range_ratio=1.0),
                                 dict(request_rate=0.0), dict(token_low=9, token_high=9)])
def test_workload_refuses_bad_specs(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        WorkloadSpec(**bad)  # type: ignore[arg-type]


def test_distribution_matches_numpy_percentiles() -> None:
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 100):
        s = rng.exponential(0.05, n).tolist()
        d = Distribution.of(s)
        ref = np.percentile(np.array(s) * 1e3, [50, 90, 99])
        assert d.mean == pytest.approx(1e3 * float(np.mean(s)))
        assert [d.p50, d.p90, d.p99] == pytest.approx(ref.tolist())
    assert math.isnan(Distribution.of([]).p99)


def test_summarize_follows_the_definitions() -> None:
    rng = random.Random(1)
    results = []
    for i in range(6):
        r = RequestResult(i, prompt_tokens=rng.randint(5, 50))
        r.ttft = rng.uniform(0.01, 0.2)
        gaps = [rng.uniform(0.001, 0.02) for _ in range(rng.randint(2, 9))]
        r.token_times = [r.ttft + sum(gaps[:k]) for k in range(len(gaps) + 1)]
        r.output_tokens = len(r.token_times)
        r.latency = r.token_times[-1]
        r.ok = i != 4  # one failed request: counted, not measured
        results.append(r)
    m = summarize(results, duration_s=2.0)
    done = [r for r in results if r.ok]
    assert (m.completed, m.failed) == (5, 1)
    assert m.output_tokens == sum(r.output_tokens for r in done) and m.input_tokens == sum(r.prompt_tokens for r in done)
    assert m.request_throughput == pytest.approx(2.5) and m.output_throughput == pytest.approx(m.output_tokens / 2)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done]
    assert m.tpot_ms.mean == pytest.approx(1e3 * sum(tpot) / len(tpot))
    itl = [b - a for r in done for a, b in zip(r.token_times, r.token_times[1:], strict=False)]
    assert m.itl_ms.mean == pytest.approx(1e3 * sum(itl) / len(itl))
    assert m.ttft_ms.p50 == pytest.approx(1e3 * float(np.median([r.ttft for r in done])))
