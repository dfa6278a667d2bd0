"""Configuration dataclasses.

`ModelConfig` normalizes the HF `config.json` of every supported architecture into one set of
names (the per-family quirks — field names, defaults, layer patterns — are resolved once, in
`config_hf.py`); the model files still read family-only fields from `ModelConfig.hf`.  The other
configs describe the engine: cache sizes, scheduler budgets.  Every dataclass validates itself in
`__post_init__` so a bad value fails at construction with a message that says what to change.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

LayerKind = Literal["mamba", "attention", "mlp"]

SUPPORTED_ARCHITECTURES = ("Mamba2ForCausalLM", "BambaForCausalLM", "NemotronHForCausalLM")

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """'bfloat16' / 'bf16' / torch.bfloat16 -> torch.bfloat16; unknown names raise."""
    if isinstance(name, torch.dtype):
        return name
    key = str(name).removeprefix("torch.").lower()
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(set(_DTYPES))}")
    return _DTYPES[key]


class ConfigError(ValueError):
    """A checkpoint's config.json cannot be served: names the field and what is expected."""


@dataclass(slots=True)
class ModelConfig:
    """Architecture facts the engine and the cache need, in one vocabulary for all families."""

    architecture: str
    vocab_size: int
    hidden_size: int
    layer_kinds: list[LayerKind]  # per decoder layer, the mixer it holds (Bamba: FFN rides along)
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int | None  # None: the architecture has no positional limit
    eos_token_ids: list[int]
    bos_token_id: int | None
    pad_token_id: int | None
    dtype: torch.dtype  # the dtype the checkpoint was saved in
    residual_in_fp32: bool
    # Mamba2 mixer
    mamba_num_heads: int
    mamba_head_dim: int
    mamba_d_state: int
    mamba_n_groups: int
    mamba_d_conv: int
    mamba_chunk_size: int
    mamba_conv_bias: bool
    mamba_proj_bias: bool
    time_step_limit: tuple[float, float]
    # attention (hybrids only; zero for pure SSM models)
    num_attention_heads: int = 0
    num_kv_heads: int = 0
    attn_head_dim: int = 0
    rope_theta: float | None = None  # None: no rotary embedding (NemotronH)
    partial_rotary_factor: float = 1.0
    attention_bias: bool = False
    # MLP
    intermediate_size: int = 0
    hf: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.vocab_size <= 0 or self.hidden_size <= 0:
            raise ConfigError("vocab_size and hidden_size must be positive")
        if "mamba" in self.layer_kinds:
            if self.mamba_num_heads % self.mamba_n_groups != 0:
                raise ConfigError(
                    f"mamba num_heads ({self.mamba_num_heads}) must be a multiple of n_groups "
                    f"({self.mamba_n_groups})"
                )
            if self.mamba_chunk_size <= 0 or self.mamba_d_conv < 2:
                raise ConfigError("mamba chunk_size must be > 0 and conv kernel >= 2")
        if "attention" in self.layer_kinds:
            if self.num_attention_heads <= 0 or self.num_kv_heads <= 0 or self.attn_head_dim <= 0:
                raise ConfigError("attention layers need num_attention_heads, num_key_value_heads, head_dim")
            if self.num_attention_heads % self.num_kv_heads != 0:
                raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")

    # --- derived sizes -------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    @property
    def mamba_layer_ids(self) -> list[int]:
        return [i for i, k in enumerate(self.layer_kinds) if k == "mamba"]

    @property
    def attention_layer_ids(self) -> list[int]:
        return [i for i, k in enumerate(self.layer_kinds) if k == "attention"]

    @property
    def mamba_d_inner(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def mamba_conv_dim(self) -> int:
        # conv runs over x, B and C together: d_inner + 2 * n_groups * d_state channels
        return self.mamba_d_inner + 2 * self.mamba_n_groups * self.mamba_d_state

    @property
    def mamba_norm_group_size(self) -> int:
        # gated RMSNorm normalizes each of n_groups slices of d_inner separately
        # (transformers >= 5 does so for Mamba2, Bamba and NemotronH alike)
        return self.mamba_d_inner // self.mamba_n_groups

    @property
    def rotary_dim(self) -> int:
        return int(self.attn_head_dim * self.partial_rotary_factor) if self.rope_theta is not None else 0

    # --- loading -------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        cfg_file = path / "config.json" if path.is_dir() else path
        if not cfg_file.is_file():
            raise FileNotFoundError(f"no config.json at {cfg_file}: pass a checkpoint directory")
        with open(cfg_file) as f:
            return cls.from_hf_dict(json.load(f))

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> ModelConfig:
        # imported here, not at the top: config_hf imports ModelConfig from this module
        from pd_ssm.config_hf import model_config_from_hf

        return model_config_from_hf(hf)


@dataclass(slots=True)
class CacheConfig:
    """Sizes of the state and KV pools.

    One state slot holds, for every SSM layer, a request's conv state and SSM state; one KV block
    holds `block_size` tokens of K and V for every attention layer.
    """

    num_state_slots: int = 64
    num_kv_blocks: int = 1024
    block_size: int = 16
    mamba_ssm_cache_dtype: torch.dtype = torch.float32
    # None: the conv state and KV blocks use the model's activation dtype
    cache_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.num_state_slots <= 0:
            raise ValueError(f"num_state_slots must be > 0, got {self.num_state_slots}")
        if self.num_kv_blocks < 0:
            raise ValueError(f"num_kv_blocks must be >= 0, got {self.num_kv_blocks}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        self.mamba_ssm_cache_dtype = parse_dtype(self.mamba_ssm_cache_dtype)
        if self.mamba_ssm_cache_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError("mamba_ssm_cache_dtype must be float32, bfloat16 or float16")
        if self.cache_dtype is not None:
            self.cache_dtype = parse_dtype(self.cache_dtype)


@dataclass(slots=True)
class SchedulerConfig:
    """Step budgets: at most `max_num_seqs` requests running, `max_num_batched_tokens` per step."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max_position_embeddings (or unbounded)
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be > 0, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be > 0, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be > 0, got {self.max_model_len}")


@dataclass(slots=True)
class EngineConfig:
    """Everything `Engine` needs to build itself; CLI flags and `LLM(...)` kwargs map onto it."""

    model: str  # checkpoint directory
    device: str = "cpu"
    dtype: str = "auto"  # "auto": the checkpoint's dtype
    load_format: str = "auto"  # "auto" (safetensors) | "dummy" (random weights of real sizes)
    kernel_backend: str = "auto"  # "auto" | "torch" | "triton"
    seed: int = 0  # seed of dummy weights
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # vLLM's meaning: the fraction of the GPU's total memory this engine may use (weights,
    # activations, CUDA graphs and the cache pools); the pools get what the rest leaves. CUDA only:
    # on the CPU the pools keep the explicit sizes of `cache`.
    gpu_memory_utilization: float = 0.9
    # vLLM's name: True runs every step eagerly; False captures CUDA graphs for decode-only steps
    # (CUDA only; the CPU always runs eagerly)
    enforce_eager: bool = False
    # with CUDA graphs on, also capture prefill-only steps per (tokens, sequences) bucket
    # (engine/prefill_graphs.py); False: prefill steps run eagerly
    prefill_cuda_graphs: bool = True
    # vLLM's name (SGLang: the overlap scheduler): launch a decode step before the previous step's
    # tokens are read, so detokenizing and scheduling hide behind the GPU (engine/inflight.py).
    # None: on for CUDA, off on the CPU (whose kernels run in the calling thread: nothing to hide)
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"load_format must be auto, safetensors or dummy, got {self.load_format!r}")
        if self.kernel_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"kernel_backend must be auto, torch or triton, got {self.kernel_backend!r}")
        if self.dtype != "auto":
            parse_dtype(self.dtype)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        dev = torch.device(self.device)
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' asked for, but torch sees no CUDA device here")

    def resolve_dtype(self, model: ModelConfig) -> torch.dtype:
        return model.dtype if self.dtype == "auto" else parse_dtype(self.dtype)

    @property
    def use_async_scheduling(self) -> bool:
        if self.async_scheduling is None:
            return torch.device(self.device).type == "cuda"
        return self.async_scheduling

    @property
    def use_cuda_graphs(self) -> bool:
        return torch.device(self.device).type == "cuda" and not self.enforce_eager
