"""Triton RMSNorm / gated grouped RMSNorm against the pure-torch references.

On CPU the kernel runs in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET), on tiny
shapes; with CUDA the same checks run at model sizes.
"""

from __future__ import annotations

import pytest
import torch
from kernel_oracles import gen
from torch import Tensor

from pd_ssm.kernels import rmsnorm_triton
from pd_ssm.kernels.rmsnorm import rms_norm_gated_ref, rms_norm_ref
from pd_ssm.kernels.rmsnorm_triton import rms_norm_gated_triton, rms_norm_triton

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
T, D = (37, 2560) if CUDA else (5, 48)


def assert_norm_close(out: Tensor, ref: Tensor) -> None:
    """fp32: a few ulp. bf16/fp16: the fp32 normalized values agree to ~1e-6, so the rounded ones
    differ by at most one ulp, and only where a value sits on a rounding boundary. (Triton 3.6's
    interpreter truncates fp32 -> bf16 instead of rounding to nearest: there about half the bf16
    values are one ulp off, so the rare-mismatch check runs on the GPU only.)"""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        return
    ulp = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}[out.dtype]
    # two roundings (normalized value, then product) can each flip: two ulp of the output at most
    torch.testing.assert_close(out, ref, rtol=2 * ulp, atol=1e-6)
    if CUDA or out.dtype != torch.bfloat16:
        assert (out != ref).float().mean().item() < 0.05


def rand(g: torch.Generator, *shape: int, dtype: torch.dtype, scale: float = 1.0) -> Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEV)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("weight_in_fp32", [False, True])
def test_rms_norm_matches_ref(dtype: torch.dtype, weight_in_fp32: bool) -> None:
    g = gen(1)
    x = rand(g, T, D, dtype=dtype, scale=3.0)
    w = (1 + 0.2 * torch.randn(D, generator=g)).to(dtype).to(DEV)
    out = rms_norm_triton(x, w, 1e-5, weight_in_fp32=weight_in_fp32)
    assert_norm_close(out, rms_norm_ref(x, w, 1e-5, weight_in_fp32=weight_in_fp32))


@pytest.mark.parametrize("dtype,gate_dtype", [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("groups", [1, 4])
def test_gated_matches_ref(dtype: torch.dtype, gate_dtype: torch.dtype, groups: int) -> None:
    g = gen(2)
    x = rand(g, T, D, dtype=dtype)
    gate = rand(g, T, D, dtype=gate_dtype, scale=2.0)
    w = (1 + 0.2 * torch.randn(D, generator=g)).to(dtype).to(DEV)
    out = rms_norm_gated_triton(x, gate, w, 1e-6, D // groups)
    assert_norm_close(out, rms_norm_gated_ref(x, gate, w, 1e-6, D // groups))


def test_strided_rows_and_groups_longer_than_a_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows of a wider tensor (x and gate as views of one projection); groups split into chunks."""
    monkeypatch.setattr(rmsnorm_triton, "MAX_BLOCK", 16)
    g = gen(3)
    proj = rand(g, T, 2 * D + 3, dtype=torch.float32)
    x, gate = proj[:, :D], proj[:, D + 3:]
    w = (1 + 0.2 * torch.randn(D, generator=g)).to(DEV)
    assert_norm_close(rms_norm_gated_triton(x, gate, w, 1e-6, D // 2),
                      rms_norm_gated_ref(x, gate, w, 1e-6, D // 2))
    assert_norm_close(rms_norm_triton(x, w, 1e-6, weight_in_fp32=True),
                      rms_norm_ref(x, w, 1e-6, weight_in_fp32=True))


def test_rejects_bad_arguments_like_the_ref() -> None:
    g = gen(4)
    x = torch.randn(3, 8, generator=g)
    with pytest.raises(ValueError, match="weight must be one of"):
        rms_norm_triton(x, torch.randn(8, generator=g).double(), 1e-6)
    with pytest.raises(ValueError, match="multiple of group_size"):
        rms_norm_gated_triton(x, x, torch.randn(8, generator=g), 1e-6, 3)
