"""Async scheduling (engine/inflight.py): a decode step launched before the previous step's tokens
are read gives exactly the outputs of the synchronous engine.

On the CPU nothing overlaps in time (torch runs CPU kernels in the calling thread) but the whole
bookkeeping runs: tokens fed on the device, in-flight counts, dropped rows of finished requests,
deferred releases.  Each test checks the engine really launched ahead, so it cannot pass with the
overlap silently off.  The GPU test runs the same comparison through captured CUDA graphs.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pd_ssm import LLM, SamplingParams
from pd_ssm.engine.cuda_graphs import capture_sizes
from pd_ssm.engine.engine import Engine, RequestError
from pd_ssm.engine.inflight import InflightStep
from pd_ssm.outputs import RequestOutput
from tests.conftest import needs_cuda, random_prompts
from tests.engine.test_cuda_graphs import install_static_decode

LENGTHS = [3, 17, 9, 30, 1, 12]
MAX_TOKENS = [5, 12, 20, 8, 15, 3]


def tiny_llm(path: Any, async_scheduling: bool, **kw: Any) -> LLM:
    args: dict[str, Any] = dict(max_num_seqs=8, max_num_batched_tokens=64, block_size=4, num_kv_blocks=256)
    args.update(kw)
    return LLM(model=str(path), async_scheduling=async_scheduling, **args)


def count_launches_ahead(engine: Engine) -> list[int]:
    """Wrap the runner: counts the steps launched while another step's tokens were unread."""
    ahead = [0]
    inner = engine.runner.launch

    def launch(sched: Any, inflight: InflightStep | None = None) -> Any:
        ahead[0] += inflight is not None
        return inner(sched, inflight)

    engine.runner.launch = launch  # type: ignore[method-assign]
    return ahead


def mixed_params(stop_token: int) -> list[SamplingParams]:
    """Greedy, seeded sampling with filters, logprobs, a stop token, a stop string, deltas."""
    return [
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS[0], ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=7, max_tokens=MAX_TOKENS[1], ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS[2], stop_token_ids=[stop_token], ignore_eos=True),
        SamplingParams(temperature=0.7, seed=3, max_tokens=MAX_TOKENS[3], logprobs=3, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS[4], output_kind="delta", detokenize=False),
        SamplingParams(temperature=1.0, seed=11, max_tokens=MAX_TOKENS[5], stop=["e"]),
    ]


def summary(out: RequestOutput) -> tuple[Any, ...]:
    c = out.outputs[0]
    return c.token_ids, c.text, c.finish_reason, c.stop_reason


def generate(llm: LLM, params: list[SamplingParams]) -> tuple[list[tuple[Any, ...]], list[Any]]:
    """(tokens, text, finish and stop reason of each request, the logprobs of each)."""
    prompts = random_prompts(384, LENGTHS, seed=5)
    outs = llm.generate(prompts, params)
    return [summary(o) for o in outs], [o.outputs[0].logprobs for o in outs]


def assert_logprobs_close(got: list[Any], want: list[Any]) -> None:
    """Same tokens, values equal up to float rounding: a row finished by a stop token keeps its
    place in the next step's batch under async scheduling, and the CPU's matmul may round a row
    differently in a batch of another size."""
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        if w is None:
            assert g is None
            continue
        assert [list(d) for d in g] == [list(d) for d in w]
        for dg, dw in zip(g, w, strict=True):
            assert all(abs(dg[t] - dw[t]) <= 1e-4 for t in dw)


def clean(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished() and not engine.in_flight
    assert engine.cache.num_used_slots == 0 and engine.cache.num_used_blocks == 0
    engine.cache.check()


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "static-buffers"])
@pytest.mark.parametrize("name", ["mamba2-g1", "bamba-attn-middle", "nemotron-h"])
def test_async_outputs_equal_sync(name: str, graphs: bool, hf_checkpoint: Any) -> None:
    path, _ = hf_checkpoint(name)
    # a stop token that request 2 really meets mid-way (its 4th greedy token without the stop)
    probe, _ = generate(tiny_llm(path, False), mixed_params(stop_token=10_000))
    params = mixed_params(stop_token=probe[2][0][3])
    reference_llm, llm = tiny_llm(path, False), tiny_llm(path, True)
    if graphs:  # both through the static buffers: padded batches round like each other, not like eager
        install_static_decode(reference_llm.engine, capture_sizes(8))
        install_static_decode(llm.engine, capture_sizes(8))
    reference, want_logprobs = generate(reference_llm, params)
    assert reference[2][2] == "stop" and len(reference[2][0]) <= 4
    ahead = count_launches_ahead(llm.engine)
    got, logprobs = generate(llm, params)
    assert got == reference
    assert_logprobs_close(logprobs, want_logprobs)
    assert ahead[0] >= 10, f"only {ahead[0]} steps were launched ahead"
    clean(llm)


