"""Translation of a HuggingFace `config.json` dict into `ModelConfig`, one parser per family.

It lives apart from `config.py` because the per-family quirks (field names, defaults, layer
patterns, what transformers ignores) are a concept of their own and the bulk of the code; the
dataclass and its validation stay small there.
"""

from __future__ import annotations

import math
from typing import Any

from pd_ssm.config import SUPPORTED_ARCHITECTURES, ConfigError, LayerKind, ModelConfig, parse_dtype


def model_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """The `ModelConfig` of a parsed `config.json`; raises `ConfigError` naming a missing field."""
    archs = hf.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ConfigError(
            f"unsupported architecture {archs or hf.get('model_type')!r}; "
            f"pd_ssm supports {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    parse = {
        "Mamba2ForCausalLM": _from_mamba2,
        "BambaForCausalLM": _from_bamba,
        "NemotronHForCausalLM": _from_nemotron_h,
    }[arch]
    try:
        return parse(hf)
    except KeyError as e:
        raise ConfigError(f"{arch} config.json lacks the field {e.args[0]!r}") from None


def _json_float(value: Any) -> float:
    # transformers >= 5 writes infinities as {"__float__": "Infinity"}; older files use bare Infinity.
    if isinstance(value, dict) and "__float__" in value:
        return float(value["__float__"])
    return float(value)


def _common(hf: dict[str, Any]) -> dict[str, Any]:
    eos = hf.get("eos_token_id")
    eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
    limit = hf.get("time_step_limit") or (0.0, math.inf)
    return dict(
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        eos_token_ids=eos_ids,
        bos_token_id=hf.get("bos_token_id"),
        pad_token_id=hf.get("pad_token_id"),
        dtype=parse_dtype(hf.get("dtype") or hf.get("torch_dtype") or "float32"),
        time_step_limit=(_json_float(limit[0]), _json_float(limit[1])),
        hf=hf,
    )


def _rope(hf: dict[str, Any]) -> tuple[float, float]:
    rope = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type not in (None, "default"):
        raise ConfigError(f"rope_type {rope_type!r} is not supported yet (only 'default')")
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    factor = float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    return theta, factor


def _from_mamba2(hf: dict[str, Any]) -> ModelConfig:
    hidden = int(hf["hidden_size"])
    expand = int(hf.get("expand", 2))
    num_heads = int(hf["num_heads"])
    head_dim = int(hf["head_dim"])
    if num_heads * head_dim != expand * hidden:
        raise ConfigError(
            f"Mamba2 num_heads * head_dim ({num_heads * head_dim}) != expand * hidden_size ({expand * hidden})"
        )
    return ModelConfig(
        architecture="Mamba2ForCausalLM",
        layer_kinds=["mamba"] * int(hf["num_hidden_layers"]),
        rms_norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        max_position_embeddings=None,
        residual_in_fp32=bool(hf.get("residual_in_fp32", True)),
        mamba_num_heads=num_heads,
        mamba_head_dim=head_dim,
        mamba_d_state=int(hf["state_size"]),
        mamba_n_groups=int(hf.get("n_groups", 8)),
        mamba_d_conv=int(hf.get("conv_kernel", 4)),
        mamba_chunk_size=int(hf.get("chunk_size", 256)),
        mamba_conv_bias=bool(hf.get("use_conv_bias", True)),
        mamba_proj_bias=bool(hf.get("use_bias", False)),
        **_common(hf),
    )


