"""Pydantic models of the OpenAI request bodies the router accepts, with vLLM's extras.

Field constraints live on the fields so that a bad value is reported under its own name (the
router turns pydantic's errors into HTTP 400 naming the field: errors.py).  Unknown fields are
ignored, as vLLM and OpenAI do.  Fields that exist in the API but that this server does not
implement are accepted only at their neutral value and refused otherwise, with a message that
says so (`unsupported()`), rather than silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pd_ssm.sampling_params import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class _GenerationRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None  # None: the one served model
    max_tokens: Annotated[int, Field(gt=0)] | None = None
    temperature: Annotated[float, Field(ge=0.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    n: Annotated[int, Field(ge=1)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    # vLLM extras
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] = 0
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False  # vLLM: also return prompt_token_ids and token_ids

    def unsupported(self) -> list[tuple[str, str]]:
        """(field, why) for every field set to something this server does not implement."""
        out = []
        if self.n != 1:
            out.append(("n", "only n=1 is supported; send n requests for n completions"))
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0.0:
                out.append((name, f"{name} is not supported; leave it at 0"))
        if self.repetition_penalty != 1.0:
            out.append(("repetition_penalty", "repetition_penalty is not supported; leave it at 1"))
        return out

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        """SamplingParams with OpenAI's defaults (temperature 1, top_p 1); may raise
        SamplingParamsError naming the field."""
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


Prompt = str | list[Annotated[int, Field(ge=0)]] | list[str] | list[list[Annotated[int, Field(ge=0)]]]


class CompletionRequest(_GenerationRequest):
    prompt: Prompt
    # OpenAI's default for /v1/completions is 16 tokens (chat's is "until the context is full")
    max_tokens: Annotated[int, Field(gt=0)] | None = 16
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = None
    best_of: int | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.echo:
            out.append(("echo", "echo is not supported"))
        if self.suffix:
            out.append(("suffix", "suffix (insertion) is not supported"))
        if self.logprobs is not None:
            out.append(("logprobs", "logprobs are not supported by this server yet"))
        if self.best_of not in (None, 1):
            out.append(("best_of", "only best_of=1 is supported"))
        return out

    def single_prompt(self) -> str | list[int]:
        """The one prompt (text or token ids); ValueError for an empty prompt or a batch."""
        p: Any = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            if len(p) != 1:
                raise ValueError(f"a batch of {len(p)} prompts is not supported; send one request per prompt")
            p = p[0]
        if len(p) == 0:
            raise ValueError("prompt is empty")
        return p


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # tool_calls, name, ...: passed on to the template

    role: Annotated[str, Field(min_length=1)]
    content: str | list[TextPart] | None = None

    def as_template_input(self) -> dict[str, Any]:
        d = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):  # content parts: the text parts, in order
            d["content"] = "".join(p.text for p in self.content)
        d.setdefault("content", "")
        return d


class ChatCompletionRequest(_GenerationRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(gt=0)] | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[Any] | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.logprobs or self.top_logprobs:
            out.append(("logprobs", "logprobs are not supported by this server yet"))
        if self.tools:
            out.append(("tools", "tool calling is not supported"))
        return out

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
