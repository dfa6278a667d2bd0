"""OpenAI response bodies and SSE chunks for completions and chat completions (pure functions).

Shapes follow the OpenAI API as vLLM serves it: `id`, `object`, `created` (unix seconds),
`model`, `choices` (one, index 0), `usage`; vLLM's `stop_reason` (the stop string or token id
that ended the request, else null) on every finished choice, and with `return_token_ids` the
choice's `token_ids` (and `prompt_token_ids` on the first chunk / the whole response).  A stream
is `data: <json>\\n\\n` events ending with `data: [DONE]`; with stream_options.include_usage a last
chunk carries `usage` and no choices.
"""

from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from pd_ssm.control.messages import TokenDelta
from pd_ssm.router.dispatch import Completion

DONE = "data: [DONE]\n\n"


@dataclass(slots=True)
class ResponseMeta:
    id: str
    model: str
    created: int

    @classmethod
    def new(cls, req_id: str, model: str) -> ResponseMeta:
        return cls(req_id, model, int(time.time()))


def sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _token_ids(choice: dict[str, Any], token_ids: list[int] | None, prompt_ids: list[int] | None) -> dict[str, Any]:
    if token_ids is not None:
        choice["token_ids"] = token_ids
    if prompt_ids is not None:
        choice["prompt_token_ids"] = prompt_ids
    return choice


# --- /v1/completions ---------------------------------------------------------------------------
def completion_body(meta: ResponseMeta, done: Completion, prompt_ids: list[int] | None,
                    with_ids: bool) -> dict[str, Any]:
    choice = {"index": 0, "text": done.text, "logprobs": None, "finish_reason": done.finish_reason,
              "stop_reason": done.stop_reason}
    return {
        "id": meta.id, "object": "text_completion", "created": meta.created, "model": meta.model,
        "choices": [_token_ids(choice, done.token_ids if with_ids else None, prompt_ids if with_ids else None)],
        "usage": usage(done.prompt_tokens, done.completion_tokens),
    }


def completion_chunk(meta: ResponseMeta, text: str, *, finish_reason: str | None = None,
                     stop_reason: int | str | None = None, token_ids: list[int] | None = None,
                     prompt_ids: list[int] | None = None) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason, "stop_reason": stop_reason}
    return {"id": meta.id, "object": "text_completion", "created": meta.created, "model": meta.model,
            "choices": [_token_ids(choice, token_ids, prompt_ids)]}


# --- /v1/chat/completions ----------------------------------------------------------------------
def chat_body(meta: ResponseMeta, done: Completion, prompt_ids: list[int] | None, with_ids: bool) -> dict[str, Any]:
    choice = {"index": 0, "message": {"role": "assistant", "content": done.text}, "logprobs": None,
              "finish_reason": done.finish_reason, "stop_reason": done.stop_reason}
    body = {
        "id": meta.id, "object": "chat.completion", "created": meta.created, "model": meta.model,
        "choices": [_token_ids(choice, done.token_ids if with_ids else None, None)],
        "usage": usage(done.prompt_tokens, done.completion_tokens),
    }
    if with_ids:
        body["prompt_token_ids"] = prompt_ids
    return body


def chat_chunk(meta: ResponseMeta, delta: dict[str, Any], *, finish_reason: str | None = None,
               stop_reason: int | str | None = None, token_ids: list[int] | None = None) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason,
              "stop_reason": stop_reason}
    return {"id": meta.id, "object": "chat.completion.chunk", "created": meta.created, "model": meta.model,
            "choices": [_token_ids(choice, token_ids, None)]}


def usage_chunk(meta: ResponseMeta, obj: str, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"id": meta.id, "object": obj, "created": meta.created, "model": meta.model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}


class ResponseShape(ABC):
    """How one endpoint answers: its id prefix, its whole-body and chunk shapes."""

    prefix: str  # of response ids: "cmpl" / "chatcmpl"
    chunk_object: str

    @abstractmethod
    def body(self, meta: ResponseMeta, done: Completion, prompt_ids: list[int], with_ids: bool) -> dict[str, Any]:
        """The non-streamed response."""

    @abstractmethod
    def chunks(self, meta: ResponseMeta, delta: TokenDelta, prompt_ids: list[int] | None,
               with_ids: bool) -> list[dict[str, Any]]:
        """The SSE chunks for one delta; `prompt_ids` is given with the first delta only."""

    def opening(self, meta: ResponseMeta) -> list[dict[str, Any]]:
        """Chunks sent before the first delta."""
        return []


class CompletionShape(ResponseShape):
    prefix, chunk_object = "cmpl", "text_completion"

    def body(self, meta: ResponseMeta, done: Completion, prompt_ids: list[int], with_ids: bool) -> dict[str, Any]:
        return completion_body(meta, done, prompt_ids, with_ids)

    def chunks(self, meta: ResponseMeta, delta: TokenDelta, prompt_ids: list[int] | None,
               with_ids: bool) -> list[dict[str, Any]]:
        return [completion_chunk(meta, delta.text, finish_reason=delta.finish_reason, stop_reason=delta.stop_reason,
                                 token_ids=delta.token_ids if with_ids else None,
                                 prompt_ids=prompt_ids if with_ids else None)]


class ChatShape(ResponseShape):
    prefix, chunk_object = "chatcmpl", "chat.completion.chunk"

    def body(self, meta: ResponseMeta, done: Completion, prompt_ids: list[int], with_ids: bool) -> dict[str, Any]:
        return chat_body(meta, done, prompt_ids, with_ids)

    def chunks(self, meta: ResponseMeta, delta: TokenDelta, prompt_ids: list[int] | None,
               with_ids: bool) -> list[dict[str, Any]]:
        content = {"content": delta.text} if delta.text else {}
        return [chat_chunk(meta, content, finish_reason=delta.finish_reason, stop_reason=delta.stop_reason,
                           token_ids=delta.token_ids if with_ids else None)]

    def opening(self, meta: ResponseMeta) -> list[dict[str, Any]]:
        return [chat_chunk(meta, {"role": "assistant", "content": ""})]
