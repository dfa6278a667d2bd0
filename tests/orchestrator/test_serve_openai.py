"""The official openai client against `pd-ssm serve` (one colocated worker, real processes).

Token ids must equal `LLM.generate` on an in-process engine over the same checkpoint, for greedy
and seeded sampling, streamed or not; prompts and seeds are random per run (printed on failure).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import openai
import pytest

from pd_ssm import LLM, SamplingParams


@pytest.fixture(scope="module")
def client(api_server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=api_server.url + "/v1", api_key=api_server.api_key, max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def reference(default_model: Path) -> LLM:
    return LLM(model=str(default_model), max_num_seqs=8, num_kv_blocks=128, block_size=16)


@pytest.fixture(scope="module")
def model_name(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


@pytest.fixture
def rng() -> random.Random:
    return random.Random(random.randrange(1 << 30))


def random_text(rng: random.Random, lo: int = 5, hi: int = 40) -> str:
    alphabet = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJ.,;:!?0123456789"
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(lo, hi)))


def sampling_cases(rng: random.Random) -> list[dict[str, Any]]:
    """Greedy, and seeded sampling with every filter on."""
    return [
        {"temperature": 0.0},
        {"temperature": round(rng.uniform(0.6, 1.2), 3), "top_p": round(rng.uniform(0.7, 0.99), 3),
         "seed": rng.randrange(1 << 31), "top_k": rng.randint(5, 50), "min_p": round(rng.uniform(0.0, 0.1), 3)},
    ]


def split(case: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(openai kwargs, extra_body) for one sampling case."""
    std = {k: v for k, v in case.items() if k in ("temperature", "top_p", "seed")}
    extra = {k: v for k, v in case.items() if k not in std}
    return std, extra


def test_models_lists_the_served_model(client: openai.OpenAI, default_model: Path) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [default_model.name]


@pytest.mark.parametrize("stream", [False, True])
def test_completion_tokens_equal_llm_generate(client: openai.OpenAI, reference: LLM, model_name: str,
                                              rng: random.Random, stream: bool) -> None:
    for case in sampling_cases(rng):
        prompt, n = random_text(rng), rng.randint(8, 24)
        std, extra = split(case)
        ref = reference.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True, **case))[0]
        body = {"return_token_ids": True, "ignore_eos": True, **extra}
        if stream:
            chunks = list(client.completions.create(model=model_name, prompt=prompt, max_tokens=n, stream=True,
                                                    stream_options={"include_usage": True}, extra_body=body, **std))
            ids = [t for c in chunks if c.choices for t in c.choices[0].model_extra["token_ids"]]
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            usage = chunks[-1].usage
            assert chunks[0].choices[0].model_extra["prompt_token_ids"] == ref.prompt_token_ids
        else:
            r = client.completions.create(model=model_name, prompt=prompt, max_tokens=n, extra_body=body, **std)
            ids, text, finish, usage = r.choices[0].model_extra["token_ids"], r.choices[0].text, \
                [r.choices[0].finish_reason], r.usage
            assert r.choices[0].model_extra["prompt_token_ids"] == ref.prompt_token_ids
        out = ref.outputs[0]
        assert ids == out.token_ids, f"{case} prompt={prompt!r}"
        assert text == out.text
        assert finish == ["length"]
        assert usage is not None
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(ref.prompt_token_ids), n)
        assert usage.total_tokens == usage.prompt_tokens + n


