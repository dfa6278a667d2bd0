"""100 concurrent streaming requests on 1 prefill + 2 decode workers (real processes, ZMQ).

More requests than the decode workers have state slots (2 x 16): reservations are refused
(back-pressure) and retried as slots free up.  Every request must complete with exactly the
tokens of `LLM.generate` (none lost, duplicated or swapped between requests), and afterwards every
worker's pools are empty with the invariant held (read through /metrics).
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from pd_ssm import LLM, SamplingParams
from tests.orchestrator.conftest import Serve, pool_metrics, pools_empty, start_disagg
from tests.orchestrator.test_serve_openai import random_text


@pytest.fixture
def deployment(tmp_path: Path, default_model: Path) -> Iterator[Serve]:
    # 2 x 16 decode slots for 100 requests: reservations are refused and retried
    s = start_disagg(default_model, tmp_path / "serve.log", "--max-num-seqs", "16", prefill=1, decode=2)
    yield s
    s.stop()


def test_hundred_concurrent_streams_on_1p2d(deployment: Serve, default_model: Path) -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    jobs = [(random_text(rng, 3, 30), rng.randint(2, 6), rng.randrange(1 << 31)) for _ in range(100)]
    client = openai.OpenAI(base_url=deployment.url + "/v1", api_key="none", max_retries=0, timeout=50)
    model = deployment.model_name()

    def run(job: tuple[str, int, int]) -> tuple[list[int], list[str | None]]:
        prompt, n, s = job
        chunks = client.completions.create(model=model, prompt=prompt, max_tokens=n, stream=True, seed=s,
                                           temperature=1.0, extra_body={"return_token_ids": True, "ignore_eos": True})
        ids, finish = [], []
        for c in chunks:
            ids += c.choices[0].model_extra["token_ids"]
            finish.append(c.choices[0].finish_reason)
        return ids, [f for f in finish if f is not None]

    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(run, jobs))
    reference = LLM(model=str(default_model), max_num_seqs=32, num_kv_blocks=512, block_size=16)
    want = reference.generate([p for p, _, _ in jobs], [SamplingParams(max_tokens=n, seed=s, ignore_eos=True)
                                                        for _, n, s in jobs])
    for i, ((ids, finish), w) in enumerate(zip(got, want, strict=True)):
        assert ids == w.outputs[0].token_ids, f"request {i} (rng seed {seed})"
        assert finish == ["length"]
    # the last LoadReports may trail the last tokens by one health interval
    deadline = time.monotonic() + 2.0
    while not all(pools_empty(deployment, w) for w in ("p0", "d0", "d1")) and time.monotonic() < deadline:
        time.sleep(0.05)
    for w in ("p0", "d0", "d1"):
        assert pools_empty(deployment, w), f"{w}: {pool_metrics(deployment, w)}"
    metrics = deployment.get("/metrics")[1]
    # both decode workers took part, and every request's pages were received exactly once
    received = {w: float(re.search(rf'^pd_ssm_worker_transfer_bytes_total{{worker="{w}"}} (\S+)$', metrics,
                                   re.M).group(1)) for w in ("d0", "d1")}  # type: ignore[union-attr]
    assert all(v > 0 for v in received.values()), received
    m = re.search(r'^pd_ssm_transfers_total{outcome="ok",role="decode"} (\S+)$', metrics, re.M)
    assert m is not None and float(m.group(1)) == len(jobs)
    assert 'outcome="failed"' not in metrics
    refused = re.findall(r'^pd_ssm_reservations_refused_total{worker="(d\d)"} (\S+)$', metrics, re.M)
    print(f"reservations refused (back-pressure): {refused}")
    # 100 Reserves arrive at once for 32 slots: most are refused first, and still complete
    assert sum(float(v) for _, v in refused) > 0
