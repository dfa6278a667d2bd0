"""pd_ssm's Mamba2 / Bamba / NemotronH against transformers' own forward, on tiny random checkpoints.

(a) several prompts (1 token, shorter than a chunk, straddling several chunks) in ONE varlen
    prefill batch: every position's logits;
(b) prompts prefilled in uneven chunks (mid-chunk starts, several sequences per step), then decode
    steps mixed with prefill chunks in the same batch: logits at every position computed,
    compared with transformers' incremental (cached) path and its full-sequence forward.
"""

from __future__ import annotations

import math

import pytest
import torch
from harness import (
    CONFIGS,
    HFIncremental,
    StepRunner,
    hf_groups_gated_norm,
    hf_logits,
    load_pd,
    make_hf_model,
    rel_err,
    save_checkpoint,
)

TOL = 1e-4
NAMES = list(CONFIGS)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=NAMES)
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    name = request.param
    if not hf_groups_gated_norm(name):
        pytest.skip(f"the installed transformers normalizes {name}'s gated norm over all of d_inner (< 5.2x)")
    hf = make_hf_model(name)
    # one family member per checkpoint layout: the hybrids' first config goes through a sharded save
    sharded = name in ("bamba-attn-first-last", "nemotron-h", "mamba2-g1")
    path = save_checkpoint(hf, tmp_path_factory.mktemp(name), sharded=sharded)
    assert (path / "model.safetensors.index.json").is_file() == sharded
    return name, hf, load_pd(path)


def test_one_varlen_prefill_batch(pair) -> None:
    name, hf, model = pair
    lengths = [1, 9, 16, 53, 33]
    prompts = [_tokens(n, seed=i) for i, n in enumerate(lengths)]
    runner = StepRunner(model, num_slots=8, num_blocks=64, block_size=4)
    for i in range(len(prompts)):
        runner.add(f"s{i}", slot=7 - i)
    outs = runner.step([(f"s{i}", p, False) for i, p in enumerate(prompts)])
    for p, got in zip(prompts, outs, strict=True):
        want = hf_logits(hf, p)
        assert got.shape == want.shape
        err = rel_err(got, want)
        assert err.max() < TOL, f"{name}: len {len(p)}: worst position {int(err.argmax())} rel err {err.max():.2e}"


# (seq, number of new tokens, as_decode) per step; starts mid-chunk, several sequences per step,
# decode-only, prefill-only and mixed batches, a prefill chunk continuing after decode steps
SCHEDULE: list[list[tuple[str, int, bool]]] = [
    [("a", 5, False), ("b", 20, False)],
    [("a", 18, False), ("b", 11, False), ("c", 1, False)],
    [("c", 1, True), ("b", 6, False), ("d", 9, False)],
    [("a", 1, True), ("c", 1, True), ("b", 1, True), ("d", 1, True)],
    [("b", 1, True), ("d", 13, False), ("a", 1, True)],
    [("a", 1, True), ("c", 1, True), ("d", 1, True), ("b", 3, False)],
    [("d", 1, True), ("b", 1, True)],
]


def test_chunked_prefill_then_mixed_decode(pair) -> None:
    """Reference: transformers fed the same chunks per sequence through its cache (its decode step
    for one-token steps). Rows must also equal the full-sequence forward, except, when the model's
    dt limit is active, from a sequence's first decode step on (transformers' decode step does not
    clamp dt, so its state departs from the all-clamped full forward)."""
    name, hf, model = pair
    totals: dict[str, int] = {}
    for step in SCHEDULE:
        for seq, n, _ in step:
            totals[seq] = totals.get(seq, 0) + n
    tokens = {seq: _tokens(n, seed=100 + i) for i, (seq, n) in enumerate(sorted(totals.items()))}
    full = {seq: hf_logits(hf, toks) for seq, toks in tokens.items()}
    incremental = {seq: HFIncremental(hf) for seq in tokens}
    limit_active = model.config.time_step_limit != (0.0, math.inf)

    runner = StepRunner(model, num_slots=6, num_blocks=48, block_size=4, seed=1)
    for seq, slot in zip("abcd", (4, 0, 5, 2), strict=True):
        runner.add(seq, slot)
    done = dict.fromkeys(tokens, 0)
    decoded: set[str] = set()
    for k, step in enumerate(SCHEDULE):
        items = [(seq, tokens[seq][done[seq]:done[seq] + n], dec) for seq, n, dec in step]
        outs = runner.step(items)
        for (seq, toks, dec), got in zip(items, outs, strict=True):
            where = f"{name}: step {k} seq {seq} ({'decode' if dec else 'prefill'} at {done[seq]})"
            err = rel_err(got, incremental[seq].step(toks))
            assert err.max() < TOL, f"{where}: vs transformers incremental, rel err {err.max():.2e}"
            if dec:
                decoded.add(seq)
            if not (limit_active and seq in decoded):
                err = rel_err(got, full[seq][done[seq]:done[seq] + len(toks)])
                assert err.max() < TOL, f"{where}: vs transformers full forward, rel err {err.max():.2e}"
            done[seq] += len(toks)
