"""GPU memory plan: how many state slots and KV blocks fit in `gpu_memory_utilization` of the GPU.

vLLM's meaning: the engine may use `utilization × total memory` of its device for everything it
allocates — weights, activations, CUDA graphs and the cache pools — and the pools get what the
others leave.  The Engine, on CUDA:

  1. `MemorySnapshot.take` before the weights load (free memory, torch's counters);
  2. loads the weights, then `profile_memory` runs, on a throwaway one-slot pool, a prefill of
     max_num_batched_tokens tokens with max_num_seqs sampled rows (logits + sampler), and the
     largest captured decode step when CUDA graphs are on (its peak is what the graphs' private
     memory pool will hold), and reads the peaks;
  3. `plan_pools` sizes the pools: max_num_seqs state slots (+1 scratch slot that padded graph
     rows write into), and for hybrids every remaining byte as KV blocks (pure SSM models: 0).

The arithmetic (`state_slot_bytes`, `kv_block_bytes`, `plan_pools`) is pure Python; only the
snapshot and the profile touch the device.  On the CPU none of this runs: the pools keep the
explicit sizes of CacheConfig.
"""

from __future__ import annotations

import dataclasses
import gc
from dataclasses import dataclass

import torch

from pd_ssm.cache.pool import CachePool
from pd_ssm.config import CacheConfig, ModelConfig
from pd_ssm.engine.cuda_graphs import DecodeBuffers, decode_step
from pd_ssm.engine.forward_meta import ForwardMeta
from pd_ssm.engine.sampler import Sampler
from pd_ssm.models.base import CausalLM
from pd_ssm.sampling_params import SamplingParams

_GIB = float(1 << 30)


class InsufficientMemoryError(RuntimeError):
    """The pools cannot be sized within the memory budget; the message says which knob to turn."""


def state_slot_bytes(model: ModelConfig, cache: CacheConfig, act_dtype: torch.dtype) -> int:
    """Bytes of one state slot across all SSM layers (conv state + SSM state), as CachePool lays it."""
    conv_dtype = cache.cache_dtype or act_dtype
    conv = model.mamba_conv_dim * (model.mamba_d_conv - 1) * conv_dtype.itemsize
    ssm = model.mamba_num_heads * model.mamba_head_dim * model.mamba_d_state * cache.mamba_ssm_cache_dtype.itemsize
    return len(model.mamba_layer_ids) * (conv + ssm)


def kv_block_bytes(model: ModelConfig, cache: CacheConfig, act_dtype: torch.dtype) -> int:
    """Bytes of one KV block across all attention layers (K and V), as CachePool lays it."""
    kv_dtype = cache.cache_dtype or act_dtype
    per_layer = 2 * cache.block_size * model.num_kv_heads * model.attn_head_dim * kv_dtype.itemsize
    return len(model.attention_layer_ids) * per_layer


@dataclass(frozen=True, slots=True)
class MemoryProfile:
    """What the engine needs besides the pools, in bytes (from a snapshot and a profile)."""

    total: int  # the device's memory
    free_at_start: int  # free before the weights loaded (other processes' use is not ours to plan)
    weights: int
    activations: int  # peak above the weights of the profiling forwards (eager steps, sampler)
    non_torch: int  # growth outside torch's allocator since the snapshot (cuBLAS, ...)
    graphs: int  # CUDA graphs' private pool + static buffers; 0 when eager


