"""`pd-ssm bench serve`: a workload (workload.py) sent to a running OpenAI-compatible server, each
request streamed and timed (client.py), the figures summarized (metrics.py). With `launch`, the
benchmark starts the deployments itself (deploy.py: colocated, disaggregated, or both one after
the other with the same workload and engine flags) and compares them.

Requests are sent at their workload times, each on its own connection, at most `max_concurrency`
in flight (the rest wait for a slot, as clients behind a connection pool would). The server may be
pd-ssm's router (`pd-ssm serve`, colocated or `--disagg`) or vLLM's or SGLang's: only the OpenAI
API is used. The model name comes from the server's /v1/models where not given.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from pd_ssm.bench.client import RequestResult, Target, run_request
from pd_ssm.bench.deploy import launch
from pd_ssm.bench.metrics import ServingMetrics, format_comparison, format_table, summarize
from pd_ssm.bench.workload import BenchRequest, WorkloadSpec, make_workload


@dataclass(slots=True)
class ServeBenchOptions:
    base_url: str
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    model: str | None = None  # None: the first model the server lists
    api_key: str | None = None
    max_concurrency: int | None = None  # None: no cap
    return_token_ids: bool = True  # False for servers without vLLM's extra: tokens counted from usage
    warmup_requests: int = 1  # untimed short requests first, one after the other: the server answers at all

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.warmup_requests < 0:
            raise ValueError(f"warmup_requests must be >= 0, got {self.warmup_requests}")


def served_model(base_url: str, api_key: str | None, timeout: float = 10.0) -> str:
    """The first model id of the server's /v1/models."""
    req = urllib.request.Request(base_url.rstrip("/") + "/v1/models",
                                 headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        data = json.loads(r.read())["data"]
    if not data:
        raise ValueError(f"{base_url} serves no model")
    return str(data[0]["id"])


async def _run(opts: ServeBenchOptions, requests: list[BenchRequest], target: Target,
               on_result: Callable[[RequestResult], None] | None) -> tuple[list[RequestResult], float]:
    slots = asyncio.Semaphore(opts.max_concurrency or len(requests))
    t0 = time.perf_counter()

    async def one(i: int) -> RequestResult:
        req = requests[i]
        await asyncio.sleep(max(0.0, t0 + req.send_at - time.perf_counter()))
        async with slots:
            res = await run_request(target, req)
        if on_result is not None:
            on_result(res)
        return res

    results = await asyncio.gather(*(one(i) for i in range(len(requests))))
    return list(results), time.perf_counter() - t0


def run_serve_bench(opts: ServeBenchOptions, on_result: Callable[[RequestResult], None] | None = None
                    ) -> tuple[ServingMetrics, dict[str, Any]]:
    """Run the workload against the server; (the figures, everything as JSON-ready data)."""
    Target(opts.base_url, "").address()  # a bad URL fails here, before the server is asked anything
    model = opts.model or served_model(opts.base_url, opts.api_key)
    target = Target(opts.base_url, model, opts.api_key, opts.return_token_ids)
    requests = make_workload(opts.workload)
    for _ in range(opts.warmup_requests):
        warm = asyncio.run(run_request(target, BenchRequest(-1, requests[0].prompt[:16], 2, 0.0)))
        if not warm.ok:
            raise RuntimeError(f"the warm-up request to {opts.base_url} failed: {warm.error}")
    results, duration = asyncio.run(_run(opts, requests, target, on_result))
    metrics = summarize(results, duration)
    errors = sorted({r.error for r in results if not r.ok})
    data = {"base_url": opts.base_url, "model": model, "workload": asdict(opts.workload),
            "max_concurrency": opts.max_concurrency, "metrics": metrics.as_dict(), "errors": errors[:20],
            "requests": [asdict(r) for r in results]}
    return metrics, data


def _progress(n: int, label: str) -> Callable[[RequestResult], None]:
    done = 0

    def progress(r: RequestResult) -> None:
        nonlocal done
        done += 1
        if done == n or done % max(1, n // 10) == 0 or not r.ok:
            print(f"[bench{label}] {done}/{n} requests" + ("" if r.ok else f" (request {r.index} failed: {r.error})"),
                  file=sys.stderr, flush=True)

    return progress


def _report(opts: ServeBenchOptions, metrics: ServingMetrics, data: dict[str, Any], label: str) -> None:
    w = opts.workload
    print(format_table(metrics, f"pd-ssm bench serve{label}: {data['model']} at {opts.base_url}, {w.num_prompts} "
                                f"prompts of ~{w.input_len} tokens -> ~{w.output_len}, rate {w.request_rate} req/s"))
    if data["errors"]:
        print("errors: " + "; ".join(data["errors"][:5]))


def main_serve(opts: ServeBenchOptions, json_path: str | None, launch_kinds: list[str] | None = None,
               serve_args: list[str] | None = None, launch_timeout: float = 120.0) -> int:
    """The CLI's `bench serve`: progress on stderr, the tables on stdout, JSON on request; 1 if any
    request failed. With `launch_kinds`, each deployment is started (with `serve_args`), benchmarked
    and stopped in turn (each healthy within `launch_timeout` s), and opts.base_url is ignored."""
    runs: list[tuple[str, ServingMetrics, dict[str, Any]]] = []
    for kind in launch_kinds or [""]:
        label = f" [{kind}]" if kind else ""
        if kind:
            print(f"[bench{label}] starting the deployment", file=sys.stderr, flush=True)
            server = launch(kind, serve_args or [], launch_timeout)
            print(f"[bench{label}] serving at {server.url} (its log: {server.log})", file=sys.stderr, flush=True)
            run_opts = replace(opts, base_url=server.url)
        else:
            server, run_opts = None, opts
        try:
            metrics, data = run_serve_bench(run_opts, _progress(opts.workload.num_prompts, label))
        finally:
            if server is not None:
                server.stop()
        _report(run_opts, metrics, data, label)
        runs.append((kind, metrics, {**data, "deployment": kind or None}))
    if len(runs) > 1:
        print(format_comparison([(kind, m) for kind, m, _ in runs]))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(runs[0][2] if len(runs) == 1 else {"runs": [d for _, _, d in runs]}, f, indent=1, default=str)
    return 0 if all(m.failed == 0 for _, m, _ in runs) else 1
