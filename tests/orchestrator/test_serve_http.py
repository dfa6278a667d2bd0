"""The router's HTTP contract on a live deployment: bad input, auth, health, metrics, disconnects."""

from __future__ import annotations

import http.client
import json
import random
import time
import urllib.parse
from typing import Any

import pytest

BAD_COMPLETIONS: list[tuple[str, dict[str, Any], str]] = [
    ("missing prompt", {"max_tokens": 4}, "prompt"),
    ("max_tokens zero", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("max_tokens negative", {"prompt": "hi", "max_tokens": -3}, "max_tokens"),
    ("temperature negative", {"prompt": "hi", "temperature": -0.5}, "temperature"),
    ("top_p zero", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("n > 1", {"prompt": "hi", "n": 2}, "n"),
    ("unknown model", {"prompt": "hi", "model": "gpt-nothing"}, "model"),
    ("empty prompt", {"prompt": ""}, "prompt"),
    ("batch of prompts", {"prompt": ["a", "b"]}, "prompt"),
    ("token id outside vocab", {"prompt": [5, 1 << 20]}, "prompt"),
    ("prompt too long", {"prompt": "x" * 5000}, "prompt"),
    ("prompt + max_tokens too long", {"prompt": "x" * 1000, "max_tokens": 1500}, "max_tokens"),
    ("stop_token_ids negative", {"prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids[0]"),
    ("logprobs unsupported", {"prompt": "hi", "logprobs": 2}, "logprobs"),
]


@pytest.mark.parametrize("case", BAD_COMPLETIONS, ids=[c[0] for c in BAD_COMPLETIONS])
def test_bad_completion_is_400_naming_the_field(api_server: Any, case: tuple[str, dict[str, Any], str]) -> None:
    _, body, field = case
    status, resp = api_server.post("/v1/completions", body, api_server.auth)
    assert status == 400, resp
    assert resp["error"]["param"] == field
    assert resp["error"]["message"].startswith(field), resp


BAD_CHATS: list[tuple[str, dict[str, Any], str]] = [
    ("missing messages", {"max_tokens": 4}, "messages"),
    ("empty messages", {"messages": []}, "messages"),
    ("message without role", {"messages": [{"content": "hi"}]}, "messages[0].role"),
    ("max_completion_tokens zero", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
     "max_completion_tokens"),
    ("messages too long", {"messages": [{"role": "user", "content": "y" * 5000}]}, "messages"),
]


@pytest.mark.parametrize("case", BAD_CHATS, ids=[c[0] for c in BAD_CHATS])
def test_bad_chat_is_400_naming_the_field(api_server: Any, case: tuple[str, dict[str, Any], str]) -> None:
    _, body, field = case
    status, resp = api_server.post("/v1/chat/completions", body, api_server.auth)
    assert status == 400, resp
    assert resp["error"]["param"] == field, resp


def test_malformed_json_is_400(api_server: Any) -> None:
    status, resp = api_server.post("/v1/completions", b'{"prompt": "hi", "max_tokens": ', api_server.auth)
    assert status == 400
    assert "JSON" in resp["error"]["message"]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic abc"}])
def test_wrong_or_missing_api_key_is_401(api_server: Any, headers: dict[str, str]) -> None:
    status, resp = api_server.post("/v1/completions", {"prompt": "hi", "max_tokens": 2}, headers)
    assert status == 401
    assert resp["error"]["type"] == "AuthenticationError"
    assert api_server.get("/v1/models", headers)[0] == 401
    assert api_server.post("/v1/completions", {"prompt": "hi", "max_tokens": 2}, api_server.auth)[0] == 200


def test_health_and_metrics(api_server: Any) -> None:
    status, body = api_server.get("/health")
    assert status == 200
    (worker,) = json.loads(body)["workers"]
    assert worker["status"] == "healthy" and worker["pid"] > 0
    n = random.randint(3, 9)
    body = {"prompt": "metrics", "max_tokens": 3, "ignore_eos": True}
    for _ in range(n):
        assert api_server.post("/v1/completions", body, api_server.auth)[0] == 200
    text = api_server.get("/metrics")[1]
    for name in ("pd_ssm_time_to_first_token_seconds_count", "pd_ssm_time_per_output_token_seconds_count",
                 "pd_ssm_e2e_request_latency_seconds_count"):
        count = next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))
        assert count >= n, name
    assert api_server.metric("pd_ssm_pool_invariant_ok", "w0") == 1.0
    free, used = api_server.metric("pd_ssm_state_slots_free", "w0"), api_server.metric("pd_ssm_state_slots_used", "w0")
    assert (free, used) == (8.0, 0.0)


def _open_stream(api_server: Any, body: dict[str, Any], path: str = "/v1/completions") -> http.client.HTTPConnection:
    url = urllib.parse.urlsplit(api_server.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=20)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json", **api_server.auth})
    return conn


def _wait_metric(api_server: Any, name: str, value: float, within: float) -> float:
    """Seconds until the metric shows `value`; fails after `within` seconds."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < within:
        if api_server.metric(name, "w0") == value:
            return time.monotonic() - t0
        time.sleep(0.02)
    raise AssertionError(f"{name} did not reach {value} within {within} s (now {api_server.metric(name, 'w0')})")


def _aborts(api_server: Any) -> float:
    text = api_server.get("/metrics")[1]
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith('pd_ssm_requests_total{finish_reason="abort"}'))


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_frees_pages_within_a_second(api_server: Any, stream: bool) -> None:
    before = _aborts(api_server)
    # long enough (ignore_eos, hundreds of tokens) that only an abort can end it within the test
    body = {"prompt": "disconnect " * random.randint(1, 5), "max_tokens": 900, "ignore_eos": True,
            "temperature": 0, "stream": stream}
    conn = _open_stream(api_server, body)
    _wait_metric(api_server, "pd_ssm_state_slots_used", 1.0, within=5.0)
    if stream:
        resp = conn.getresponse()
        assert resp.status == 200
        events = [resp.readline() for _ in range(6)]  # three `data:` events and their blank lines
        assert all(e.startswith(b"data: {") for e in events[::2]), events
    conn.sock.close()  # the client goes away mid-generation
    conn.close()
    assert _wait_metric(api_server, "pd_ssm_state_slots_used", 0.0, within=1.0) < 1.0
    assert api_server.metric("pd_ssm_num_requests_running", "w0") == 0.0
    assert api_server.metric("pd_ssm_pool_invariant_ok", "w0") == 1.0
    assert _aborts(api_server) == before + 1
