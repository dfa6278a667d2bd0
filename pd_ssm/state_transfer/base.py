"""The Connector contract: how a request's StatePages get from a prefill worker to a decode worker.

The decode side reserves first (a state slot, KV blocks) and answers with a `Ticket`; the prefill
side then `send`s the request's pages to exactly that place. Method names follow vLLM's KV
connector where the meaning is the same. Implementations: zmq_connector.py (host staging, multipart
frames of wire.py) and nccl_connector.py (GPU p2p with a ZMQ side channel).

Layer-wise streaming: a `StreamingConnector` also takes a request's pages in pieces
(`send_layers`, as the prefill forward finishes each layer), one ticket for all of them, then the
usual `send` as the last call. A connector without it gets the whole request in one `send`.
"""

from __future__ import annotations

import hmac
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from types import TracebackType
from typing import Any, Self

from pd_ssm.cache.pages import LayerPages, StatePages


@dataclass(slots=True)
class Ticket:
    """The decode side's reservation for one request, forwarded to the prefill side by the router.

    `token` is the cluster token (or a digest of it; both sides compare the same form) that
    authenticates the sender; `expiry` is in `time.monotonic()` seconds *of the decode host*:
    the decode side releases the reservation after it, whatever the sender believes.
    """

    req_id: str
    address: str  # the decode worker's data address, e.g. "tcp://10.0.0.2:5601"
    slot: int  # destination state slot
    block_ids: list[int] = field(default_factory=list)  # destination KV blocks, in order
    expiry: float = 0.0  # time.monotonic() seconds
    token: str = ""

    def remaining(self, now: float | None = None) -> float:
        """Seconds left before the reservation lapses (negative once expired)."""
        return self.expiry - (time.monotonic() if now is None else now)

    def expired(self, now: float | None = None) -> bool:
        return self.remaining(now) <= 0.0

    def token_matches(self, token: str) -> bool:
        """Constant-time comparison with a peer's token."""
        return hmac.compare_digest(self.token.encode(), token.encode())


@dataclass(slots=True)
class TransferStats:
    """One request's transfer: bytes moved and wall time from first frame out to last frame checked."""

    req_id: str
    nbytes: int
    seconds: float

    def __post_init__(self) -> None:
        if self.nbytes < 0 or self.seconds < 0:
            raise ValueError(f"transfer stats of {self.req_id!r}: negative bytes or seconds")

    @property
    def gbps(self) -> float:
        """GB/s with GB = 1e9 bytes (bytes, not bits); inf for a non-empty transfer timed at 0 s."""
        if self.seconds == 0.0:
            return 0.0 if self.nbytes == 0 else float("inf")
        return self.nbytes / self.seconds / 1e9


class FailureKind(Enum):
    """How a transfer ended without its pages, which says who reports it."""

    # a check failed, the peer died or went silent, the reservation expired: whoever sees it reports it
    ERROR = "error"
    # the sender aborted the request (it finished at its first token, or failed there): the sender
    # reports that itself, so a second report from the receiver would only race it
    SENDER_ABORTED = "sender_aborted"


@dataclass(frozen=True, slots=True)
class TransferFailure:
    """One failed transfer, as `Connector.get_failures` reports it."""

    reason: str
    kind: FailureKind = FailureKind.ERROR


class Connector(ABC):
    """Moves StatePages between one process and its peers. Thread-safety is per implementation.

    Contract:
    - Every page that arrives is checked (wire.py checksums, shapes, dtypes, exactly-once) before
      the request is reported complete; a request is complete only when all its layers arrived.
    - Every request ends in exactly one of: sent/received (`get_finished`), failed
      (`get_failures` / `get_failed`), or aborted (`abort`); in every case the connector holds
      none of its buffers afterwards, and the caller releases its slot / blocks. On the receiving
      side the sender's abort ends a request as a failure of kind `FailureKind.SENDER_ABORTED`
      (the reservation is released; the sender reports its own abort), any other failure as
      `FailureKind.ERROR`.
    - Nothing received is ever unpickled.
    """

    @abstractmethod
    def send(self, pages: StatePages, ticket: Ticket) -> None:
        """Start sending `pages` to the place `ticket` reserved; returns without waiting.

        The last (or only) call for a request: it carries the RequestState (with the first
        token). After `send_layers` calls (StreamingConnector), `pages.layers` holds only the
        layers not streamed yet, possibly none. Raises ValueError if the ticket has expired or
        does not name this request. Completion is reported by `get_finished()[0]`.
        """

    @abstractmethod
    def recv(self, timeout: float | None = None) -> StatePages | None:
        """Return the next request whose pages have all arrived and checked out.

        Blocks up to `timeout` seconds (None: forever, 0: don't block); None if nothing is
        complete by then. A request that fails a check is reported by `get_failed`, never here.
        """

    def poll(self) -> StatePages | None:
        """`recv` without blocking."""
        return self.recv(timeout=0.0)

    @abstractmethod
    def get_finished(self) -> tuple[set[str], set[str]]:
        """(request ids whose send completed, request ids whose receive completed) since the last call."""

    @abstractmethod
    def get_failed(self) -> dict[str, str]:
        """Request ids whose transfer failed since the last call (bad frame, peer died, expiry,
        wrong token, the sender's abort), each with a reason; the caller releases their pages.
        `get_failures` without the kinds: a failure is handed out once, by either call."""

    def get_failures(self) -> dict[str, TransferFailure]:
        """`get_failed` with each failure's kind, so a caller can tell the sender's abort (which
        the sender reports) from a failure it must report. This default knows no kinds (all
        ERROR); connectors that receive override it."""
        return {req_id: TransferFailure(why) for req_id, why in self.get_failed().items()}

    @abstractmethod
    def abort(self, req_id: str) -> None:
        """Stop the transfer of `req_id` in either direction, drop its buffers and tell the peer.

        Idempotent; unknown ids are ignored (the request may have finished meanwhile).
        """

    @abstractmethod
    def close(self) -> None:
        """Abort everything in flight and release sockets / process groups. Idempotent."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class StreamingConnector(Connector):
    """A connector that also takes one request's pages in pieces (layer-wise streaming)."""

    @property
    def streams(self) -> bool:
        """Whether the prefill side should hand this connector each layer as it finishes (True),
        or whole requests after the forward; a connector may stream only when configured to."""
        return True

    @property
    def device_pages(self) -> bool:
        """Whether `send_layers` takes device tensors with a `ready` event (a connector that sends
        from GPU memory: the pages need never go through the host, and its own stream waits for
        them). False: host tensors, complete when handed over."""
        return False

    @abstractmethod
    def send_layers(self, ticket: Ticket, layers: Sequence[LayerPages], ready: Any = None, last: bool = False) -> None:
        """Start sending some layers of `ticket.req_id` ahead of its final `send`; returns at once.
        `ready`: `device_pages` only, the device event the layers are complete after. `last`: no
        more layers of the request follow (a connector that holds layers to send them together
        sends what it holds now).

        Every layer goes out exactly once over all calls (the receiver rejects a duplicate);
        the receiver holds the pieces and reports the request only after the final `send` and
        the checks of every layer. Raises ValueError on an expired ticket.
        """
