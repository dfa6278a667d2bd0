"""rms_norm_ref / rms_norm_gated_ref against the HF modules and a float64 formula."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_oracles import assert_close, gen
from transformers.models.mamba2.modeling_mamba2 import Mamba2RMSNorm, MambaRMSNormGated
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHRMSNorm

from pd_ssm.kernels.rmsnorm import rms_norm_gated_ref, rms_norm_ref
from tests.conftest import needs_reference_transformers

T, D, EPS = 7, 24, 1e-5
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_equals_hf(dtype: torch.dtype) -> None:
    g = gen(1)
    x = (torch.randn(T, D, generator=g) * 3).to(dtype)
    hf = Mamba2RMSNorm(D, eps=EPS).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(D, generator=g))
        expected = hf(x)
    out = rms_norm_ref(x, hf.weight.detach(), EPS)
    assert out.dtype == dtype
    assert torch.equal(out, expected)  # the same ops in the same order


@needs_reference_transformers
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_weight_in_fp32_equals_nemotron_h(dtype: torch.dtype) -> None:
    g = gen(2)
    x = (torch.randn(T, D, generator=g) * 3).to(dtype)
    hf = NemotronHRMSNorm(D, eps=EPS).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(D, generator=g))
        expected = hf(x)
    out = rms_norm_ref(x, hf.weight.detach(), EPS, weight_in_fp32=True)
    assert out.dtype == dtype
    assert torch.equal(out, expected)
    if dtype != torch.float32:  # the option must matter, or the test above proves nothing
        assert not torch.equal(out, rms_norm_ref(x, hf.weight.detach(), EPS))


def test_rms_norm_matches_float64_formula() -> None:
    g = gen(3)
    x, w = torch.randn(T, D, generator=g), torch.randn(D, generator=g)
    xd = x.double()
    expected = w.double() * xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + EPS)
    assert_close(rms_norm_ref(x, w, EPS), expected, 1e-6, 1e-6)


@needs_reference_transformers
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size", [D, D // 2, D // 4])
def test_rms_norm_gated_equals_hf(dtype: torch.dtype, group_size: int) -> None:
    g = gen(4 + group_size)
    x = (torch.randn(T, D, generator=g) * 2).to(dtype)
    gate = (torch.randn(T, D, generator=g) * 2).to(dtype)
    hf = MambaRMSNormGated(D, group_size=group_size, eps=EPS).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(D, generator=g))
        expected = hf(x, gate)
    out = rms_norm_gated_ref(x, gate, hf.weight.detach(), EPS, group_size)
    assert out.dtype == dtype
    assert torch.equal(out, expected)


def test_rms_norm_gated_groups_normalize_separately() -> None:
    g = gen(5)
    x, gate, w = torch.randn(T, D, generator=g), torch.randn(T, D, generator=g), torch.randn(D, generator=g)
    h = x.double() * F.silu(gate.double())
    expected = torch.cat([
        w.double()[a:a + 8] * h[:, a:a + 8] / torch.sqrt(h[:, a:a + 8].pow(2).mean(-1, keepdim=True) + EPS)
        for a in range(0, D, 8)
    ], dim=1)
    assert_close(rms_norm_gated_ref(x, gate, w, EPS, 8), expected, 1e-6, 1e-6)


def test_rejects_bad_arguments() -> None:
    g = gen(6)
    x, gate = torch.randn(T, D, generator=g), torch.randn(T, D, generator=g)
    with pytest.raises(ValueError, match="multiple of group_size"):
        rms_norm_gated_ref(x, gate, torch.randn(D, generator=g), EPS, 5)
    with pytest.raises(ValueError, match="weight must be one of"):
        rms_norm_ref(x, torch.randn(D, generator=g).to(torch.bfloat16), EPS)
    with pytest.raises(ValueError, match="x must be 2-D"):
        rms_norm_ref(x[None], torch.randn(D, generator=g), EPS)
