"""The deferred gated-norm scale (layers/mixer2.py, ScaledDelta) gives what the plain path gives.

A Mamba2 model with one group (ungrouped gated norm: the deferred path applies) runs the same
steps -- a prefill of many sequences, a decode step of all of them, a mixed step of decodes and
prefill chunks -- once with every step deferred and once with none (the threshold moved), from
identical pools: logits and both pools agree to fp32 rounding. A model with groups never defers.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from harness import StepRunner, load_pd, make_hf_model, save_checkpoint

from pd_ssm.layers import mixer2
from pd_ssm.layers.norm import ScaledDelta

SEQS = 36  # more decode rows than the threshold test_the_mixer_defers_only_where_it_may sets


def _run(model: torch.nn.Module, threshold: int, monkeypatch: pytest.MonkeyPatch) -> tuple[list[torch.Tensor], StepRunner]:
    monkeypatch.setattr(mixer2, "DEFER_BELOW_DECODE_ROWS", threshold)
    runner = StepRunner(model, num_slots=SEQS + 2, num_blocks=512, seed=3)  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(5)
    for i in range(SEQS):
        runner.add(f"s{i}", slot=i)
    out: list[torch.Tensor] = []
    prompts = [torch.randint(0, 384, (3 + i % 5,), generator=g).tolist() for i in range(SEQS)]
    out += runner.step([(f"s{i}", p, False) for i, p in enumerate(prompts)])  # prefill only
    out += runner.step([(f"s{i}", [7 + i], True) for i in range(SEQS)])  # 36 decodes
    out += runner.step([(f"s{i}", [11 + i], True) for i in range(5)]  # a mixed step: 5 decodes ...
                       + [(f"s{i}", [1, 2, 3, 4, 5, 6], False) for i in range(5, 9)])  # ... and 4 chunks
    return out, runner


def test_deferred_and_plain_paths_agree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = load_pd(save_checkpoint(make_hf_model("mamba2-g1"), tmp_path / "m"))
    assert all(layer.mixer.defer_norm_scale for layer in model.backbone.layers)
    deferred, rd = _run(copy.deepcopy(model), 10_000, monkeypatch)
    plain, rp = _run(copy.deepcopy(model), 0, monkeypatch)
    for a, b in zip(deferred, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # NOTE: not bit-equal past layer 0: r is applied after out_proj instead of before (fp32 rounding),
    # and every later layer's input, hence its conv history, carries that
    torch.testing.assert_close(rd.pool.ssm_state, rp.pool.ssm_state, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rd.pool.conv_state, rp.pool.conv_state, rtol=1e-5, atol=1e-5)
    assert not torch.equal(deferred[1], plain[1])  # the two paths really differed in how they computed


def test_the_mixer_defers_only_where_it_may(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    grouped = load_pd(save_checkpoint(make_hf_model("mamba2-g2-tied-dtlimit"), tmp_path / "g"))
    assert not any(layer.mixer.defer_norm_scale for layer in grouped.backbone.layers)  # grouped norm
    model = load_pd(save_checkpoint(make_hf_model("mamba2-g1"), tmp_path / "m"))
    kinds: list[bool] = []
    inner = mixer2.Mamba2Mixer.forward

    def spy(self: mixer2.Mamba2Mixer, *a: object) -> object:
        out = inner(self, *a)  # type: ignore[arg-type]
        kinds.append(isinstance(out, ScaledDelta))
        return out

    monkeypatch.setattr(mixer2.Mamba2Mixer, "forward", spy)
    _run(model, 32, monkeypatch)  # the mechanism, at a threshold between the steps' decode rows
    layers = len(model.backbone.layers)
    # prefill only and the mixed step (5 decodes) defer; the 36-row decode step does not
    assert kinds == [True] * layers + [False] * layers + [True] * layers
