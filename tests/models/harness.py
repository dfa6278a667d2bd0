"""Test helpers: tiny perturbed transformers checkpoints, and a hand-driven CachePool + ForwardMeta.

`StepRunner` plays the scheduler's and the runner's part by hand: the test says which tokens of
which sequence run in a step, the runner lays them out decodes-first, assigns the sequence's
state slot (chosen by the test) and KV blocks (from a shuffled free list, so block tables are not
contiguous), builds ForwardMeta and returns each item's logits.
"""

from __future__ import annotations

import inspect
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers

from pd_ssm.cache.pool import CachePool
from pd_ssm.config import CacheConfig
from pd_ssm.engine.forward_meta import ForwardMeta
from pd_ssm.kernels.dispatch import get_kernels
from pd_ssm.models import CausalLM, load_model

CHUNK = 16
VOCAB = 384

# family -> config kwargs; chunk 16 so prompts of a few dozen tokens span several SSM chunks
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "mamba2-g1": ("Mamba2", dict(
        hidden_size=64, num_heads=8, head_dim=16, expand=2, state_size=16, n_groups=1, num_hidden_layers=3,
        chunk_size=CHUNK, vocab_size=VOCAB, initializer_range=0.1)),
    "mamba2-g2-tied-dtlimit": ("Mamba2", dict(
        hidden_size=64, num_heads=8, head_dim=16, expand=2, state_size=16, n_groups=2, num_hidden_layers=2,
        chunk_size=CHUNK, vocab_size=VOCAB, tie_word_embeddings=True, time_step_limit=(0.02, 0.3),
        initializer_range=0.1)),
    "bamba-attn-first-last": ("Bamba", dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=4, attn_layer_indices=[0, 3],
        num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=8, mamba_d_state=16, mamba_n_groups=2,
        mamba_chunk_size=CHUNK, vocab_size=VOCAB, initializer_range=0.1)),
    "bamba-attn-middle": ("Bamba", dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=3, attn_layer_indices=[1],
        num_attention_heads=4, num_key_value_heads=4, mamba_n_heads=4, mamba_d_state=16, mamba_n_groups=1,
        mamba_chunk_size=CHUNK, vocab_size=VOCAB, initializer_range=0.1, tie_word_embeddings=True)),
    "nemotron-h": ("NemotronH", dict(
        hidden_size=64, layers_block_type=["full_attention", "linear_attention", "mlp", "linear_attention",
                                           "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96, mamba_num_heads=8,
        mamba_head_dim=16, ssm_state_size=16, n_groups=2, chunk_size=CHUNK, vocab_size=VOCAB,
        time_step_min=0.03, initializer_range=0.1)),
    "nemotron-h-attn-middle": ("NemotronH", dict(
        hidden_size=64, layers_block_type=["linear_attention", "full_attention", "mlp", "linear_attention"],
        num_attention_heads=4, num_key_value_heads=1, head_dim=8, intermediate_size=80, mamba_num_heads=4,
        mamba_head_dim=32, ssm_state_size=16, n_groups=1, chunk_size=CHUNK, vocab_size=VOCAB,
        initializer_range=0.1)),
}


def hf_groups_gated_norm(name: str) -> bool:
    """Whether the installed transformers normalizes the mixer's gated norm per group for this config.

    transformers 5.17's Mamba2 and Bamba normalize over all of d_inner, 5.24's per group of
    d_inner / n_groups (as mamba_ssm and pd_ssm do); with n_groups > 1 the two differ."""
    family, kwargs = CONFIGS[name]
    n_groups = kwargs.get("n_groups", kwargs.get("mamba_n_groups", 1))
    if family == "NemotronH" or n_groups == 1:
        return True
    module = getattr(transformers.models, family.lower())
    norm_cls = getattr(module, f"modeling_{family.lower()}").__dict__[
        "MambaRMSNormGated" if family == "Mamba2" else f"{family}RMSNormGated"
    ]
    return "group_size" in inspect.signature(norm_cls.__init__).parameters