def run_until_done(engine: Engine, outs: dict[str, list[RequestOutput]]) -> None:
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)


def test_arrivals_and_abort_while_a_step_is_in_flight(hf_checkpoint: Any) -> None:
    path, _ = hf_checkpoint("bamba-attn-middle")
    prompts = random_prompts(384, [7, 19, 4, 11, 25], seed=9)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    finals: dict[bool, dict[str, list[int]]] = {}
    for async_on in (False, True):
        engine = tiny_llm(path, async_on).engine
        ahead = count_launches_ahead(engine)
        outs: dict[str, list[RequestOutput]] = {}
        for i in range(3):
            engine.add_request(prompts[i], params, request_id=f"r{i}")
        for _ in range(4):
            for o in engine.step():
                outs.setdefault(o.request_id, []).append(o)
        if async_on:
            assert {r.req_id for r in engine.in_flight} == {"r0", "r1", "r2"}
        # a request aborted while its step is in flight keeps its slot until that step is read
        aborted = engine.abort("r1")
        assert aborted is not None and aborted.finished and aborted.outputs[0].finish_reason == "abort"
        assert engine.cache.holds("r1") == async_on
        if async_on:  # its id is not free while its slot is held
            with pytest.raises(RequestError, match="already in use"):
                engine.add_request(prompts[1], params, request_id="r1")
            with pytest.raises(RequestError, match="already in use"):
                engine.reserve("r1", 8)
        for i in (3, 4):  # arrivals: the step in flight is read before their prefill is scheduled
            engine.add_request(prompts[i], params, request_id=f"r{i}")
        run_until_done(engine, outs)
        assert not engine.cache.holds("r1") and engine.cache.num_used_slots == 0
        assert not any(o.request_id == "r1" for o in engine.step())
        finals[async_on] = {rid: o[-1].outputs[0].token_ids for rid, o in outs.items() if o[-1].finished}
        assert all(len(t) == 12 for t in finals[async_on].values())
        assert (ahead[0] > 0) == async_on
    assert finals[True] == finals[False]


def test_preemption_with_async_scheduling(hf_checkpoint: Any) -> None:
    """A KV pool too small for every request: the engine reads the step in flight before a step
    that would preempt, and preemption changes timing, not tokens."""
    path, _ = hf_checkpoint("nemotron-h")
    prompts = random_prompts(384, [10, 14, 9, 12], seed=2)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    runs = {}
    for async_on in (False, True):
        llm = tiny_llm(path, async_on, num_kv_blocks=20)
        ahead = count_launches_ahead(llm.engine)
        outs = llm.generate(prompts, params)
        runs[async_on] = [o.outputs[0].token_ids for o in outs]
        assert all(len(t) == 16 for t in runs[async_on])
        assert (ahead[0] > 0) == async_on
        clean(llm)
    assert runs[True] == runs[False]


def test_export_reads_the_step_in_flight(hf_checkpoint: Any) -> None:
    path, _ = hf_checkpoint("mamba2-g1")
    prompts = random_prompts(384, [13, 6], seed=4)
    params = SamplingParams(temperature=0.8, seed=21, max_tokens=10, ignore_eos=True)
    reference = [o.outputs[0].token_ids for o in tiny_llm(path, False).generate(prompts, params)]
    src, dst = tiny_llm(path, True).engine, tiny_llm(path, True).engine
    ids = [src.add_request(p, params).req_id for p in prompts]
    outs: dict[str, list[RequestOutput]] = {}
    while not any(r.num_inflight for r in src.in_flight):
        for o in src.step():
            outs.setdefault(o.request_id, []).append(o)
    pages = src.export_request(ids[0])  # its token in flight is read first
    assert len(pages.request.output_token_ids) == src.requests[ids[1]].sample_offset
    dst.import_request(pages)
    run_until_done(src, outs)
    run_until_done(dst, outs)
    assert outs[ids[0]][-1].outputs[0].token_ids == reference[0]
    assert outs[ids[1]][-1].outputs[0].token_ids == reference[1]
    assert src.cache.num_used_slots == dst.cache.num_used_slots == 0


@needs_cuda
@pytest.mark.parametrize("name", ["mamba2-g1", "nemotron-h"])
def test_async_outputs_equal_sync_cuda_graphs(name: str, hf_checkpoint: Any) -> None:
    path, _ = hf_checkpoint(name)
    params = mixed_params(stop_token=10_000)
    kw = dict(device="cuda", gpu_memory_utilization=0.3)
    reference, want_logprobs = generate(tiny_llm(path, False, **kw), params)
    llm = tiny_llm(path, True, **kw)
    assert llm.engine.runner.graphs is not None
    ahead = count_launches_ahead(llm.engine)
    got, logprobs = generate(llm, params)
    assert got == reference
    assert_logprobs_close(logprobs, want_logprobs)
    assert ahead[0] >= 10
    clean(llm)
    torch.cuda.synchronize()
