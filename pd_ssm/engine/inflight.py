"""Async scheduling: the next decode step is launched before this one's tokens reach the host.

vLLM's async scheduling and SGLang's overlap scheduler do the same: while the GPU runs step N+1,
the host reads step N's tokens, detokenizes, applies the stop rules and builds the outputs, so the
host's share of a step hides behind the device's instead of adding to it.

How it stays exact:
- Only decode-only steps are launched ahead, and only when nothing else could change the batch:
  no waiting or prefilling request and KV blocks for every row without preemption
  (`launch_ahead_ok`).  A request whose max_tokens-th token is in step N gets no row in step N+1
  (`Request.last_token_in_flight`).
- A request's token from step N is fed to step N+1 on the device (`TokenFeed`: a copy into the
  step's input ids), and counts in `Request.num_inflight` until the host reads it; the sampler's
  offset counts it too, so seeded sampling draws the same numbers as without the overlap.
- A request that step N finishes (EOS, stop string) already has a row in step N+1: that row's token
  is dropped, and its slot and blocks are released only once step N+1 is read, because step N+1
  still writes them (a freed slot may be handed to a transfer that writes it on another stream).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from pd_ssm.cache.manager import CacheManager
from pd_ssm.engine.device_sample import DeviceSample
from pd_ssm.engine.host_copy import host_values
from pd_ssm.engine.request import Request
from pd_ssm.engine.scheduler import Scheduler


class InflightStep:
    """A launched step whose sampled tokens the host has not read yet."""

    def __init__(self, reqs: list[Request], sample: DeviceSample) -> None:
        if len(reqs) != len(sample):
            raise ValueError(f"{len(reqs)} requests for {len(sample)} sampled rows")
        self.reqs = reqs  # row i sampled sample.tokens[i]
        self.sample = sample.start_copy()
        self._rows = {r.req_id: i for i, r in enumerate(reqs)}

    def row(self, req_id: str) -> int:
        return self._rows[req_id]


class TokenFeed(NamedTuple):
    """Rows of a step whose input token is still on the device: input row `dst[i]` takes
    `tokens[src[i]]`, the in-flight step's token of that request."""

    dst: list[int]
    src: list[int]
    tokens: Tensor  # [N] int64, the in-flight step's sampled tokens

    def apply(self, ids: Tensor) -> None:
        """Write the fed tokens into `ids` ([P] int64 on the tokens' device), queued on the stream."""
        n = len(self.dst)
        if self.dst == self.src == list(range(n)):  # the same requests in the same order: one copy
            ids[:n].copy_(self.tokens[:n])
            return
        dev = self.tokens.device
        src = host_values(self.src, torch.int64, dev)
        ids.index_copy_(0, host_values(self.dst, torch.int64, dev), self.tokens.index_select(0, src))


def token_feed(decodes: list[Request], inflight: InflightStep | None) -> TokenFeed | None:
    """The feed of a decode batch (rows in `decodes` order), or None when every token is on the host."""
    dst = [i for i, r in enumerate(decodes) if r.num_inflight]
    if not dst:
        return None
    if inflight is None:
        raise RuntimeError("a request has a token in flight but no step is in flight")
    return TokenFeed(dst, [inflight.row(decodes[i].req_id) for i in dst], inflight.sample.tokens)


def launch_ahead_ok(scheduler: Scheduler, cache: CacheManager, max_model_len: int) -> bool:
    """Whether the next step can be scheduled before the in-flight step is read (module docstring)."""
    if scheduler.num_waiting or scheduler.prefill is not None and scheduler.prefill.prefilling:
        return False
    if scheduler.decode is None:
        return False
    blocks = 0
    for req in scheduler.decode.running:
        # finished: released once the step that still writes it is read; the last token in
        # flight: the scheduler leaves it out, it finishes when read
        if req.finished or req.last_token_in_flight:
            continue
        if req.num_inflight and req.num_tokens >= max_model_len:
            return False  # at the model length with its token in flight (max_tokens set elsewhere)
        blocks += cache.blocks_to_grow(req.req_id, req.num_tokens)
    return blocks <= cache.num_free_blocks