@pytest.mark.parametrize("stream", [False, True])
def test_chat_tokens_equal_llm_generate(client: openai.OpenAI, reference: LLM, model_name: str,
                                        rng: random.Random, stream: bool) -> None:
    messages: list[Any] = [{"role": "system", "content": random_text(rng)},
                           {"role": "user", "content": random_text(rng)}]
    for case in sampling_cases(rng):
        n = rng.randint(8, 24)
        std, extra = split(case)
        body = {"return_token_ids": True, "ignore_eos": True, **extra}
        if stream:
            chunks = list(client.chat.completions.create(model=model_name, messages=messages, max_tokens=n,
                                                         stream=True, extra_body=body, **std))
            assert chunks[0].choices[0].delta.role == "assistant"
            ids = [t for c in chunks for t in (c.choices[0].model_extra.get("token_ids") or [])]
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
            # the prompt is the chat template's rendering: ask for it once without streaming
            prompt_ids = client.chat.completions.create(model=model_name, messages=messages, max_tokens=1,
                                                        extra_body={"return_token_ids": True}).model_extra[
                "prompt_token_ids"]
        else:
            r = client.chat.completions.create(model=model_name, messages=messages, max_tokens=n, extra_body=body,
                                               **std)
            ids, text, prompt_ids = r.choices[0].model_extra["token_ids"], r.choices[0].message.content, \
                r.model_extra["prompt_token_ids"]
            assert r.choices[0].message.role == "assistant"
            assert r.usage is not None and r.usage.completion_tokens == n
        tok = reference.get_tokenizer()
        assert tok.decode(prompt_ids).endswith("<|assistant|>\n")  # the documented default template
        assert messages[1]["content"] in tok.decode(prompt_ids)
        out = reference.generate(prompt_ids, SamplingParams(max_tokens=n, ignore_eos=True, **case))[0].outputs[0]
        assert ids == out.token_ids, f"{case} messages={messages!r}"
        assert text == out.text


def test_stop_string_and_stop_token_ids_end_the_request(client: openai.OpenAI, reference: LLM, model_name: str,
                                                        rng: random.Random) -> None:
    prompt = random_text(rng)
    free = reference.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    stop_id = free.token_ids[rng.randint(3, 10)]
    r = client.completions.create(model=model_name, prompt=prompt, max_tokens=24, temperature=0,
                                  extra_body={"stop_token_ids": [stop_id], "ignore_eos": True,
                                              "return_token_ids": True})
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == stop_id
    assert choice.model_extra["token_ids"] == free.token_ids[: free.token_ids.index(stop_id) + 1]

    # a stop string: a piece of the free run's text; the text is cut before its first occurrence
    for _ in range(200):  # the random model's text is often broken UTF-8: find a run with a clean piece
        starts = [i for i in range(2, len(free.text) - 2) if "\ufffd" not in free.text[i:i + 2]]
        if starts:
            break
        prompt = random_text(rng)
        free = reference.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    else:
        pytest.fail(f"200 free runs without a clean two-character piece, the last {free.text!r}")
    stop = free.text[(k := rng.choice(starts)):k + 2]
    r = client.completions.create(model=model_name, prompt=prompt, max_tokens=24, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == stop
    assert r.choices[0].text == free.text[: free.text.index(stop)]


def test_openai_client_sees_errors(client: openai.OpenAI, api_server: Any, model_name: str) -> None:
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=model_name, prompt="hi", max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="model"):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=4)
    bad = openai.OpenAI(base_url=api_server.url + "/v1", api_key="wrong", max_retries=0, timeout=10)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=model_name, prompt="hi", max_tokens=4)


def test_concurrent_streams_each_equal_llm_generate(client: openai.OpenAI, api_server: Any, reference: LLM,
                                                    model_name: str, rng: random.Random) -> None:
    """More streams than the worker's 8 state slots at once: queued, batched, none mixed up or lost."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = [(random_text(rng), rng.randint(3, 8), rng.randrange(1 << 31)) for _ in range(rng.randint(12, 16))]

    def run(job: tuple[str, int, int]) -> list[int]:
        prompt, n, seed = job
        chunks = client.completions.create(model=model_name, prompt=prompt, max_tokens=n, stream=True, seed=seed,
                                           temperature=1.0, extra_body={"return_token_ids": True, "ignore_eos": True})
        return [t for c in chunks for t in c.choices[0].model_extra["token_ids"]]

    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(run, jobs))
    want = reference.generate([p for p, _, _ in jobs], [SamplingParams(max_tokens=n, seed=s, ignore_eos=True)
                                                        for _, n, s in jobs])
    assert got == [w.outputs[0].token_ids for w in want]
    assert api_server.metric("pd_ssm_state_slots_used", "w0") == 0.0
    assert api_server.metric("pd_ssm_kv_blocks_used", "w0") == 0.0
    assert api_server.metric("pd_ssm_pool_invariant_ok", "w0") == 1.0
