"""The requests of a serving benchmark (`pd-ssm bench serve`): random token-id prompts, lengths and
send times, all from one seed.

Prompts are token ids, not text, so a request's input length is exact on any server and tokenizer
(the OpenAI completions API takes a list of ids; so do vLLM and SGLang). Ids are drawn from
[token_low, token_high): the default [0, 256) is inside every vocabulary. Arrivals are a Poisson
process at `request_rate` requests a second (exponential gaps), or all at once when it is infinite,
as vLLM's benchmark_serving does.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    num_prompts: int = 100
    input_len: int = 256  # prompt tokens (the centre of the range)
    output_len: int = 64  # tokens to generate (max_tokens, with ignore_eos)
    range_ratio: float = 0.0  # lengths uniform in [len * (1 - r), len * (1 + r)]
    request_rate: float = math.inf  # requests a second; inf: every request at time 0
    seed: int = 0
    token_low: int = 0
    token_high: int = 256

    def __post_init__(self) -> None:
        if self.num_prompts < 1 or self.input_len < 1 or self.output_len < 1:
            raise ValueError(f"num_prompts, input_len and output_len must be >= 1, got {self.num_prompts}, "
                             f"{self.input_len}, {self.output_len}")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"range_ratio must be in [0, 1), got {self.range_ratio}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (inf: all at once), got {self.request_rate}")
        if not 0 <= self.token_low < self.token_high:
            raise ValueError(f"token ids must come from a non-empty range, got [{self.token_low}, {self.token_high})")


@dataclass(frozen=True, slots=True)
class BenchRequest:
    index: int
    prompt: list[int]  # token ids
    max_tokens: int
    send_at: float  # seconds after the benchmark's start


def _length(rng: random.Random, centre: int, ratio: float) -> int:
    lo, hi = max(1, round(centre * (1 - ratio))), max(1, round(centre * (1 + ratio)))
    return rng.randint(lo, hi)


def make_workload(spec: WorkloadSpec) -> list[BenchRequest]:
    """spec.num_prompts requests, in sending order; the same spec gives the same requests."""
    rng = random.Random(spec.seed)
    out: list[BenchRequest] = []
    t = 0.0
    for i in range(spec.num_prompts):
        n_in = _length(rng, spec.input_len, spec.range_ratio)
        prompt = [rng.randrange(spec.token_low, spec.token_high) for _ in range(n_in)]
        out.append(BenchRequest(i, prompt, _length(rng, spec.output_len, spec.range_ratio), t))
        if math.isfinite(spec.request_rate):
            t += rng.expovariate(spec.request_rate)
    return out
