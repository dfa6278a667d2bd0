"""Prometheus metrics of the router (GET /metrics), in one registry per router (no globals).

Request latencies are histograms the router observes itself (seconds, from the moment it sent
the request to a worker): time to first token, time per output token after the first, end to
end.  Per-worker figures are read at scrape time from the WorkerPool (a custom collector), so a
worker that left shows its last report with `pd_ssm_worker_healthy 0` rather than a stale gauge.
Page gauges: state slots (one per running request, all SSM layers) and KV blocks (attention
layers); NOTE free + used == total for each, and `pd_ssm_pool_invariant_ok` is the worker's check.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from pd_ssm.router.workers import WorkerPool, WorkerStatus

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_BYTES_BUCKETS = tuple(float(1 << k) for k in range(10, 34, 2))  # 1 KiB .. 8 GiB
_TOKEN_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class _WorkerCollector(Collector):
    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[GaugeMetricFamily]:
        specs = [
            ("pd_ssm_worker_healthy", "1 when the worker is in rotation", None),
            ("pd_ssm_num_requests_running", "requests in the worker's running batch", "running"),
            ("pd_ssm_num_requests_waiting", "requests queued on the worker", "waiting"),
            ("pd_ssm_state_slots_used", "state slots (SSM pages) held by requests", "used_slots"),
            ("pd_ssm_state_slots_free", "state slots free", "free_slots"),
            ("pd_ssm_kv_blocks_used", "KV blocks (attention pages) held by requests", "used_blocks"),
            ("pd_ssm_kv_blocks_free", "KV blocks free", "free_blocks"),
            ("pd_ssm_pool_invariant_ok", "1 when free + used == total held on the worker's pools", "pool_ok"),
            ("pd_ssm_worker_inflight", "requests the router has sent to the worker and not seen finish", None),
            ("pd_ssm_state_slots_reserved", "decode role: slots reserved for pages still on their way", "reserved"),
            ("pd_ssm_transfers_in_flight", "requests whose state pages are on their way in or out", "transfers"),
        ]
        families = {name: GaugeMetricFamily(name, doc, labels=["worker"]) for name, doc, _ in specs}
        info = GaugeMetricFamily("pd_ssm_worker_info", "1 per worker, labelled with its role", labels=["worker", "role"])
        for w in list(self.pool.workers.values()):
            info.add_metric([w.worker_id, w.role or "unknown"], 1.0)
            families["pd_ssm_worker_healthy"].add_metric([w.worker_id], float(w.status is WorkerStatus.HEALTHY))
            families["pd_ssm_worker_inflight"].add_metric([w.worker_id], float(len(w.inflight)))
            if w.load is None:
                continue
            for name, _, attr in specs:
                if attr is not None:
                    families[name].add_metric([w.worker_id], float(getattr(w.load, attr)))
        yield from families.values()
        yield info


class RouterMetrics:
    def __init__(self, pool: WorkerPool) -> None:
        self.registry = CollectorRegistry()
        self.ttft = Histogram("pd_ssm_time_to_first_token_seconds", "time to first token",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("pd_ssm_time_per_output_token_seconds", "time per output token after the first",
                              buckets=_TOKEN_BUCKETS, registry=self.registry)
        self.e2e = Histogram("pd_ssm_e2e_request_latency_seconds", "end-to-end request latency",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.requests = Counter("pd_ssm_requests", "finished requests by finish reason", ["finish_reason"],
                                registry=self.registry)
        self.prompt_tokens = Counter("pd_ssm_prompt_tokens", "prompt tokens processed", registry=self.registry)
        self.generation_tokens = Counter("pd_ssm_generation_tokens", "tokens generated", registry=self.registry)
        # disaggregated: one observation per request and side (the prefill side times its send,
        # the decode side its receive: clocks of two processes never mix)
        self.transfer_bytes = Histogram("pd_ssm_transfer_bytes", "state pages moved per request",
                                        ["role"], buckets=_BYTES_BUCKETS, registry=self.registry)
        self.transfer_seconds = Histogram("pd_ssm_transfer_seconds", "state transfer time per request",
                                          ["role"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.transfers = Counter("pd_ssm_transfers", "state transfers by side and outcome", ["role", "outcome"],
                                 registry=self.registry)
        self.reservations_refused = Counter("pd_ssm_reservations_refused", "Reserves a decode worker refused (full)",
                                            ["worker"], registry=self.registry)
        self.worker_transfer_bytes = Counter("pd_ssm_worker_transfer_bytes", "state page bytes a worker sent or received",
                                             ["worker"], registry=self.registry)
        self.registry.register(_WorkerCollector(pool))

    def observe_finished(self, *, ttft: float | None, e2e: float, prompt_tokens: int, completion_tokens: int,
                         finish_reason: str) -> None:
        self.requests.labels(finish_reason).inc()
        self.e2e.observe(e2e)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        if ttft is not None:
            self.ttft.observe(ttft)
            if completion_tokens > 1:
                self.tpot.observe((e2e - ttft) / (completion_tokens - 1))

    def observe_transfer(self, worker_id: str, role: str, nbytes: int, seconds: float) -> None:
        self.transfers.labels(role, "ok").inc()
        self.transfer_bytes.labels(role).observe(nbytes)
        self.transfer_seconds.labels(role).observe(seconds)
        self.worker_transfer_bytes.labels(worker_id).inc(nbytes)

    def render(self) -> bytes:
        return generate_latest(self.registry)
