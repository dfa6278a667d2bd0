"""The official openai client against `pd-ssm serve --disagg` (1 prefill + 1 decode worker, real
processes), over the ZMQ connector and over the NCCL connector (gloo on CPU), whole requests or
streamed layer by layer (`--stream-layers`).

Token ids and text must equal `LLM.generate` on a colocated in-process engine, for greedy and
seeded sampling, completions and chat, streamed or not: the first token comes from the prefill
worker, every later one from the decode worker that imported the prefill's state pages.
Afterwards no worker holds a page.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from pd_ssm import LLM, SamplingParams
from tests.orchestrator.conftest import Serve, pools_empty, start_disagg
from tests.orchestrator.test_serve_openai import random_text, sampling_cases, split


@pytest.fixture(scope="module", params=["zmq", "nccl", "nccl-stream-layers"])
def deployment(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
               default_model: Path) -> Iterator[Serve]:
    log = tmp_path_factory.mktemp(f"disagg-{request.param}") / "serve.log"
    # nccl-stream-layers: each layer's pages leave in a part message of its own (1 byte suffices)
    # while the prefill forward runs
    connector, *extra = request.param.replace("-stream-layers", " --stream-layers --stream-bytes 1").split()
    s = start_disagg(default_model, log, *extra, connector=connector)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference(default_model: Path) -> LLM:
    return LLM(model=str(default_model), max_num_seqs=8, num_kv_blocks=128, block_size=16)


@pytest.fixture
def rng() -> random.Random:
    # NOTE: PD_SSM_TEST_SEED replays a run's printed seed
    seed = int(os.environ.get("PD_SSM_TEST_SEED") or random.randrange(1 << 30))
    print(f"rng seed {seed}")
    return random.Random(seed)


def _client(serve: Serve) -> openai.OpenAI:
    return openai.OpenAI(base_url=serve.url + "/v1", api_key="none", max_retries=0, timeout=30)


def _completion(client: openai.OpenAI, model: str, prompt: str, n: int, case: dict[str, Any],
                stream: bool) -> tuple[list[int], str, list[int], Any]:
    """(token ids, text, prompt ids, usage) of one completion."""
    std, extra = split(case)
    body = {"return_token_ids": True, "ignore_eos": True, **extra}
    if not stream:
        r = client.completions.create(model=model, prompt=prompt, max_tokens=n, extra_body=body, **std)
        c = r.choices[0]
        assert c.finish_reason == "length"
        return c.model_extra["token_ids"], c.text, c.model_extra["prompt_token_ids"], r.usage
    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=n, stream=True,
                                            stream_options={"include_usage": True}, extra_body=body, **std))
    ids = [t for c in chunks if c.choices for t in c.choices[0].model_extra["token_ids"]]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    return ids, text, chunks[0].choices[0].model_extra["prompt_token_ids"], chunks[-1].usage


@pytest.mark.parametrize("stream", [False, True])
def test_completions_equal_llm_generate(deployment: Serve, reference: LLM, rng: random.Random, stream: bool) -> None:
    client = _client(deployment)
    model = deployment.model_name()
    for case in sampling_cases(rng):
        prompt, n = random_text(rng, 5, 60), rng.randint(2, 24)
        ids, text, prompt_ids, usage = _completion(client, model, prompt, n, case, stream)
        ref = reference.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True, **case))[0]
        assert prompt_ids == ref.prompt_token_ids
        assert ids == ref.outputs[0].token_ids, f"{case} prompt={prompt!r}"
        assert text == ref.outputs[0].text
        assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (len(prompt_ids), n)
    assert pools_empty(deployment, "p0") and pools_empty(deployment, "d0")


@pytest.mark.parametrize("stream", [False, True])
def test_chat_equals_llm_generate(deployment: Serve, reference: LLM, rng: random.Random, stream: bool) -> None:
    client = _client(deployment)
    model = deployment.model_name()
    messages: list[Any] = [{"role": "system", "content": random_text(rng)},
                           {"role": "user", "content": random_text(rng)}]
    prompt_ids = client.chat.completions.create(model=model, messages=messages, max_tokens=1,
                                                extra_body={"return_token_ids": True}).model_extra["prompt_token_ids"]
    for case in sampling_cases(rng):
        n = rng.randint(2, 24)
        std, extra = split(case)
        body = {"return_token_ids": True, "ignore_eos": True, **extra}
        if stream:
            chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=n, stream=True,
                                                         extra_body=body, **std))
            assert chunks[0].choices[0].delta.role == "assistant"
            ids = [t for c in chunks for t in (c.choices[0].model_extra.get("token_ids") or [])]
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
        else:
            r = client.chat.completions.create(model=model, messages=messages, max_tokens=n, extra_body=body, **std)
            ids, text = r.choices[0].model_extra["token_ids"], r.choices[0].message.content
            assert r.model_extra["prompt_token_ids"] == prompt_ids
            assert r.usage is not None and r.usage.completion_tokens == n
        out = reference.generate(prompt_ids, SamplingParams(max_tokens=n, ignore_eos=True, **case))[0].outputs[0]
        assert ids == out.token_ids, f"{case} messages={messages!r}"
        assert text == out.text
    assert pools_empty(deployment, "p0") and pools_empty(deployment, "d0")


def test_one_token_requests_end_on_the_prefill_worker(deployment: Serve, reference: LLM, rng: random.Random) -> None:
    """max_tokens=1 finishes at the first token: the decode worker's reservation is given back."""
    client = _client(deployment)
    model = deployment.model_name()
    prompts = [random_text(rng) for _ in range(rng.randint(3, 6))]
    for prompt in prompts:
        r = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0,
                                      extra_body={"return_token_ids": True, "ignore_eos": True})
        ref = reference.generate(prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))[0]
        assert r.choices[0].model_extra["token_ids"] == ref.outputs[0].token_ids
    _wait(lambda: pools_empty(deployment, "d0") and pools_empty(deployment, "p0"), 2.0, "reservations returned")


