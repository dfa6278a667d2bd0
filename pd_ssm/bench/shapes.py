"""Real model shapes for the benchmarks, as transformers config dicts: `pd-ssm bench engine --shape`
builds one with dummy weights (random values of the real sizes), so no checkpoint is downloaded.

Each dict carries only what shapes the model and its numerics (names as in the checkpoints'
config.json); the tests check the parameter counts that the model cards publish.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# state-spaces/mamba2-2.7b: 64 Mamba2 blocks, 2.70 G parameters (TARGETS.md's model)
MAMBA2_2_7B: dict[str, Any] = {
    "architectures": ["Mamba2ForCausalLM"],
    "model_type": "mamba2",
    "hidden_size": 2560,
    "num_hidden_layers": 64,
    "num_heads": 80,
    "head_dim": 64,
    "expand": 2,
    "state_size": 128,
    "n_groups": 1,
    "chunk_size": 256,
    "conv_kernel": 4,
    "vocab_size": 50288,
    "tie_word_embeddings": True,
    "residual_in_fp32": True,
    "use_bias": False,
    "use_conv_bias": True,
    "layer_norm_epsilon": 1e-5,
    "hidden_act": "silu",
    "bos_token_id": 0,
    "eos_token_id": 0,
    "pad_token_id": 0,
    "dtype": "bfloat16",
}

# ibm-ai-platform/Bamba-9B: 32 layers, attention at 9, 18 and 27, a SwiGLU FFN after every mixer;
# 9.78 G parameters, untied embeddings (model card)
BAMBA_9B: dict[str, Any] = {
    "architectures": ["BambaForCausalLM"],
    "model_type": "bamba",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "attn_layer_indices": [9, 18, 27],
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "hidden_act": "silu",
    "mamba_n_heads": 128,
    "mamba_d_head": 64,
    "mamba_d_state": 128,
    "mamba_n_groups": 1,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 256,
    "mamba_conv_bias": True,
    "mamba_proj_bias": False,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 262144,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "pad_token_id": 0,
    "dtype": "bfloat16",
}

# nvidia/Nemotron-H-8B-Base-8K: 52 blocks, one mixer each (24 Mamba2, 4 attention, 24 relu2 MLPs),
# 8 groups of B / C; 8.10 G parameters, untied embeddings
NEMOTRON_H_8B: dict[str, Any] = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "hidden_size": 4096,
    "num_hidden_layers": 52,
    "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 21504,
    "mlp_hidden_act": "relu2",
    "mamba_num_heads": 128,
    "mamba_head_dim": 64,
    "ssm_state_size": 128,
    "n_groups": 8,
    "expand": 2,
    "conv_kernel": 4,
    "chunk_size": 128,
    "use_conv_bias": True,
    "use_bias": False,
    "mamba_hidden_act": "silu",
    "time_step_min": 0.001,
    "layer_norm_epsilon": 1e-5,
    "max_position_embeddings": 8192,
    "vocab_size": 131072,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "dtype": "bfloat16",
}

SHAPES: dict[str, dict[str, Any]] = {
    "mamba2-2.7b": MAMBA2_2_7B,
    "bamba-9b": BAMBA_9B,
    "nemotron-h-8b": NEMOTRON_H_8B,
}
DEFAULT_SHAPE = "mamba2-2.7b"


def write_shape(shape: str, model_dir: str | Path) -> str:
    """Make `model_dir` a checkpoint directory of `shape` with no weights (its config.json alone):
    what `--load-format dummy` loads. Returns the directory as a string."""
    path = Path(model_dir)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(SHAPES[shape]))
    return str(path)
