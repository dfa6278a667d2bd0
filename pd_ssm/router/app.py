"""The router's HTTP API (FastAPI): OpenAI completions and chat completions, models, health, metrics.

Request flow: authenticate (`--api-key`: Bearer token on /v1/*), validate (pydantic models, then
model name, unsupported fields, lengths), tokenize (PromptBuilder), dispatch to a worker
(Dispatcher), answer as one JSON body or as SSE chunks.  A client that disconnects -- mid-stream
or while waiting for a non-streamed answer -- has its request aborted on the worker at once: a
task waits for the ASGI `http.disconnect` message beside every generation.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pd_ssm.router.chat_template import ChatTemplateError
from pd_ssm.router.dispatch import Completion, Dispatcher, Submitted
from pd_ssm.router.errors import APIError, install_handlers
from pd_ssm.router.metrics import CONTENT_TYPE, RouterMetrics
from pd_ssm.router.openai_models import ChatCompletionRequest, CompletionRequest, _GenerationRequest
from pd_ssm.router.pairing import DisaggDispatcher
from pd_ssm.router.policies import make_policy
from pd_ssm.router.prompts import PromptBuilder, PromptError
from pd_ssm.router.responses import (
    DONE,
    ChatShape,
    CompletionShape,
    ResponseMeta,
    ResponseShape,
    sse,
    usage_chunk,
)
from pd_ssm.router.workers import WorkerPool
from pd_ssm.sampling_params import SamplingParams, SamplingParamsError


@dataclass(slots=True)
class RouterConfig:
    served_model_name: str
    api_key: str | None = None
    policy: str = "least_loaded"
    # disaggregated: `policy` picks the prefill worker, `decode_policy` the decode worker
    disagg: bool = False
    decode_policy: str = "least_loaded"

    def __post_init__(self) -> None:
        if not self.served_model_name:
            raise ValueError("served_model_name is empty: clients name the model they want")
        make_policy(self.policy)  # an unknown name fails here, at startup
        make_policy(self.decode_policy)


class Router:
    """Everything a request handler needs; one per app."""

    def __init__(self, config: RouterConfig, pool: WorkerPool, prompts: PromptBuilder) -> None:
        self.config = config
        self.pool = pool
        self.prompts = prompts
        self.metrics = RouterMetrics(pool)
        self.dispatcher: Dispatcher = (
            DisaggDispatcher(pool, make_policy(config.policy), self.metrics, make_policy(config.decode_policy))
            if config.disagg else Dispatcher(pool, make_policy(config.policy), self.metrics)
        )

    def check(self, body: _GenerationRequest) -> None:
        if body.model is not None and body.model != self.config.served_model_name:
            raise APIError(400, f"model: the model {body.model!r} does not exist here; this server serves "
                                f"{self.config.served_model_name!r} (GET /v1/models)", "model")
        for param, why in body.unsupported():
            raise APIError(400, f"{param}: {why}", param)

    def params(
        self, body: _GenerationRequest, prompt_ids: list[int], max_tokens: int | None, prompt_field: str
    ) -> SamplingParams:
        limit = self.pool.max_model_len()
        if limit == 0:
            raise APIError(503, "no engine worker is available right now; retry shortly (see GET /health)")
        if len(prompt_ids) >= limit:
            raise APIError(400, f"{prompt_field}: the prompt has {len(prompt_ids)} tokens; the maximum model length "
                                f"is {limit} (prompt + at least one generated token)", prompt_field)
        if max_tokens is not None and len(prompt_ids) + max_tokens > limit:
            raise APIError(400, f"max_tokens: {max_tokens} plus the prompt's {len(prompt_ids)} tokens exceed the "
                                f"maximum model length {limit}", "max_tokens")
        try:
            return body.sampling_params(max_tokens)
        except SamplingParamsError as e:  # its messages start with the field's name
            raise APIError(400, str(e), str(e).split(" ", 1)[0]) from e


async def _wait_disconnect(request: Request, on_disconnect: Callable[[], None]) -> None:
    """Call `on_disconnect` when the client goes away (the body is already read: the next ASGI
    message is the disconnect, or comes once the response is complete)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            on_disconnect()
            return