@dataclass(frozen=True, slots=True)
class CachePlan:
    num_state_slots: int  # handed out by the CacheManager (= max_num_seqs)
    num_scratch_slots: int  # pool slots nobody holds (1 with CUDA graphs: padding rows write there)
    num_kv_blocks: int
    slot_bytes: int
    block_bytes: int
    pool_budget: int  # bytes left for the pools after weights, activations, graphs
    profile: MemoryProfile

    @property
    def pool_bytes(self) -> int:
        return (self.num_state_slots + self.num_scratch_slots) * self.slot_bytes + self.num_kv_blocks * self.block_bytes

    def describe(self) -> str:
        p = self.profile
        return (
            f"memory plan: {self.num_state_slots}+{self.num_scratch_slots} state slots "
            f"({self.slot_bytes / (1 << 20):.1f} MiB each), {self.num_kv_blocks} KV blocks "
            f"({self.block_bytes / 1024:.1f} KiB each) = {self.pool_bytes / _GIB:.2f} GiB of a "
            f"{self.pool_budget / _GIB:.2f} GiB pool budget; weights {p.weights / _GIB:.2f} GiB, "
            f"activations {p.activations / _GIB:.2f} GiB, graphs {p.graphs / _GIB:.2f} GiB, "
            f"non-torch {p.non_torch / _GIB:.2f} GiB, device total {p.total / _GIB:.1f} GiB"
        )


def plan_pools(
    profile: MemoryProfile,
    *,
    utilization: float,
    num_slots: int,
    num_scratch: int,
    slot_bytes: int,
    block_bytes: int,
    uses_kv: bool,
    max_useful_blocks: int,
) -> CachePlan:
    """Size the pools in `utilization × total` minus everything else the engine holds.

    `max_useful_blocks` caps the KV pool: blocks past every sequence at max_model_len at once
    could never be used (and would only cost host memory in the block manager's free list).
    """
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    requested = int(utilization * profile.total)
    if profile.free_at_start < requested:
        raise InsufficientMemoryError(
            f"gpu_memory_utilization={utilization} asks for {requested / _GIB:.2f} GiB of the device's "
            f"{profile.total / _GIB:.2f} GiB but only {profile.free_at_start / _GIB:.2f} GiB were free at "
            "start (other processes hold the rest); lower --gpu-memory-utilization or free the GPU"
        )
    budget = requested - profile.weights - profile.activations - profile.non_torch - profile.graphs
    need = (num_slots + num_scratch) * slot_bytes
    if budget < need:
        raise InsufficientMemoryError(
            f"max_num_seqs={num_slots} state slots (+{num_scratch} scratch) need {need / _GIB:.2f} GiB "
            f"({slot_bytes / (1 << 20):.1f} MiB each) but gpu_memory_utilization={utilization} leaves "
            f"{max(budget, 0) / _GIB:.2f} GiB for the cache pools (weights {profile.weights / _GIB:.2f}, "
            f"activations {profile.activations / _GIB:.2f}, CUDA graphs {profile.graphs / _GIB:.2f}, "
            f"other {profile.non_torch / _GIB:.2f} GiB); raise --gpu-memory-utilization, lower "
            "--max-num-seqs or --max-num-batched-tokens, or use --mamba-ssm-cache-dtype bfloat16"
        )
    blocks = 0
    if uses_kv:
        blocks = min((budget - need) // block_bytes, max_useful_blocks)
        if blocks < 1:
            raise InsufficientMemoryError(
                f"no room for a single KV block ({block_bytes / (1 << 20):.2f} MiB) after "
                f"{num_slots}+{num_scratch} state slots in {budget / _GIB:.2f} GiB; raise "
                "--gpu-memory-utilization or lower --max-num-seqs"
            )
    return CachePlan(
        num_state_slots=num_slots,
        num_scratch_slots=num_scratch,
        num_kv_blocks=blocks,
        slot_bytes=slot_bytes,
        block_bytes=block_bytes,
        pool_budget=budget,
        profile=profile,
    )


@dataclass(frozen=True, slots=True)
class MemorySnapshot:
    free: int
    total: int
    allocated: int  # torch's live tensors
    reserved: int  # torch's caching allocator, live + cached

    @classmethod
    def take(cls, device: torch.device) -> MemorySnapshot:
        gc.collect()
        torch.cuda.empty_cache()  # cached blocks of earlier engines in this process are not in use
        torch.cuda.synchronize(device)
        free, total = torch.cuda.mem_get_info(device)
        return cls(free, total, torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device))


