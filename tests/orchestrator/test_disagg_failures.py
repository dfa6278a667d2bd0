"""Disaggregated deployments losing clients and workers (real processes on loopback).

- A client that disconnects mid-generation frees the request's pages on both workers within a
  second.
- A prefill worker killed while it holds a request: that request ends with a clean error (SSE
  error event), the decode worker gives its reservation back, the router keeps serving with the
  other prefill worker.
- A decode worker killed while it decodes a request: that request ends with a clean error, the
  prefill worker holds nothing of it, the router keeps serving with the other decode worker.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import signal
import threading
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai

from tests.orchestrator.conftest import Serve, pool_metrics, pools_empty, start_disagg


def _wait(pred: Callable[[], bool], within: float, what: str) -> float:
    """Seconds until `pred()`; fails after `within` seconds."""
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > within:
            raise AssertionError(f"not within {within} s: {what}")
        time.sleep(0.02)
    return time.monotonic() - t0


def _workers(serve: Serve) -> dict[str, dict[str, Any]]:
    return {w["id"]: w for w in serve.health()["workers"]}


def _long_body(stream: bool) -> dict[str, Any]:
    # ignore_eos and hundreds of tokens: only an abort or a failure ends it within the test
    return {"prompt": "lost " * random.randint(1, 6), "max_tokens": 900, "ignore_eos": True,
            "temperature": 0, "stream": stream}


def _open(serve: Serve, body: dict[str, Any]) -> http.client.HTTPConnection:
    url = urllib.parse.urlsplit(serve.url)
    assert url.hostname is not None
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    return conn


def _client(serve: Serve) -> openai.OpenAI:
    return openai.OpenAI(base_url=serve.url + "/v1", api_key="none", max_retries=0, timeout=30)


def _still_serves(serve: Serve, n: int) -> None:
    client, model = _client(serve), serve.model_name()
    for _ in range(n):
        k = random.randint(2, 6)
        r = client.completions.create(model=model, prompt="after " * random.randint(1, 5), max_tokens=k,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
        assert r.choices[0].finish_reason == "length" and len(r.choices[0].model_extra["token_ids"]) == k


def _stream_error(client: openai.OpenAI, model: str, errors: list[BaseException], started: threading.Event) -> None:
    """Run a long streamed completion; keep the error it ends with (none: it must not end)."""
    try:
        body = _long_body(True)
        for _ in client.completions.create(model=model, prompt=body["prompt"], max_tokens=body["max_tokens"],
                                           temperature=0, stream=True, extra_body={"ignore_eos": True}):
            started.set()
    except BaseException as e:  # the error under test
        errors.append(e)
    finally:
        started.set()


def test_disconnect_frees_pages_on_both_workers_within_a_second(tmp_path: Path, default_model: Path) -> None:
    serve = start_disagg(default_model, tmp_path / "serve.log")
    try:
        for stream in (True, False):
            conn = _open(serve, _long_body(stream))
            # decoding on d0: its pages arrived, the prefill worker let its own go
            _wait(lambda: serve.metric("pd_ssm_num_requests_running", "d0") == 1.0, 10.0, "decoding on d0")
            if stream:
                resp = conn.getresponse()
                assert resp.status == 200
                events = [resp.readline() for _ in range(6)]  # three `data:` events and their blank lines
                assert all(e.startswith(b"data: {") for e in events[::2]), events
            assert serve.metric("pd_ssm_state_slots_used", "d0") == 1.0
            conn.sock.close()  # the client goes away mid-generation
            conn.close()
            took = _wait(lambda: pools_empty(serve, "d0") and pools_empty(serve, "p0"), 1.0, "pages freed")
            print(f"stream={stream}: freed on both workers {took:.3f} s after the disconnect")
    finally:
        serve.stop()


def test_killed_prefill_worker_fails_its_request_cleanly(tmp_path: Path, default_model: Path) -> None:
    serve = start_disagg(default_model, tmp_path / "serve.log", prefill=2, decode=1)
    try:
        client, model = _client(serve), serve.model_name()
        pids = {w: _workers(serve)[w]["pid"] for w in ("p0", "p1")}
        errors: list[BaseException] = []
        started = threading.Event()
        t = threading.Thread(target=_stream_error, args=(client, model, errors, started))
        # both stopped (alive, silent): the request waits in whichever it went to, reserved on d0;
        # it must be sent before they leave rotation (--health-timeout 1.5 s)
        for pid in pids.values():
            os.kill(pid, signal.SIGSTOP)
        try:
            t.start()
            _wait(lambda: any(_workers(serve)[w]["inflight"] == 1 for w in pids), 1.2,
                  f"the request on p0 or p1 {errors} {_workers(serve)}")
            victim = next(w for w in pids if _workers(serve)[w]["inflight"] == 1)
            _wait(lambda: serve.metric("pd_ssm_state_slots_reserved", "d0") == 1.0, 2.0, "d0 reserved for it")
            os.kill(pids[victim], signal.SIGKILL)
        finally:
            for pid in pids.values():
                os.kill(pid, signal.SIGCONT)
        survivor = "p1" if victim == "p0" else "p0"
        t.join(10)
        assert not t.is_alive()
        assert len(errors) == 1 and isinstance(errors[0], openai.APIError), errors
        assert victim in str(errors[0])  # the SSE error event names the lost worker
        _wait(lambda: pools_empty(serve, "d0"), 1.0, f"d0 gave the reservation back: {pool_metrics(serve, 'd0')}")
        assert _workers(serve)[victim]["status"] == "dead"
        _wait(lambda: _workers(serve)[survivor]["status"] == "healthy", 3.0, f"{survivor} back in rotation")
        _still_serves(serve, random.randint(2, 4))
        _wait(lambda: pools_empty(serve, "d0") and pools_empty(serve, survivor), 1.0, "no pages left")
    finally:
        serve.stop()


def test_killed_decode_worker_fails_its_request_cleanly(tmp_path: Path, default_model: Path) -> None:
    serve = start_disagg(default_model, tmp_path / "serve.log", prefill=1, decode=2)
    try:
        errors: list[BaseException] = []
        started = threading.Event()
        t = threading.Thread(target=_stream_error, args=(_client(serve), serve.model_name(), errors, started))
        t.start()
        assert started.wait(15)  # tokens flow: the request decodes on one decode worker
        busy = [w for w in ("d0", "d1") if _workers(serve)[w]["inflight"] == 1]
        assert len(busy) == 1, _workers(serve)
        os.kill(_workers(serve)[busy[0]]["pid"], signal.SIGKILL)
        t.join(10)
        assert not t.is_alive()
        assert len(errors) == 1 and isinstance(errors[0], openai.APIError), errors
        assert busy[0] in str(errors[0])
        _wait(lambda: pools_empty(serve, "p0"), 1.0, f"p0 holds nothing: {pool_metrics(serve, 'p0')}")
        _still_serves(serve, random.randint(2, 4))
        survivor = "d1" if busy[0] == "d0" else "d0"
        _wait(lambda: pools_empty(serve, survivor) and pools_empty(serve, "p0"), 1.0, "no pages left")
    finally:
        serve.stop()
