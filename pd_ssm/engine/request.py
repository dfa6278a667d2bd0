"""A request's bookkeeping: its tokens, how many are in the cache, how it ends.

The cache holds the state after `num_computed_tokens` tokens; the tokens still to be fed are
`all_token_ids[num_computed_tokens:]`.  More than one pending token means the request is in its
prefill phase (prompt, or prompt + outputs again after a preemption); exactly one means decode.
When a step brings `num_computed_tokens` up to `num_tokens`, a new token is sampled.

With async scheduling (engine/inflight.py) a decode step may be launched before the token it feeds
has reached the host: `num_inflight` counts the request's sampled tokens still on the device.  They
count in `num_tokens` and `sample_offset` (the cache and the sampler are past them) but are not in
`output_token_ids` until the engine reads them.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pd_ssm.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class Request:
    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # resolved: a random one when the client gave none, so sampling state can move
    max_tokens: int  # resolved against the model length
    prompt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    output_text: str = ""
    num_preemptions: int = 0
    num_inflight: int = 0  # sampled on the device, not yet in output_token_ids (0 or 1)
    arrival_time: float = field(default_factory=time.monotonic)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_inflight

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_pending_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        return self.num_pending_tokens == 1

    @property
    def sample_offset(self) -> int:
        """How many tokens this request has sampled: with `seed`, the whole sampler state."""
        return len(self.output_token_ids) + self.num_inflight

    @property
    def last_token_in_flight(self) -> bool:
        """Its max_tokens-th token is sampled and not yet read: it needs no further step."""
        return self.num_inflight > 0 and self.sample_offset >= self.max_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def pending_token_ids(self, n: int) -> list[int]:
        """The next `n` tokens to feed; a token still in flight reads -1 (the runner feeds it on the device)."""
        start = self.num_computed_tokens
        if len(self.output_token_ids) == 0 and not self.num_inflight or start + n <= len(self.prompt_token_ids):
            return self.prompt_token_ids[start : start + n]
        known = self.all_token_ids[start : start + n]
        return known + [-1] * (n - len(known))

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