@torch.inference_mode()
def profile_memory(
    model: CausalLM,
    cache: CacheConfig,
    act_dtype: torch.dtype,
    start: MemorySnapshot,
    *,
    num_tokens: int,
    num_sampled_rows: int,
    graph_size: int,
    graph_width: int,
    prefill_graphs: bool = False,
) -> MemoryProfile:
    """Peak memory of the steps the engine will run, on a throwaway one-slot pool.

    graph_size: the largest captured decode batch (0: no CUDA graphs); graph_width its block tables.
    prefill_graphs: prefill steps are captured too; their pool holds the peak of the largest prefill
    forward for good, beside what eager steps allocate and free (counted as the prefill's peak).
    """
    mc = model.config
    device = next(model.parameters()).device
    torch.cuda.synchronize(device)
    weights = torch.cuda.memory_allocated(device) - start.allocated
    uses_kv = bool(mc.attention_layer_ids)
    n_blocks = -(-num_tokens // cache.block_size) if uses_kv else 0
    pool = CachePool(mc, dataclasses.replace(cache, num_state_slots=1, num_kv_blocks=max(n_blocks, 1)),
                     device, act_dtype)

    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    _prefill_and_sample(model, pool, num_tokens, n_blocks, num_sampled_rows)
    torch.cuda.synchronize(device)
    activations = torch.cuda.max_memory_allocated(device) - base

    graphs = 0
    if graph_size:
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        buffers = DecodeBuffers(graph_size, graph_width, mc.vocab_size, device)
        buffers.pad_with_scratch(graph_size, 0)
        decode_step(model, pool, buffers, graph_size)
        torch.cuda.synchronize(device)
        graphs = torch.cuda.max_memory_allocated(device) - base  # static buffers included
        del buffers
    if prefill_graphs:
        graphs += activations

    free_now = torch.cuda.mem_get_info(device)[0]
    non_torch = max(0, (start.free - free_now) - (torch.cuda.memory_reserved(device) - start.reserved))
    del pool
    torch.cuda.empty_cache()
    return MemoryProfile(total=start.total, free_at_start=start.free, weights=weights,
                         activations=activations, non_torch=non_torch, graphs=graphs)


def _prefill_and_sample(model: CausalLM, pool: CachePool, num_tokens: int, n_blocks: int, rows: int) -> None:
    """One sequence of `num_tokens` prompt tokens from scratch, then `rows` rows of logits sampled
    with every filter and logprobs on (the sampler's largest temporaries)."""
    device = pool.device
    mc = model.config
    T = num_tokens

    def i32(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    meta = ForwardMeta(
        num_decodes=0,
        num_prefills=1,
        num_tokens=T,
        query_start_loc=i32([0, T]),
        context_lens=i32([0]),
        seq_lens=i32([T]),
        state_indices=i32([0]),
        has_initial_state=torch.zeros(1, dtype=torch.bool, device=device),
        slot_mapping=(torch.arange(T, device=device) if n_blocks else torch.full((T,), -1, device=device)),
        block_tables=(torch.arange(n_blocks, dtype=torch.int32, device=device) if n_blocks
                      else torch.zeros(1, dtype=torch.int32, device=device)).view(1, -1),
        query_start_loc_cpu=[0, T],
        context_lens_cpu=[0],
        seq_lens_cpu=[T],
    )
    ids = torch.arange(T, device=device) % mc.vocab_size
    hidden = model(ids, torch.arange(T, device=device), meta, pool)  # [T, hidden]
    logits = model.compute_logits(hidden[-1:].expand(rows, -1).contiguous())  # [rows, vocab]
    params = [SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.01, logprobs=20)] * rows
    Sampler()(logits, params, list(range(rows)), [0] * rows)
