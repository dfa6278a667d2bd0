"""The block boundary finished by the mixer, the next norm left pending (kernels/pending_norm.py,
layers/mixer2.py PendingBlock), gives what the plain path gives.

The Triton backend takes it in decode steps of up to 32 rows on CUDA (`pending_norm_triton`); the
torch backend never does. Here the torch kernels are told to take it at up to two rows (their
references implement every piece), so the model's plumbing runs on CPU: a Mamba2 model with one
group prefills a few sequences, decodes one of them alone for a few steps, then two, then three,
once with the pending norm and once without, from identical pools. Logits and pools agree to fp32
rounding; in the steps of one and two rows every block but the last hands the next a PendingNorm,
and the prefill and the three-row step never do.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
from harness import StepRunner, make_hf_model, save_checkpoint

from pd_ssm.kernels.dispatch import get_kernels
from pd_ssm.kernels.pending_norm import PendingNorm
from pd_ssm.layers import mixer2
from pd_ssm.models.loader import load_model


def _two_rows(g: torch.Tensor, weight: torch.Tensor) -> bool:
    return g.shape[0] <= 2


def _run(model: torch.nn.Module) -> tuple[list[torch.Tensor], StepRunner]:
    runner = StepRunner(model, num_slots=6, num_blocks=256, seed=3)  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(5)
    for i in range(3):
        runner.add(f"s{i}", slot=i + 1)
    prompts = [torch.randint(0, 384, (4 + i,), generator=g).tolist() for i in range(3)]
    out = runner.step([(f"s{i}", p, False) for i, p in enumerate(prompts)])
    for t in range(4):
        out += runner.step([("s1", [9 + t], True)])  # one decode row: the pending norm's step
    out += runner.step([("s0", [3], True), ("s2", [4], True)])
    out += runner.step([("s0", [5], True), ("s1", [6], True), ("s2", [7], True)])  # three: the plain path
    return out, runner


def test_pending_and_plain_boundaries_agree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = save_checkpoint(make_hf_model("mamba2-g1"), tmp_path / "m")
    kernels = get_kernels("torch", "cpu")
    plain_model = load_model(path, device="cpu", dtype=torch.float32, kernels=kernels)
    pending_model = load_model(path, device="cpu", dtype=torch.float32,
                               kernels=dataclasses.replace(kernels, pending_norm=_two_rows))
    assert not kernels.pending_norm(torch.zeros(1, 4), torch.zeros(4, 4))  # the torch backend never does
    kinds: list[str] = []
    inner = mixer2.Mamba2Mixer.forward

    def spy(self: mixer2.Mamba2Mixer, hidden: object, *a: object) -> object:
        out = inner(self, hidden, *a)  # type: ignore[arg-type]
        kinds.append(("pending in " if isinstance(hidden, PendingNorm) else "")
                     + type(out).__name__)
        return out

    monkeypatch.setattr(mixer2.Mamba2Mixer, "forward", spy)
    pending, rp = _run(copy.deepcopy(pending_model))
    layers = len(pending_model.backbone.layers)  # type: ignore[union-attr]
    chained = ["PendingBlock"] + ["pending in PendingBlock"] * (layers - 2) + ["pending in ScaledDelta"]
    assert kinds == ["ScaledDelta"] * layers + chained * 5 + ["ScaledDelta"] * layers
    kinds.clear()
    plain, rq = _run(copy.deepcopy(plain_model))
    assert "PendingBlock" not in kinds
    for a, b in zip(pending, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rp.pool.ssm_state, rq.pool.ssm_state, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rp.pool.conv_state, rq.pool.conv_state, rtol=1e-5, atol=1e-5)
    # NOTE: not bit-equal: the pending norm's scale multiplies in_proj's sums instead of its input
    assert not all(torch.equal(a, b) for a, b in zip(pending[3:9], plain[3:9], strict=True))

