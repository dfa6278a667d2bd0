"""SamplingParams, in vLLM's names and meanings, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

OUTPUT_KINDS = ("cumulative", "delta", "final_only")


class SamplingParamsError(ValueError):
    """An invalid sampling field; the message names the field and the allowed range."""


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # in (0, 1]
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0  # in [0, 1]
    seed: int | None = None  # per-request seed: same seed, same tokens, whatever the batch
    max_tokens: int | None = 16  # None: until the model's max length
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return per generated token
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's meaning: False returns token ids only (no text), and the engine spends no time on
    # detokenizing; a front end that has the tokenizer (the router) makes the text itself
    detokenize: bool = True
    # vLLM's RequestOutputKind: "cumulative" (every step: all tokens and text so far), "delta" (every
    # step: only what the step added, no copies), "final_only" (one output, when the request ends)
    output_kind: str = "cumulative"

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        _finite("temperature", self.temperature)
        if self.temperature < 0:
            raise SamplingParamsError(f"temperature must be >= 0, got {self.temperature}")
        _finite("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise SamplingParamsError(f"top_k must be -1, 0 (disabled) or a positive int, got {self.top_k!r}")
        if self.top_k == -1:
            self.top_k = 0
        _finite("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamsError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise SamplingParamsError(f"seed must be an int, got {self.seed!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise SamplingParamsError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise SamplingParamsError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise SamplingParamsError("stop must be non-empty strings")
        if any(t < 0 for t in self.stop_token_ids):
            raise SamplingParamsError("stop_token_ids must be >= 0")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise SamplingParamsError(f"logprobs must be an int >= 0, got {self.logprobs!r}")
        if self.output_kind not in OUTPUT_KINDS:
            raise SamplingParamsError(f"output_kind must be one of {', '.join(OUTPUT_KINDS)}, got {self.output_kind!r}")
        if self.stop and not self.detokenize:
            raise SamplingParamsError("stop strings need the text: set detokenize=True or use stop_token_ids")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}  # type: ignore[attr-defined]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        return cls(**d)


def _finite(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise SamplingParamsError(f"{name} must be a finite number, got {value!r}")