def _wait(pred: Any, within: float, what: str) -> None:
    import time

    deadline = time.monotonic() + within
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within} s: {what}")
        time.sleep(0.05)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_text_spans_both_workers(deployment: Serve, reference: LLM, rng: random.Random,
                                             stream: bool) -> None:
    """A stop string after the first token: the text is cut before it, and the first token's text
    (held back on the prefill worker while a stop string might form) is not lost on the way."""
    client = _client(deployment)
    model = deployment.model_name()
    # NOTE: the random default model's text is often broken UTF-8: find a clean piece. About one run
    # in four or five has one (rng seed 498498100 needs 23), so 20 runs failed ~1% of the time
    for _ in range(200):
        prompt = random_text(rng)
        free = reference.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0]
        head = reference.get_tokenizer().decode([free.token_ids[0]])
        starts = [i for i in range(len(head) + 1, len(free.text) - 2)
                  if "\ufffd" not in free.text[i:i + 2] and free.text.index(free.text[i:i + 2]) == i]
        # the first token's own text must be whole: that is the text the prefill worker holds back
        if starts and head and "\ufffd" not in head and free.text.startswith(head):
            break
    else:
        pytest.fail("200 free runs without a whole first character and a clean two-character piece after it")
    stop = free.text[(k := rng.choice(starts)):k + 2]
    kwargs: dict[str, Any] = dict(model=model, prompt=prompt, max_tokens=24, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    if stream:
        chunks = list(client.completions.create(stream=True, **kwargs))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    else:
        r = client.completions.create(**kwargs)
        text, finish = r.choices[0].text, [r.choices[0].finish_reason]
    assert finish == ["stop"]
    assert text == free.text[: free.text.index(stop)], f"stop={stop!r}"
