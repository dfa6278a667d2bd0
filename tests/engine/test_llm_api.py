"""The offline API: export/import mid-generation, seeded sampling, bad input, pool invariants."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from pd_ssm import LLM, SamplingParams
from pd_ssm.config import ConfigError
from pd_ssm.engine.engine import RequestError
from pd_ssm.sampling_params import SamplingParamsError
from tests.conftest import random_prompts

HYBRID = "bamba-attn-middle"


def small_llm(path: Path, **kw: Any) -> LLM:
    args: dict[str, Any] = dict(max_num_seqs=8, max_num_batched_tokens=24, block_size=4, num_kv_blocks=256)
    args.update(kw)
    return LLM(model=str(path), **args)


def run_to_end(llm: LLM) -> dict[str, list[int]]:
    done: dict[str, list[int]] = {}
    while llm.engine.has_unfinished():
        for out in llm.engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return done


def clean(llm: LLM) -> None:
    c = llm.engine.cache
    c.check()
    assert c.num_used_slots == 0 and c.num_free_blocks == c.num_blocks and not llm.engine.requests


@pytest.mark.parametrize("name", ["mamba2-g2-tied", HYBRID, "nemotron-h"])
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_export_import_mid_generation(name: str, sampling: str, hf_checkpoint: Any) -> None:
    path, _ = hf_checkpoint(name)
    prompts = random_prompts(384, [19, 40, 5], seed=3)
    params = (
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        if sampling == "greedy"
        else SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True)
    )
    reference = [o.outputs[0].token_ids for o in small_llm(path).generate(prompts, params)]

    src, dst = small_llm(path), small_llm(path)
    ids = [src.engine.add_request(p, params).req_id for p in prompts]
    moved: dict[str, list[int]] = {}
    # step until every request has a few tokens, exporting each as soon as it has 5
    while len(moved) < len(ids):
        src.engine.step()
        for rid in ids:
            req = src.engine.requests.get(rid)
            if rid not in moved and req is not None and len(req.output_token_ids) >= 5 and req.is_decoding:
                pages = src.engine.export_request(rid)
                assert pages.nbytes() > 0 and pages.num_tokens == req.num_tokens - 1
                dst.engine.import_request(pages)
                moved[rid] = []
    clean(src)
    done = run_to_end(dst)
    clean(dst)
    assert [done[r] for r in ids] == reference


def test_pages_round_trip_bit_exact(hf_checkpoint: Any) -> None:
    path, _ = hf_checkpoint(HYBRID)
    src, dst = small_llm(path), small_llm(path)
    req = src.engine.add_request(random_prompts(384, [30])[0], SamplingParams(temperature=0, max_tokens=8))
    while len(req.output_token_ids) < 3:
        src.engine.step()
    pages = src.engine.export_request(req.req_id)
    dst.engine.import_request(pages)
    again = dst.engine.export_request(req.req_id)
    assert pages.layers.keys() == again.layers.keys()
    for i, page in pages.layers.items():
        for k, t in page.tensors.items():
            assert torch.equal(t, again.layers[i].tensors[k]), f"layer {i} {k} changed in transit"
    clean(src)
    clean(dst)


def test_import_rejects_pages_of_another_model(hf_checkpoint: Any) -> None:
    a, _ = hf_checkpoint(HYBRID)
    b, _ = hf_checkpoint("nemotron-h")
    src, dst = small_llm(a), small_llm(b)
    req = src.engine.add_request([5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=4))
    src.engine.step()
    pages = src.engine.export_request(req.req_id)
    with pytest.raises(ValueError, match="do not fit|layer"):
        dst.engine.import_request(pages)
    clean(dst)


def test_seeded_sampling_reproducible_and_batch_independent(hf_checkpoint: Any) -> None:
    path, _ = hf_checkpoint(HYBRID)
    p = SamplingParams(temperature=0.8, top_p=0.95, min_p=0.01, seed=42, max_tokens=16, ignore_eos=True)
    prompt = random_prompts(384, [21], seed=9)[0]
    alone = small_llm(path).generate([prompt], p)[0].outputs[0].token_ids
    again = small_llm(path).generate([prompt], p)[0].outputs[0].token_ids
    others = random_prompts(384, [3, 44, 17, 30], seed=10)
    mixed = small_llm(path, max_num_batched_tokens=10).generate(
        others[:2] + [prompt] + others[2:],
        [SamplingParams(temperature=1.0, seed=7, max_tokens=9)] * 2 + [p] + [SamplingParams(temperature=0, max_tokens=5)] * 2,
    )[2].outputs[0].token_ids
    assert alone == again == mixed
    other_seed = small_llm(path).generate([prompt], SamplingParams(temperature=0.8, top_p=0.95, seed=43, max_tokens=16,
                                                                    ignore_eos=True))[0].outputs[0].token_ids
    assert other_seed != alone


def test_stop_rules_and_logprobs(hf_checkpoint: Any) -> None:
    path, _ = hf_checkpoint(HYBRID)
    llm = small_llm(path)
    prompt = random_prompts(384, [12], seed=1)[0]
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3))[0]
    toks = free.outputs[0].token_ids
    lps = free.outputs[0].logprobs
    assert lps is not None and len(lps) == len(toks)
    for t, d in zip(toks, lps, strict=True):
        assert t in d and len(d) >= 3 and max(d.values()) == d[t]  # greedy picks the top logprob
        assert all(v <= 0 for v in d.values())
    assert math.isclose(free.outputs[0].cumulative_logprob, sum(d[t] for t, d in zip(toks, lps, strict=True)))
    stop_tok = toks[5]
    cut = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_tok]))[0]
    first = toks.index(stop_tok)
    assert cut.outputs[0].token_ids == toks[: first + 1]
    assert cut.outputs[0].finish_reason == "stop" and cut.outputs[0].stop_reason == stop_tok
    clean(llm)


def test_detokenize_off_gives_the_same_ids_and_no_text(hf_checkpoint: Any) -> None:
    path, _ = hf_checkpoint(HYBRID)
    llm = small_llm(path)
    prompts = random_prompts(384, [12, 30, 5], seed=3)
    kw: dict[str, Any] = dict(temperature=0.9, seed=11, max_tokens=14)
    with_text = llm.generate(prompts, SamplingParams(**kw))
    ids_only = llm.generate(prompts, SamplingParams(detokenize=False, **kw))
    for a, b in zip(with_text, ids_only, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids and b.outputs[0].text == ""
        assert b.outputs[0].finish_reason == a.outputs[0].finish_reason
    toks = with_text[0].outputs[0].token_ids
    cut = llm.generate([prompts[0]], SamplingParams(detokenize=False, stop_token_ids=[toks[4]], **kw))[0]
    assert cut.outputs[0].token_ids == toks[: toks.index(toks[4]) + 1] and cut.outputs[0].finish_reason == "stop"
    with pytest.raises(SamplingParamsError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)
    clean(llm)


def test_output_kinds(hf_checkpoint: Any) -> None:
    """cumulative: every step the whole output; delta: only the step's tokens and text, which add up to
    the cumulative output; final_only: one output, at the end."""
    path, _ = hf_checkpoint(HYBRID)
    llm = small_llm(path)
    prompt = random_prompts(384, [9], seed=4)[0]
    seen: dict[str, list[Any]] = {}
    for kind in ("cumulative", "delta", "final_only"):
        params = SamplingParams(temperature=0.7, seed=3, max_tokens=10, ignore_eos=True, logprobs=2, output_kind=kind)
        llm.engine.add_request(prompt, params)
        outs = []
        while llm.engine.has_unfinished():
            outs.extend(llm.engine.step())
        seen[kind] = outs
    cum, delta, final = seen["cumulative"], seen["delta"], seen["final_only"]
    assert len(final) == 1 and final[0].finished and len(cum) == len(delta) == 10
    want = cum[-1].outputs[0]
    assert final[0].outputs[0].token_ids == want.token_ids and final[0].outputs[0].text == want.text
    assert [t for o in delta for t in o.outputs[0].token_ids] == want.token_ids
    assert "".join(o.outputs[0].text for o in delta) == want.text
    assert [d for o in delta for d in o.outputs[0].logprobs or []] == want.logprobs
    assert all(len(o.outputs[0].token_ids) == i + 1 for i, o in enumerate(cum))
    with pytest.raises(SamplingParamsError, match="output_kind"):
        SamplingParams(output_kind="sometimes")
    clean(llm)


def test_bad_input_is_a_clear_error(hf_checkpoint: Any, tmp_path: Path) -> None:
    path, _ = hf_checkpoint(HYBRID)
    llm = small_llm(path, max_model_len=64)
    with pytest.raises(RequestError, match="empty"):
        llm.generate([[]], SamplingParams())
    with pytest.raises(RequestError, match="maximum model length"):
        llm.generate([list(range(3, 70))], SamplingParams())
    with pytest.raises(RequestError, match="vocabulary"):
        llm.generate([[1, 2, 100000]], SamplingParams())
    # a good prompt before a bad one in the same call leaves nothing behind
    with pytest.raises(RequestError):
        llm.generate([[5, 6, 7], []], SamplingParams())
    clean(llm)
    for bad in (dict(temperature=-0.5), dict(top_p=0.0), dict(top_p=1.5), dict(temperature=float("nan")),
                dict(top_p=float("nan")), dict(max_tokens=0), dict(top_k=-3), dict(min_p=2.0)):
        with pytest.raises(SamplingParamsError):
            SamplingParams(**bad)  # type: ignore[arg-type]


def test_unknown_architecture_lists_supported(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": 10}))
    with pytest.raises(ConfigError, match="Mamba2ForCausalLM.*BambaForCausalLM.*NemotronHForCausalLM"):
        LLM(model=str(tmp_path))


def test_missing_tensors_are_named(hf_checkpoint: Any, tmp_path: Path) -> None:
    path, _ = hf_checkpoint(HYBRID)
    tensors = load_file(str(path / "model.safetensors"))
    dropped = ["model.layers.0.mamba.A_log", "model.layers.1.self_attn.k_proj.weight"]
    for k in dropped:
        del tensors[k]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(Exception) as info:
        LLM(model=str(tmp_path))
    for k in dropped:
        assert k in str(info.value)
