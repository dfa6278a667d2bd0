"""The fused residual add + RMSNorm of a pre-norm block.

The reference must be bit-identical to the unfused ops it replaced in the models (on CPU); the
Triton kernel (Triton's interpreter on CPU, tiny shapes) must match the reference.
"""

from __future__ import annotations

import pytest
import torch
from kernel_oracles import gen
from torch import Tensor

from pd_ssm.kernels import rmsnorm_triton
from pd_ssm.kernels.rmsnorm import add_rms_norm_ref, rms_norm_ref
from pd_ssm.kernels.rmsnorm_triton import add_rms_norm_triton

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
T, D = (37, 2560) if CUDA else (5, 48)
BF16 = torch.bfloat16
F32 = torch.float32


def rand(g: torch.Generator, *shape: int, dtype: torch.dtype, scale: float = 1.0) -> Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def unfused(x: Tensor | None, residual: Tensor, weight: Tensor, eps: float,
            residual_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The ops of the blocks before the fusion: upcast the stream, add, cast to the norm's dtype."""
    r = residual.float() if residual_dtype == F32 else residual
    if x is not None:
        r = r + x
    return rms_norm_ref(r.to(weight.dtype), weight, eps), r


# (activation dtype, residual dtype): Mamba2's residual_in_fp32 in bf16 and fp32, and the
# activation-dtype residual of Bamba / NemotronH / Mamba2 without residual_in_fp32
CASES = [(BF16, F32), (F32, F32), (BF16, BF16)]


@pytest.mark.parametrize("act,res", CASES)
@pytest.mark.parametrize("first", [False, True])
def test_ref_is_the_unfused_composition_bit_exact(act: torch.dtype, res: torch.dtype, first: bool) -> None:
    g = gen(1)
    # before the first block the stream is the embedding output, in the activation dtype
    residual = rand(g, T, D, dtype=act if first else res, scale=3.0)
    x = None if first else rand(g, T, D, dtype=act)
    w = (1 + 0.2 * torch.randn(D, generator=g)).to(act)
    normed, new_res = add_rms_norm_ref(x, residual, w, 1e-5, residual_dtype=res)
    want_normed, want_res = unfused(x, residual, w, 1e-5, res)
    assert normed.dtype == act and new_res.dtype == res
    assert torch.equal(normed, want_normed) and torch.equal(new_res, want_res)


def test_ref_final_norm_in_the_stream_dtype() -> None:
    """Mamba2's norm_f: an fp32 stream with the bf16 weight upcast (today's RMSNorm on fp32 x)."""
    g = gen(2)
    residual, x = rand(g, T, D, dtype=F32), rand(g, T, D, dtype=BF16)
    w = (1 + 0.2 * torch.randn(D, generator=g)).to(BF16).float()
    normed, _ = add_rms_norm_ref(x, residual, w, 1e-5, residual_dtype=F32)
    assert torch.equal(normed, rms_norm_ref(residual + x, w, 1e-5))


def assert_close_ulp(out: Tensor, ref: Tensor, ulps: int) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if out.dtype == F32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    else:
        # NOTE: Triton 3.6's interpreter truncates fp32 -> bf16 rather than rounding to nearest
        torch.testing.assert_close(out.float(), ref.float(), rtol=ulps * 2.0**-7, atol=1e-6)


@pytest.mark.parametrize("act,res", CASES)
@pytest.mark.parametrize("first", [False, True])
@pytest.mark.parametrize("weight_in_fp32", [False, True])
def test_triton_matches_ref(act: torch.dtype, res: torch.dtype, first: bool, weight_in_fp32: bool) -> None:
    g = gen(3)
    residual = rand(g, T, D, dtype=act if first else res, scale=3.0).to(DEV)
    x = None if first else rand(g, T, D, dtype=act).to(DEV)
    w = (1 + 0.2 * torch.randn(D, generator=g)).to(act).to(DEV)
    kw = {"residual_dtype": res, "weight_in_fp32": weight_in_fp32}
    normed, new_res = add_rms_norm_triton(x, residual, w, 1e-5, **kw)
    assert_close_ulp(new_res, add_rms_norm_ref(x, residual, w, 1e-5, **kw).residual, 1)
    # the norm of the kernel's own residual (a one-ulp difference there would carry through):
    # two roundings (the normalized value, the product) can each flip
    assert_close_ulp(normed, add_rms_norm_ref(None, new_res, w, 1e-5, **kw).normed, 2)


def test_triton_strided_rows_longer_than_a_block(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rmsnorm_triton, "MAX_BLOCK", 16)
    g = gen(4)
    proj = rand(g, T, 2 * D + 3, dtype=F32).to(DEV)
    x, residual = proj[:, :D], proj[:, D + 3:]
    w = (1 + 0.2 * torch.randn(D, generator=g)).to(DEV)
    out = add_rms_norm_triton(x, residual, w, 1e-6, residual_dtype=F32)
    want = add_rms_norm_ref(x, residual, w, 1e-6, residual_dtype=F32)
    assert_close_ulp(out.residual, want.residual, 1)
    assert_close_ulp(out.normed, want.normed, 1)


def test_empty_and_bad_arguments() -> None:
    w = torch.ones(8)
    out = add_rms_norm_triton(None, torch.empty(0, 8), w, 1e-6, residual_dtype=F32)
    assert out.normed.shape == out.residual.shape == (0, 8)
    for fn in (add_rms_norm_ref, add_rms_norm_triton):
        with pytest.raises(ValueError, match="x"):
            fn(torch.ones(3, 4), torch.ones(3, 8), w, 1e-6, residual_dtype=F32)
        with pytest.raises(ValueError, match="weight"):
            fn(None, torch.ones(3, 8), torch.ones(4), 1e-6, residual_dtype=F32)