async def _collect(request: Request, router: Router, sub: Submitted) -> Completion:
    watcher = asyncio.create_task(_wait_disconnect(request, lambda: router.dispatcher.abort(sub)))
    try:
        return await router.dispatcher.collect(sub)
    finally:
        watcher.cancel()


def _stream(request: Request, router: Router, sub: Submitted, chunks: AsyncIterator[str]) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        watcher = asyncio.create_task(_wait_disconnect(request, lambda: router.dispatcher.abort(sub)))
        try:
            async for chunk in chunks:
                yield chunk
        except APIError as e:  # headers are gone: the error is an SSE event
            yield e.sse()
        finally:
            watcher.cancel()
            router.dispatcher.abort(sub)
        yield DONE

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def create_app(router: Router) -> FastAPI:
    app = FastAPI(title="pd_ssm router")
    install_handlers(app)
    name = router.config.served_model_name

    async def authenticate(request: Request) -> None:
        key = router.config.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'")

    @app.get("/v1/models", dependencies=[Depends(authenticate)])
    async def models() -> dict:
        card = {"id": name, "object": "model", "created": 0, "owned_by": "pd_ssm",
                "max_model_len": router.pool.max_model_len() or None}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> JSONResponse:
        workers = [{"id": w.worker_id, "role": w.role, "status": w.status.value, "pid": w.pid, "error": w.error,
                    "inflight": len(w.inflight)} for w in router.pool.workers.values()]
        roles = ("prefill", "decode") if router.config.disagg else (None,)
        ok = all(router.pool.in_rotation(role) for role in roles)
        return JSONResponse({"status": "ok" if ok else "unavailable", "workers": workers},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/v1/completions", dependencies=[Depends(authenticate)])
    async def completions(body: CompletionRequest, request: Request) -> Response:
        router.check(body)
        try:
            ids = router.prompts.completion_ids(body.single_prompt())
        except PromptError as e:
            raise APIError(400, str(e), e.param) from e
        except ValueError as e:
            raise APIError(400, f"prompt: {e}", "prompt") from e
        params = router.params(body, ids, body.max_tokens, "prompt")
        return await _generate(request, router, body, ids, params, CompletionShape())

    @app.post("/v1/chat/completions", dependencies=[Depends(authenticate)])
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        router.check(body)
        try:
            ids = router.prompts.chat_ids([m.as_template_input() for m in body.messages], body.add_generation_prompt)
        except ChatTemplateError as e:
            raise APIError(400, f"messages: {e}", "messages") from e
        except PromptError as e:
            raise APIError(400, str(e), e.param) from e
        params = router.params(body, ids, body.requested_max_tokens, "messages")
        return await _generate(request, router, body, ids, params, ChatShape())

    return app


async def _generate(request: Request, router: Router, body: _GenerationRequest, ids: list[int],
                    params: SamplingParams, shape: ResponseShape) -> Response:
    """Dispatch a validated request; answer with one body or an SSE stream in `shape`."""
    sub = router.dispatcher.submit(ids, params, shape.prefix)
    meta = ResponseMeta.new(sub.stream.req_id, router.config.served_model_name)
    with_ids = body.return_token_ids
    if not body.stream:
        return JSONResponse(shape.body(meta, await _collect(request, router, sub), ids, with_ids))

    async def chunks() -> AsyncIterator[str]:
        for chunk in shape.opening(meta):
            yield sse(chunk)
        first = True
        async for d in router.dispatcher.deltas(sub):
            # a delta whose text is held back (a stop string may be forming) shows only with token ids
            if d.text or d.finished or (with_ids and d.token_ids):
                for chunk in shape.chunks(meta, d, ids if first else None, with_ids):
                    yield sse(chunk)
                first = False
            if d.finished and body.include_usage:
                yield sse(usage_chunk(meta, shape.chunk_object, d.prompt_tokens, d.completion_tokens))

    return _stream(request, router, sub, chunks())