def _from_bamba(hf: dict[str, Any]) -> ModelConfig:
    hidden = int(hf["hidden_size"])
    n_layers = int(hf["num_hidden_layers"])
    attn = set(hf.get("attn_layer_indices") or [])
    if any(i < 0 or i >= n_layers for i in attn):
        raise ConfigError(f"attn_layer_indices {sorted(attn)} outside 0..{n_layers - 1}")
    n_heads = int(hf["mamba_n_heads"])
    d_head = hf.get("mamba_d_head", "auto")
    d_head = int(hf.get("mamba_expand", 2)) * hidden // n_heads if d_head == "auto" else int(d_head)
    theta, _ = _rope(hf)
    num_attn_heads = int(hf["num_attention_heads"])
    # transformers: BambaConfig.num_key_value_heads defaults to 8 when absent, None means MHA;
    # BambaAttention uses config.head_dim when the file has one, else hidden_size // heads
    num_kv = hf.get("num_key_value_heads", 8)
    head_dim = hf.get("head_dim") or hidden // num_attn_heads
    return ModelConfig(
        architecture="BambaForCausalLM",
        layer_kinds=["attention" if i in attn else "mamba" for i in range(n_layers)],
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 262144)),
        residual_in_fp32=False,
        mamba_num_heads=n_heads,
        mamba_head_dim=d_head,
        mamba_d_state=int(hf["mamba_d_state"]),
        mamba_n_groups=int(hf.get("mamba_n_groups", 1)),
        mamba_d_conv=int(hf.get("mamba_d_conv", 4)),
        mamba_chunk_size=int(hf.get("mamba_chunk_size", 256)),
        mamba_conv_bias=bool(hf.get("mamba_conv_bias", True)),
        mamba_proj_bias=bool(hf.get("mamba_proj_bias", False)),
        num_attention_heads=num_attn_heads,
        num_kv_heads=int(num_kv or num_attn_heads),
        attn_head_dim=int(head_dim),
        rope_theta=theta,
        # NOTE: transformers hard-codes partial_rotary_factor = 0.5 for Bamba whatever the file says
        partial_rotary_factor=0.5,
        attention_bias=bool(hf.get("attention_bias", False)),
        intermediate_size=int(hf["intermediate_size"]),
        **_common(hf),
    )


_NEMOTRON_PATTERN = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
_NEMOTRON_TYPES = {
    "linear_attention": "mamba",
    "mamba": "mamba",
    "full_attention": "attention",
    "attention": "attention",
    "mlp": "mlp",
    "moe": "moe",
}


def _from_nemotron_h(hf: dict[str, Any]) -> ModelConfig:
    if hf.get("layers_block_type"):
        raw = [_NEMOTRON_TYPES.get(t, t) for t in hf["layers_block_type"]]
    elif hf.get("hybrid_override_pattern"):
        raw = [_NEMOTRON_PATTERN.get(c, c) for c in hf["hybrid_override_pattern"]]
    else:
        raise ConfigError("NemotronH config needs layers_block_type or hybrid_override_pattern")
    unsupported = sorted({k for k in raw if k not in ("mamba", "attention", "mlp")})
    if unsupported:
        raise ConfigError(f"NemotronH layer kinds {unsupported} are not supported (mamba, attention, mlp are)")
    kinds: list[LayerKind] = [k for k in raw]  # type: ignore[misc]

    def alias(name: str, legacy: str, default: Any) -> Any:
        # NemotronHConfig lets the legacy mamba_* spelling override the plain one
        return hf[legacy] if legacy in hf else hf.get(name, default)

    num_attn_heads = int(hf.get("num_attention_heads", 32))
    num_kv = hf.get("num_key_value_heads", 8)  # NemotronHConfig default; None means MHA
    head_dim = hf.get("head_dim", 128)  # NemotronHConfig default, *not* hidden // heads
    # NOTE: transformers' NemotronH mixer clamps dt to (time_step_min, inf) and ignores
    # time_step_limit; it ignores residual_in_fp32 (residual stays in the activation dtype);
    # in_proj/out_proj biases follow `use_bias` (not mamba_proj_bias); attention has no bias.
    dt_min = float(alias("time_step_min", "mamba_dt_min", 0.001))
    return ModelConfig(
        architecture="NemotronHForCausalLM",
        layer_kinds=kinds,
        rms_norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        residual_in_fp32=False,
        mamba_num_heads=int(hf["mamba_num_heads"]),
        mamba_head_dim=int(hf["mamba_head_dim"]),
        mamba_d_state=int(hf["ssm_state_size"]),
        mamba_n_groups=int(alias("n_groups", "mamba_n_groups", 8)),
        mamba_d_conv=int(alias("conv_kernel", "mamba_d_conv", 4)),
        mamba_chunk_size=int(alias("chunk_size", "mamba_chunk_size", 128)),
        mamba_conv_bias=bool(alias("use_conv_bias", "mamba_conv_bias", True)),
        mamba_proj_bias=bool(hf.get("use_bias", False)),
        num_attention_heads=num_attn_heads,
        num_kv_heads=int(num_kv or num_attn_heads),
        attn_head_dim=int(head_dim or int(hf["hidden_size"]) // num_attn_heads),
        rope_theta=None,  # NemotronH attention has no positional embedding
        attention_bias=False,
        intermediate_size=int(hf.get("intermediate_size", 21504)),
        # NemotronHForCausalLM declares no tied weights: its lm_head is its own whatever the file says
        **{**_common(hf), "time_step_limit": (dt_min, math.inf), "tie_word_embeddings": False},
    )
