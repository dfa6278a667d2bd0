"""ModelConfig normalizations that follow what transformers does rather than what the file says."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from harness import StepRunner, hf_logits, load_pd, rel_err
from transformers import NemotronHConfig, NemotronHForCausalLM

from pd_ssm.config import ModelConfig


def _nemotron(**kw) -> dict:
    base = dict(architectures=["NemotronHForCausalLM"], vocab_size=100, hidden_size=64, mamba_num_heads=8,
                mamba_head_dim=16, ssm_state_size=16, layers_block_type=["mamba", "attention"])
    return {**base, **kw}


def test_nemotron_h_quirks() -> None:
    cfg = ModelConfig.from_hf_dict(_nemotron(
        time_step_min=0.01, time_step_limit=[0.0, 0.5], use_bias=True, mamba_proj_bias=False,
        residual_in_fp32=True, tie_word_embeddings=True, attention_bias=True, num_attention_heads=16,
    ))
    assert cfg.time_step_limit == (0.01, math.inf)  # the mixer clamps at time_step_min, not the limit
    assert cfg.mamba_proj_bias is True  # in_proj / out_proj follow use_bias
    assert cfg.residual_in_fp32 is False and cfg.tie_word_embeddings is False and cfg.attention_bias is False
    assert cfg.attn_head_dim == 128 and cfg.num_kv_heads == 8  # NemotronHConfig defaults, not hidden // heads
    legacy = ModelConfig.from_hf_dict(_nemotron(n_groups=4, mamba_n_groups=2, mamba_dt_min=0.02))
    assert legacy.mamba_n_groups == 2 and legacy.time_step_limit[0] == 0.02  # the mamba_* spelling wins


def test_bamba_head_dim_from_file() -> None:
    hf = dict(architectures=["BambaForCausalLM"], vocab_size=100, hidden_size=64, num_hidden_layers=2,
              attn_layer_indices=[1], num_attention_heads=8, mamba_n_heads=8, mamba_d_state=16,
              intermediate_size=96)
    assert ModelConfig.from_hf_dict(hf).attn_head_dim == 8
    assert ModelConfig.from_hf_dict(hf).num_kv_heads == 8  # BambaConfig's default
    assert ModelConfig.from_hf_dict({**hf, "head_dim": 32}).attn_head_dim == 32
    assert ModelConfig.from_hf_dict(hf).rotary_dim == 4


def test_nemotron_h_never_ties_its_head(tmp_path: Path) -> None:
    config = NemotronHConfig(
        hidden_size=64, layers_block_type=["linear_attention", "mlp"], mamba_num_heads=8, mamba_head_dim=16,
        ssm_state_size=16, n_groups=2, chunk_size=16, vocab_size=128, intermediate_size=96,
        tie_word_embeddings=True, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    )
    torch.manual_seed(0)
    hf = NemotronHForCausalLM(config).eval()
    assert hf.lm_head.weight is not hf.model.embeddings.weight
    hf.save_pretrained(tmp_path)
    model = load_pd(tmp_path)
    runner = StepRunner(model)
    runner.add("x", slot=0)
    prompt = list(range(3, 24))
    assert rel_err(runner.step([("x", prompt, False)])[0], hf_logits(hf, prompt)).max() < 1e-4