def make_hf_model(name: str, seed: int = 0) -> torch.nn.Module:
    """A tiny transformers model whose init-constant parameters are all perturbed."""
    family, kwargs = CONFIGS[name]
    config = getattr(transformers, f"{family}Config")(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{family}ForCausalLM")(config).float().eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("A_log"):
                p.copy_(torch.log(torch.empty_like(p).uniform_(0.5, 8.0, generator=g)))
            elif pname.endswith("dt_bias"):
                p.copy_(torch.empty_like(p).uniform_(-5.0, 0.5, generator=g))  # softplus: ~0.007 .. 0.97
            elif pname.endswith(".D"):
                p.copy_(torch.empty_like(p).uniform_(-1.0, 1.5, generator=g))
            elif pname.endswith("norm.weight") or pname.endswith("layernorm.weight") or pname.endswith("norm_f.weight"):
                p.copy_(torch.empty_like(p).uniform_(0.6, 1.4, generator=g))
            elif pname.endswith("bias"):
                p.copy_(torch.empty_like(p).uniform_(-0.2, 0.2, generator=g))
    return model


def save_checkpoint(model: torch.nn.Module, path: Path, *, sharded: bool = False) -> Path:
    # a small max_shard_size forces model.safetensors.index.json + several shards
    model.save_pretrained(path, max_shard_size="40KB" if sharded else "5GB")
    return path


def load_pd(path: Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> CausalLM:
    return load_model(path, device=device, dtype=dtype, kernels=get_kernels("torch", device))


@torch.no_grad()
def hf_logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab] fp32: transformers' logits at every position of one sequence."""
    return model(torch.tensor([tokens]), use_cache=False).logits[0].float()


class HFIncremental:
    """transformers' own incremental path for one sequence: each call feeds the next tokens with
    the cache of the previous calls (one token: HF's decode step; several: its chunked scan
    continuing from the cached state), like the engine's decode steps and prefill chunks."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.cache: Any = None
        self.pos = 0

    @torch.no_grad()
    def step(self, tokens: list[int]) -> torch.Tensor:  # [len(tokens), vocab] fp32
        positions = torch.arange(self.pos, self.pos + len(tokens))[None]
        # transformers renamed past_key_values / cache_params to `cache` in 5.2x; accept either
        params = inspect.signature(self.model.forward).parameters
        key = next(k for k in ("cache", "past_key_values", "cache_params") if k in params)
        out = self.model(torch.tensor([tokens]), use_cache=True, position_ids=positions, **{key: self.cache})
        self.cache = out[key]
        self.pos += len(tokens)
        return out.logits[0].float()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per row: max |a - b| / max |b|."""
    return (a - b).abs().amax(-1) / b.abs().amax(-1).clamp_min(1e-12)


@dataclass
class _Seq:
    slot: int
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose state / KV is in the pool


class StepRunner:
    """Drives a pd_ssm model step by step over a CachePool whose slots and blocks the test assigns."""

    def __init__(
        self, model: CausalLM, *, num_slots: int = 8, num_blocks: int = 64, block_size: int = 4, seed: int = 0
    ) -> None:
        self.model = model
        param = next(model.parameters())
        self.device = param.device
        cache_cfg = CacheConfig(num_state_slots=num_slots, num_kv_blocks=num_blocks, block_size=block_size)
        self.pool = CachePool(model.config, cache_cfg, self.device, param.dtype)
        # NOTE: garbage in every slot and block: a fresh sequence must not read what a slot held
        g = torch.Generator().manual_seed(seed)
        for t in (self.pool.conv_state, self.pool.ssm_state, self.pool.k_cache, self.pool.v_cache):
            t.copy_(torch.randn(t.shape, generator=g))  # CPU generator: the same garbage on any device
        self.block_size = block_size
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.seqs: dict[str, _Seq] = {}

    def add(self, seq_id: str, slot: int) -> None:
        self.seqs[seq_id] = _Seq(slot)

    @torch.no_grad()
    def step(self, items: list[tuple[str, list[int], bool]]) -> list[torch.Tensor]:
        """items: (seq_id, new tokens, as_decode). Returns each item's logits [len(tokens), vocab],
        in the order given; the batch itself is laid out decodes first, as ForwardMeta requires."""
        order = sorted(range(len(items)), key=lambda i: not items[i][2])  # stable: decodes first
        ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        qsl, ctx, lens, slots, tables = [0], [], [], [], []
        num_decodes = 0
        for i in order:
            seq_id, tokens, as_decode = items[i]
            seq = self.seqs[seq_id]
            if as_decode:
                assert len(tokens) == 1 and seq.num_computed > 0, "a decode is one token after a prefill"
                num_decodes += 1
            start, end = seq.num_computed, seq.num_computed + len(tokens)
            while len(seq.blocks) * self.block_size < end:
                seq.blocks.append(self.free_blocks.pop())
            for pos in range(start, end):
                slot_mapping.append(seq.blocks[pos // self.block_size] * self.block_size + pos % self.block_size)
            ids += tokens
            positions += range(start, end)
            qsl.append(qsl[-1] + len(tokens))
            ctx.append(start)
            lens.append(end)
            slots.append(seq.slot)
            tables.append(list(seq.blocks))
            seq.num_computed = end
        width = max(len(t) for t in tables)
        i32: dict[str, Any] = dict(dtype=torch.int32, device=self.device)
        meta = ForwardMeta(
            num_decodes=num_decodes,
            num_prefills=len(items) - num_decodes,
            num_tokens=len(ids),
            query_start_loc=torch.tensor(qsl, **i32),
            context_lens=torch.tensor(ctx, **i32),
            seq_lens=torch.tensor(lens, **i32),
            state_indices=torch.tensor(slots, **i32),
            has_initial_state=torch.tensor(ctx, device=self.device) > 0,
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=self.device),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], **i32),
            query_start_loc_cpu=qsl,
            context_lens_cpu=ctx,
            seq_lens_cpu=lens,
        )
        ids_t = torch.tensor(ids, device=self.device)
        hidden = self.model(ids_t, torch.tensor(positions, device=self.device), meta, self.pool)
        logits = self.model.compute_logits(hidden).cpu()
        out: list[torch.Tensor] = [torch.empty(0)] * len(items)
        for row, i in enumerate(order):
            out[i] = logits[qsl[row]:qsl[row + 1]]
        return out
