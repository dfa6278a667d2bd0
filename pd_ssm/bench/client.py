"""One streamed completion against an OpenAI-compatible server, timed token by token.

A plain HTTP/1.1 POST over an asyncio connection, framed by h11 (uvicorn's own HTTP library, so
no client dependency is added), reading the server-sent events as they arrive: the time of the
first token (TTFT) and of every later one are taken when their event is read. Tokens are counted
from each event's `token_ids` where the server returns them (`return_token_ids`, a vLLM extra that
pd-ssm's router speaks), else from the final `usage` (`stream_options.include_usage`); a text delta
that the server holds back (a stop string may be forming) is then still counted. One connection a
request, as a benchmark of many concurrent clients wants.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import h11

from pd_ssm.bench.workload import BenchRequest


@dataclass(slots=True)
class RequestResult:
    index: int
    prompt_tokens: int
    ok: bool = False
    error: str = ""
    output_tokens: int = 0
    start: float = 0.0  # perf_counter seconds when the request was sent
    ttft: float = 0.0  # seconds to the first token
    latency: float = 0.0  # seconds to the last event
    token_times: list[float] = field(default_factory=list)  # seconds after `start`, one per event with tokens


@dataclass(frozen=True, slots=True)
class Target:
    """Where and what to ask: the server's base URL (http://host:port), its model name, its key."""

    base_url: str
    model: str
    api_key: str | None = None
    return_token_ids: bool = True
    timeout: float = 600.0  # seconds a request may take in all

    def address(self) -> tuple[str, int, str]:
        u = urlsplit(self.base_url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"base URL must be http://host:port[/prefix], got {self.base_url!r}")
        return u.hostname, u.port or 80, u.path.rstrip("/")


def _body(target: Target, req: BenchRequest) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": target.model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0.0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }
    if target.return_token_ids:
        body["return_token_ids"] = True
    return body


async def run_request(target: Target, req: BenchRequest) -> RequestResult:
    """Send `req` as a streamed /v1/completions and time its tokens; errors are recorded, not raised."""
    res = RequestResult(req.index, len(req.prompt))
    res.start = time.perf_counter()
    try:
        await asyncio.wait_for(_stream(target, req, res), target.timeout)
        res.ok = res.output_tokens > 0 and not res.error
        if res.ok and not res.token_times:
            res.ok, res.error = False, "no token events"
    except (OSError, ValueError, h11.ProtocolError, asyncio.TimeoutError) as e:
        res.error = res.error or f"{type(e).__name__}: {e}"
    return res


async def _stream(target: Target, req: BenchRequest, res: RequestResult) -> None:
    host, port, prefix = target.address()
    payload = json.dumps(_body(target, req)).encode()
    headers = [("Host", f"{host}:{port}"), ("Content-Type", "application/json"), ("Accept", "text/event-stream"),
               ("Content-Length", str(len(payload))), ("Connection", "close")]
    if target.api_key:
        headers.append(("Authorization", f"Bearer {target.api_key}"))
    reader, writer = await asyncio.open_connection(host, port)
    conn = h11.Connection(h11.CLIENT)
    try:
        writer.write(conn.send(h11.Request(method="POST", target=f"{prefix}/v1/completions", headers=headers))
                     + conn.send(h11.Data(data=payload)) + conn.send(h11.EndOfMessage()))
        await writer.drain()
        buf = b""
        status = 0
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await reader.read(65536))
                continue
            if isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                buf += bytes(event.data)
                if status != 200:
                    continue
                *events, buf = buf.split(b"\n\n")
                for raw in events:
                    _on_event(raw, res)
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                break
        if status != 200:
            res.error = f"HTTP {status}: {buf.decode(errors='replace')[:300]}"
    finally:
        writer.close()


def _on_event(raw: bytes, res: RequestResult) -> None:
    """One server-sent event: its tokens' arrival, the final usage, or an error."""
    now = time.perf_counter() - res.start
    for line in raw.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            res.latency = now
            continue
        msg = json.loads(data)
        if "error" in msg:
            res.error = str(msg["error"].get("message", msg["error"]))[:300]
            continue
        usage = msg.get("usage")
        if usage and not msg.get("choices"):  # the usage chunk: the count the server reports
            res.output_tokens = int(usage.get("completion_tokens", res.output_tokens))
            continue
        choice = (msg.get("choices") or [{}])[0]
        ids = choice.get("token_ids")
        if ids or choice.get("text"):
            if not res.token_times:
                res.ttft = now
            res.token_times.append(now)
            res.output_tokens += len(ids) if ids else 0
        res.latency = now
