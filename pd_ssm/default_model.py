"""The embedded default model, and a tiny random one for tests.

`default_model_dir()`: the checkpoint that ships inside the package (`pd_ssm/assets/default_model`):
an 8 M-parameter Bamba hybrid (Mamba2 layers + two attention layers) trained by the project on the
Python standard library's sources (scripts/train_default_model.py, docs/default_model.md), so the
quick start answers with plausible Python without a download.  Byte-level: no tokenizer file, the
ByteTokenizer applies.

`random_model_dir()`: a smaller Bamba-style hybrid with random weights, written deterministically
(fixed seed, HF initialization) into the cache directory on first use.  Its text is noise; it runs
every code path of a hybrid (Mamba2 layers, one attention layer, SwiGLU MLPs) at a fraction of the
trained model's cost, which is what the serving tests need.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

NAME = "bamba-tiny-random-v1"
SEED = 20261129

CONFIG: dict[str, Any] = {
    "architectures": ["BambaForCausalLM"],
    "model_type": "bamba",
    "vocab_size": 512,  # byte tokenizer: ids 3..258 are bytes, 0..2 pad/bos/eos
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "attn_layer_indices": [2],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "mamba_n_heads": 8,
    "mamba_d_head": 32,
    "mamba_n_groups": 1,
    "mamba_d_state": 32,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 64,
    "mamba_conv_bias": True,
    "mamba_proj_bias": False,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "time_step_limit": [0.0, {"__float__": "Infinity"}],
    "dtype": "float32",
}


def cache_root() -> Path:
    root = os.environ.get("PD_SSM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "pd_ssm")
    return Path(root)


TRAINED_DIR = Path(__file__).resolve().parent / "assets" / "default_model"


def default_model_dir() -> Path:
    """The trained checkpoint shipped with pd_ssm (read-only: it lives in the package)."""
    if not (TRAINED_DIR / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"the embedded default model is missing from {TRAINED_DIR} (a broken install?); reinstall pd_ssm, "
            "or pass --model DIR"
        )
    return TRAINED_DIR


def random_model_dir() -> Path:
    """The tiny random checkpoint's directory, written on first use (atomic: safe under races)."""
    target = cache_root() / NAME
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{NAME}-", dir=target.parent))
    try:
        write_checkpoint(tmp)
        try:
            os.replace(tmp, target)
        except OSError:  # another process won the race: its copy is identical
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def write_checkpoint(path: Path) -> None:
    c = CONFIG
    g = torch.Generator().manual_seed(SEED)
    d, ff, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    nh, hd, ds, ng = c["mamba_n_heads"], c["mamba_d_head"], c["mamba_d_state"], c["mamba_n_groups"]
    d_inner = nh * hd
    conv_dim = d_inner + 2 * ng * ds
    heads, kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
    head_dim = d // heads

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    def uniform(lo: float, hi: float, *shape: int) -> torch.Tensor:
        return lo + (hi - lo) * torch.rand(*shape, generator=g)

    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(v, d)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = torch.ones(d)
        t[p + "pre_ff_layernorm.weight"] = torch.ones(d)
        t[p + "feed_forward.gate_proj.weight"] = normal(ff, d)
        t[p + "feed_forward.up_proj.weight"] = normal(ff, d)
        t[p + "feed_forward.down_proj.weight"] = normal(d, ff)
        if i in c["attn_layer_indices"]:
            t[p + "self_attn.q_proj.weight"] = normal(heads * head_dim, d)
            t[p + "self_attn.k_proj.weight"] = normal(kv_heads * head_dim, d)
            t[p + "self_attn.v_proj.weight"] = normal(kv_heads * head_dim, d)
            t[p + "self_attn.o_proj.weight"] = normal(d, heads * head_dim)
            continue
        m = p + "mamba."
        dt = torch.exp(uniform(math.log(1e-3), math.log(1e-1), nh)).clamp(min=1e-4)
        t[m + "dt_bias"] = dt + torch.log(-torch.expm1(-dt))  # inverse softplus
        t[m + "A_log"] = torch.log(uniform(1.0, 16.0, nh))
        t[m + "D"] = torch.ones(nh)
        bound = 1.0 / math.sqrt(c["mamba_d_conv"])
        t[m + "conv1d.weight"] = uniform(-bound, bound, conv_dim, 1, c["mamba_d_conv"])
        t[m + "conv1d.bias"] = uniform(-bound, bound, conv_dim)
        t[m + "in_proj.weight"] = normal(2 * d_inner + 2 * ng * ds + nh, d)
        t[m + "norm.weight"] = torch.ones(d_inner)
        t[m + "out_proj.weight"] = normal(d, d_inner)
    t["model.final_layernorm.weight"] = torch.ones(d)
    t["lm_head.weight"] = normal(v, d)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: x.contiguous() for k, x in t.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
    with open(path / "config.json", "w") as f:
        json.dump(c, f, indent=2)
