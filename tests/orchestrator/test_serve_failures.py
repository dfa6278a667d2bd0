"""Workers that stop answering or die, on a live 2-worker deployment; and a clean shutdown."""

from __future__ import annotations

import http.client
import json
import os
import random
import signal
import threading
import urllib.parse
from collections.abc import Callable
from typing import Any

import openai

from tests.orchestrator.conftest import alive, wait_until, workers_by_id


def _long_body(stream: bool) -> dict[str, Any]:
    return {"prompt": "crash " * random.randint(1, 4), "max_tokens": 900, "ignore_eos": True, "stream": stream}


def test_unresponsive_worker_leaves_rotation_comes_back_and_sigterm_stops_all(serve_factory: Callable[..., Any]) -> None:
    serve = serve_factory("--routing-policy", "round_robin", workers=2)
    client = openai.OpenAI(base_url=serve.url + "/v1", api_key="none", max_retries=0, timeout=20)
    pid = workers_by_id(serve)["w1"]["pid"]
    os.kill(pid, signal.SIGSTOP)  # alive but silent: it cannot answer health checks
    try:
        wait_until(lambda: workers_by_id(serve)["w1"]["status"] == "unresponsive", 4.0, "w1 out of rotation")
        for _ in range(random.randint(3, 5)):  # round robin would pick w1 every other time
            r = client.completions.create(model=serve.model_name(), prompt="still here", max_tokens=2,
                                          extra_body={"ignore_eos": True})
            assert r.choices[0].finish_reason == "length"
        assert workers_by_id(serve)["w1"]["inflight"] == 0
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_until(lambda: workers_by_id(serve)["w1"]["status"] == "healthy", 4.0, "w1 back in rotation")

    # SIGTERM to the launcher stops every worker (one deployment for both checks: startup is slow)
    pids = [w["pid"] for w in workers_by_id(serve).values()]
    assert all(alive(p) for p in pids)
    assert serve.stop() == 0
    wait_until(lambda: not any(alive(p) for p in pids), 2.0, "workers gone after the launcher's SIGTERM")


def test_killed_worker_fails_its_requests_cleanly_and_others_keep_serving(serve_factory: Callable[..., Any]) -> None:
    serve = serve_factory(workers=2)
    name = serve.model_name()
    url = urllib.parse.urlsplit(serve.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=20)
    conn.request("POST", "/v1/completions", json.dumps(_long_body(True)), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: {")
    busy = next(w for w in workers_by_id(serve).values() if w["inflight"] == 1)
    os.kill(busy["pid"], signal.SIGKILL)
    # the stream ends with an SSE error event (503) and [DONE]
    events = [e.strip() for e in resp.read().decode().split("\n\n") if e.strip()]
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == 503 and busy["id"] in error["message"]
    assert events[-1] == "data: [DONE]"
    conn.close()
    health = workers_by_id(serve)
    assert health[busy["id"]]["status"] == "dead" and "signal 9" in health[busy["id"]]["error"]
    assert serve.get("/health")[0] == 200  # one worker still serves
    client = openai.OpenAI(base_url=serve.url + "/v1", api_key="none", max_retries=0, timeout=20)
    for _ in range(3):
        r = client.completions.create(model=name, prompt="after", max_tokens=3, extra_body={"ignore_eos": True})
        assert r.usage is not None and r.usage.completion_tokens == 3

    # the last worker dies under a non-streamed request: a clean 503, then 503 for everything
    (last,) = [w for w in workers_by_id(serve).values() if w["status"] == "healthy"]
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.update(r=serve.post("/v1/completions", _long_body(False))))
    thread.start()
    wait_until(lambda: workers_by_id(serve)[last["id"]]["inflight"] == 1, 5.0, "the request reached the last worker")
    os.kill(last["pid"], signal.SIGKILL)
    thread.join(timeout=10)
    status, body = result["r"]
    assert status == 503 and body["error"]["type"] == "ServiceUnavailableError"
    assert serve.get("/health")[0] == 503
    status, body = serve.post("/v1/completions", {"prompt": "anyone?", "max_tokens": 2})
    assert status == 503 and "no engine worker" in body["error"]["message"]
