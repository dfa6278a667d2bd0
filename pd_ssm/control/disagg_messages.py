"""Control messages of the disaggregated path (router <-> prefill and decode workers).

The request path of DESIGN.md, as messages:
- router -> decode worker D: `ReserveRequest` (hold a slot / KV blocks for a request's pages);
  D answers `ReserveReply` with a `TicketSpec`, or refuses (`ticket` None: back-pressure).
- router -> prefill worker P: `PrefillRequest` (at once, beside the Reserve: P computes while D
  answers), then `ForwardTicket` once a D accepted (P's pages may leave only after it).
- P and D -> router: `TransferReport` per request (bytes, seconds; or why it failed).  Tokens use
  the colocated `StepOutputs`: P sends the first token, D every later one.

`TicketSpec` mirrors state_transfer.base.Ticket field for field: it is carried here instead of the
Ticket itself so that the router's control plane never imports torch (the connectors' modules
do), which would delay the launch of every worker by seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pd_ssm.sampling_params import SamplingParams


@dataclass(slots=True)
class TicketSpec:
    """A decode worker's reservation, as the prefill worker's connector needs it."""

    TAG = "ticket_spec"
    req_id: str
    address: str  # D's data address for this prefill worker's connector
    slot: int
    block_ids: list[int] = field(default_factory=list)
    expiry: float = 0.0  # time.monotonic() seconds of the decode host
    token: str = ""
    # NCCL: where the prefill worker pairs with D's receiver ("" for ZMQ: no pairing)
    rendezvous: str = ""


@dataclass(slots=True)
class ReserveRequest:
    """Hold room for `req_id`'s pages on a decode worker; `prefill_id` names the sender (NCCL
    pairs one connector per prefill worker)."""

    TAG = "reserve"
    req_id: str
    prefill_id: str
    num_tokens: int  # tokens to hold KV for (prompt + what may be generated, capped by the worker)

    def __post_init__(self) -> None:
        if self.num_tokens <= 0:
            raise ValueError(f"ReserveRequest.num_tokens must be > 0, got {self.num_tokens}")


@dataclass(slots=True)
class ReserveReply:
    """D's answer: a ticket, or `ticket` None with `reason` (full: try another D or wait)."""

    TAG = "reserved"
    worker_id: str
    req_id: str
    ticket: TicketSpec | None = None
    reason: str = ""


@dataclass(slots=True)
class PrefillRequest:
    """Prefill a request, send its first token to the router, ship its pages to its ticket's D."""

    TAG = "prefill"
    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(slots=True)
class ForwardTicket:
    """The reservation a decode worker made for a request the prefill worker runs."""

    TAG = "forward_ticket"
    ticket: TicketSpec
    decode_id: str


@dataclass(slots=True)
class TransferReport:
    """One request's transfer as one side saw it.  `ok` False: it failed (`error` says why) and
    the sender / receiver has already released its part; the router ends the request."""

    TAG = "transfer"
    worker_id: str
    req_id: str
    role: str  # "prefill" (sent) | "decode" (received)
    ok: bool
    nbytes: int = 0
    seconds: float = 0.0
    error: str = ""


DISAGG_TO_WORKER: tuple[type, ...] = (ReserveRequest, PrefillRequest, ForwardTicket)
DISAGG_TO_ROUTER: tuple[type, ...] = (ReserveReply, TransferReport)
