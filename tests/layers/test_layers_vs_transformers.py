"""The stateless layers against the transformers modules they stand in for (same weights, same inputs)."""

from __future__ import annotations

import pytest
import torch
from transformers import BambaConfig, NemotronHConfig
from transformers.models.bamba import modeling_bamba as hf_bamba
from transformers.models.mamba2 import modeling_mamba2 as hf_mamba2
from transformers.models.nemotron_h import modeling_nemotron_h as hf_nemotron

from pd_ssm.kernels.dispatch import get_kernels
from pd_ssm.layers import MLP, GatedMLP, GatedRMSNorm, RMSNorm, RotaryEmbedding
from pd_ssm.layers.mixer2 import conv1d_weight_from_hf
from pd_ssm.layers.mlp import check_activation
from pd_ssm.models.bamba import GATE_UP_STACK
from pd_ssm.models.weights import load_named_weights, stacked_name

K = get_kernels("torch", "cpu")


def _randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nemotron", [False, True])
def test_rms_norm(dtype: torch.dtype, nemotron: bool) -> None:
    hf = (hf_nemotron.NemotronHRMSNorm if nemotron else hf_mamba2.Mamba2RMSNorm)(48, eps=1e-5).to(dtype)
    ours = RMSNorm(48, 1e-5, K, weight_in_fp32=nemotron).to(dtype)
    w = 1 + 0.3 * _randn(48, seed=1)
    for m in (hf, ours):
        m.weight.data.copy_(w)
    x = 3 * _randn(10, 48, seed=2, dtype=dtype)
    torch.testing.assert_close(ours(x), hf(x), rtol=0, atol=0)


def test_rms_norm_fp32_input_bf16_weight_matches_mamba2_norm_f() -> None:
    """Mamba2's residual_in_fp32 stream reaches norm_f in fp32 while the weight is bf16."""
    hf = hf_mamba2.Mamba2RMSNorm(32, eps=1e-5).to(torch.bfloat16)
    ours = RMSNorm(32, 1e-5, K).to(torch.bfloat16)
    w = 1 + 0.3 * _randn(32, seed=1)
    for m in (hf, ours):
        m.weight.data.copy_(w)
    x = _randn(6, 32, seed=3)
    got, want = ours(x), hf(x)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("n_groups", [1, 2, 4])
def test_gated_rms_norm_is_grouped_like_hf(n_groups: int) -> None:
    d = 64
    hf = hf_mamba2.MambaRMSNormGated(d, group_size=d // n_groups, eps=1e-5)
    ours = GatedRMSNorm(d, 1e-5, d // n_groups, K)
    w = 1 + 0.3 * _randn(d, seed=4)
    for m in (hf, ours):
        m.weight.data.copy_(w)
    x, z = _randn(9, d, seed=5), _randn(9, d, seed=6)
    torch.testing.assert_close(ours(x, z), hf(x, z), rtol=1e-6, atol=1e-6)


def test_partial_rotary_matches_bamba() -> None:
    cfg = BambaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, rope_parameters={"rope_theta": 500.0})
    head_dim = 16
    hf_rope = hf_bamba.BambaRotaryEmbedding(cfg)
    ours = RotaryEmbedding(head_dim, int(head_dim * 0.5), 500.0)
    assert torch.equal(ours.inv_freq, hf_rope.inv_freq)
    positions = torch.tensor([0, 1, 2, 17, 5, 300, 4095])
    q, k = _randn(7, 4, head_dim, seed=7), _randn(7, 2, head_dim, seed=8)
    cos, sin = hf_rope(q, positions[None])
    hq, hk = hf_bamba.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    oq, ok = ours(positions, q, k)
    torch.testing.assert_close(oq, hq[0].transpose(0, 1), rtol=0, atol=0)
    torch.testing.assert_close(ok, hk[0].transpose(0, 1), rtol=0, atol=0)
    assert torch.equal(oq[..., 8:], q[..., 8:])  # the pass-through half is untouched


def test_gated_mlp_matches_bamba_mlp() -> None:
    cfg = BambaConfig(hidden_size=32, intermediate_size=48, mamba_n_heads=4)
    hf = hf_bamba.BambaMLP(cfg)
    ours = GatedMLP(32, 48, K, act="silu")
    # the checkpoint's gate_proj and up_proj fill the halves of the stacked gate_up_proj
    filled = load_named_weights(ours, hf.state_dict().items(), lambda n: stacked_name(n, GATE_UP_STACK), "Bamba")
    assert filled == {"gate_up_proj.weight", "down_proj.weight"}
    x = _randn(5, 32, seed=9)
    # NOTE: one [2 I, K] matmul may sum K in another order than two [I, K] ones: an fp32 ulp or so
    torch.testing.assert_close(ours(x), hf(x), rtol=1e-6, atol=1e-7)


def test_relu2_mlp_matches_nemotron_h_mlp() -> None:
    cfg = NemotronHConfig(hidden_size=32, intermediate_size=40, mlp_bias=True, layers_block_type=["mlp"])
    hf = hf_nemotron.NemotronHMLP(cfg)
    ours = MLP(32, 40, K, act="relu2", bias=True)
    ours.load_state_dict(hf.state_dict())
    x = _randn(5, 32, seed=10)
    torch.testing.assert_close(ours(x), hf(x), rtol=0, atol=0)


def test_unknown_activation_is_an_error() -> None:
    with pytest.raises(ValueError, match="relu2"):
        check_activation("swiglu_plus")


def test_conv1d_weight_layout() -> None:
    w = _randn(12, 1, 4, seed=11)
    assert torch.equal(conv1d_weight_from_hf(w), w[:, 0, :])
    assert conv1d_weight_from_hf(w[:, 0, :]).shape == (12, 4)
