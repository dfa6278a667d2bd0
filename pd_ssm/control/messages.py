"""Control messages between the router and its workers (msgpack dataclasses, see codec.py).

Two directions, two typed queues (queues.py):
- router -> worker (`TO_WORKER`): `SubmitRequest`, `AbortRequest`, `HealthCheck`, `Shutdown`.
- worker -> router (`TO_ROUTER`): `WorkerHello` (once, first), `LoadReport` (answer to every
  HealthCheck, and after every abort so freed pages show at once), `StepOutputs` (the token
  deltas of one engine step), `WorkerError`.

Ids: `req_id` is chosen by the router and unique among its live requests; `worker_id` is given to
a worker by whoever launched it.  The disaggregated path's Reserve / Ticket / Prefill classes
(disagg_messages.py) ride on the same queues; the router's dispatch is by type.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pd_ssm.control.codec import Codec
from pd_ssm.control.disagg_messages import DISAGG_TO_ROUTER, DISAGG_TO_WORKER, TicketSpec
from pd_ssm.sampling_params import SamplingParams


@dataclass(slots=True)
class SubmitRequest:
    """Admit a request: tokenized by the router, sampling params already validated."""

    TAG = "submit"
    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(slots=True)
class AbortRequest:
    """Drop a request and free its pages (client gone, timeout); unknown ids are ignored."""

    TAG = "abort"
    req_id: str


@dataclass(slots=True)
class HealthCheck:
    """A ping; the worker answers with a LoadReport carrying the same `seq`."""

    TAG = "health"
    seq: int


@dataclass(slots=True)
class Shutdown:
    """Stop the step loop, abort what runs, exit 0."""

    TAG = "shutdown"
    reason: str = ""


@dataclass(slots=True)
class WorkerHello:
    """A worker's first message: where to send it commands and what it can serve."""

    TAG = "hello"
    worker_id: str
    address: str  # the worker's command socket, e.g. "tcp://127.0.0.1:53211"
    pid: int
    model: str
    max_model_len: int  # prompt + output tokens one request may reach on this worker
    role: str = "colocated"  # "colocated" | "prefill" | "decode"


@dataclass(slots=True)
class LoadReport:
    """A worker's load and pool state. NOTE: per pool `free + used == total`; `pool_ok` says the
    worker's own check of that invariant passed."""

    TAG = "load"
    worker_id: str
    seq: int  # the HealthCheck answered; -1 when unsolicited
    running: int
    waiting: int
    free_slots: int
    used_slots: int
    free_blocks: int
    used_blocks: int
    pool_ok: bool
    steps: int = 0  # engine steps run so far
    reserved: int = 0  # decode role: requests holding a reservation whose pages have not arrived
    transfers: int = 0  # requests whose pages are on their way in or out (held by the connector side)


@dataclass(slots=True)
class TokenDelta:
    """What one engine step added to one request.

    `finish_reason` is set on the request's last delta: "stop" | "length" | "abort" | "error";
    `error` explains an "error".  Counters are totals so far, for `usage`.
    """

    TAG = "delta"
    req_id: str
    token_ids: list[int]
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class StepOutputs:
    """The deltas of one engine step, one message for the whole batch."""

    TAG = "step"
    worker_id: str
    deltas: list[TokenDelta] = field(default_factory=list)


@dataclass(slots=True)
class WorkerError:
    """Something failed on a worker. `fatal`: the worker is going away (every request on it is
    lost); otherwise only `req_id` (when given) failed."""

    TAG = "error"
    worker_id: str
    message: str
    req_id: str | None = None
    fatal: bool = False


TO_WORKER: tuple[type, ...] = (SubmitRequest, AbortRequest, HealthCheck, Shutdown, *DISAGG_TO_WORKER)
TO_ROUTER: tuple[type, ...] = (WorkerHello, LoadReport, StepOutputs, WorkerError, *DISAGG_TO_ROUTER)

# SamplingParams, TokenDelta and TicketSpec ride inside other messages
CONTROL_CODEC = Codec([*TO_WORKER, *TO_ROUTER, SamplingParams, TokenDelta, TicketSpec])
