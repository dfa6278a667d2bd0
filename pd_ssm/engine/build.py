"""EngineParts: what an Engine is made of, built from its EngineConfig -- the model and its kernels,
the pools (sized from free memory on CUDA), the cache bookkeeping, the scheduler, and the runner
with its captured CUDA graphs. Building is one pass with an order that matters (engine.py runs what
is built):

  1. kernels, then the weights (`load_format`), with a memory snapshot taken before them;
  2. CUDA: a profiled step of every kind the engine will run (memory_plan.py), and the pools
     sized from what `gpu_memory_utilization` leaves; CPU: CacheConfig's sizes as they are;
  3. the pools (one scratch slot past the manager's with CUDA graphs: padded graph rows write there,
     it is never handed out), the CacheManager, the scheduler of a prefill and a decode manager;
  4. the decode graphs (per batch size) and the prefill graphs (per token / sequence bucket; Triton
     kernels only: they never read a device value on the host), captured last, on the real pools.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from pd_ssm.cache.manager import CacheManager
from pd_ssm.cache.pool import CachePool
from pd_ssm.config import EngineConfig, ModelConfig
from pd_ssm.engine.cuda_graphs import DecodeGraphs, capture_sizes, check_capturable, table_width
from pd_ssm.engine.decode_manager import DecodeManager
from pd_ssm.engine.memory_plan import (
    CachePlan,
    MemorySnapshot,
    kv_block_bytes,
    plan_pools,
    profile_memory,
    state_slot_bytes,
)
from pd_ssm.engine.prefill_graphs import PrefillGraphs, prefill_buckets
from pd_ssm.engine.prefill_manager import PrefillManager
from pd_ssm.engine.runner import ModelRunner
from pd_ssm.engine.scheduler import Scheduler
from pd_ssm.engine.tokenizer import Tokenizer, load_tokenizer
from pd_ssm.kernels.dispatch import Kernels, get_kernels
from pd_ssm.models.base import CausalLM
from pd_ssm.models.loader import load_model

log = logging.getLogger(__name__)

# Pure SSM models have no positional limit; this bounds max_tokens=None all the same.
UNBOUNDED_LEN = 1 << 20


@dataclass(slots=True)
class EngineParts:
    device: torch.device
    model_config: ModelConfig
    dtype: torch.dtype
    kernels: Kernels
    model: CausalLM
    memory_plan: CachePlan | None  # CUDA: how the pools were sized; None on the CPU
    pool: CachePool
    cache: CacheManager
    max_model_len: int  # the declared length, bounded by the KV blocks there are
    scheduler: Scheduler
    runner: ModelRunner
    tokenizer: Tokenizer


def build_parts(config: EngineConfig) -> EngineParts:
    device = torch.device(config.device)
    mc = ModelConfig.from_pretrained(config.model)
    dtype = config.resolve_dtype(mc)
    kernels = get_kernels(config.kernel_backend, device)  # type: ignore[arg-type]
    use_graphs = config.use_cuda_graphs
    if use_graphs:
        check_capturable(kernels, mc)
    start = MemorySnapshot.take(device) if device.type == "cuda" else None
    model = load_model(config.model, device=device, dtype=dtype, kernels=kernels, load_format=config.load_format,
                       seed=config.seed)
    uses_kv = bool(mc.attention_layer_ids)
    declared = config.scheduler.max_model_len or mc.max_position_embeddings or UNBOUNDED_LEN
    graph_sizes = capture_sizes(config.scheduler.max_num_seqs) if use_graphs else []
    prefill_shapes = (
        prefill_buckets(config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs)
        if use_graphs and config.prefill_cuda_graphs and kernels.backend == "triton" else None
    )
    cc = config.cache
    memory_plan: CachePlan | None = None
    if start is not None:  # CUDA: the pools take what gpu_memory_utilization leaves
        memory_plan = _plan_pools(config, mc, model, dtype, start, declared, graph_sizes, prefill_shapes is not None)
        log.info(memory_plan.describe())
        cc = dataclasses.replace(cc, num_state_slots=memory_plan.num_state_slots, num_kv_blocks=memory_plan.num_kv_blocks)
    scratch = 1 if use_graphs else 0  # NOTE: the slot padded graph rows write into (module docstring)
    pool = CachePool(mc, dataclasses.replace(cc, num_state_slots=cc.num_state_slots + scratch), device, dtype)
    cache = CacheManager(cc.num_state_slots, cc.num_kv_blocks, cc.block_size, uses_kv)
    kv_tokens = cc.num_kv_blocks * cc.block_size if uses_kv else declared
    max_model_len = min(declared, kv_tokens)
    scheduler = Scheduler(
        config.scheduler, cache, PrefillManager(cache, config.scheduler.enable_chunked_prefill), DecodeManager(cache),
    )
    runner = ModelRunner(model, pool, cache, device)
    width = table_width(max_model_len, cc.block_size, uses_kv)
    if use_graphs:
        runner.graphs = DecodeGraphs(model, pool, sizes=graph_sizes, scratch_slot=cc.num_state_slots, width=width)
        log.info("captured %d decode CUDA graphs (batch %s) in %.1f s", len(graph_sizes), graph_sizes,
                 runner.graphs.capture_seconds)
    if prefill_shapes is not None:
        runner.prefill_graphs = PrefillGraphs(model, pool, buckets=prefill_shapes, scratch_slot=cc.num_state_slots,
                                              width=width)
        log.info("captured %d prefill CUDA graphs (tokens, sequences: %s) in %.1f s", len(prefill_shapes),
                 prefill_shapes, runner.prefill_graphs.capture_seconds)
    tokenizer = load_tokenizer(
        Path(config.model), vocab_size=mc.vocab_size, eos_token_ids=mc.eos_token_ids, bos_token_id=mc.bos_token_id
    )
    return EngineParts(device, mc, dtype, kernels, model, memory_plan, pool, cache, max_model_len, scheduler, runner,
                       tokenizer)


def _plan_pools(
    config: EngineConfig, mc: ModelConfig, model: CausalLM, dtype: torch.dtype, start: MemorySnapshot,
    declared_len: int, graph_sizes: list[int], prefill_graphs: bool,
) -> CachePlan:
    """Profile the steps this engine will run, then size the pools from what is left."""
    cc, sc = config.cache, config.scheduler
    uses_kv = bool(mc.attention_layer_ids)
    profile = profile_memory(
        model, cc, dtype, start,
        num_tokens=min(sc.max_num_batched_tokens, declared_len),
        num_sampled_rows=sc.max_num_seqs,
        graph_size=graph_sizes[-1] if graph_sizes else 0,
        graph_width=table_width(declared_len, cc.block_size, uses_kv),
        prefill_graphs=prefill_graphs,
    )
    return plan_pools(
        profile,
        utilization=config.gpu_memory_utilization,
        num_slots=sc.max_num_seqs,
        num_scratch=1 if graph_sizes else 0,
        slot_bytes=state_slot_bytes(mc, cc, dtype),
        block_bytes=kv_block_bytes(mc, cc, dtype),
        uses_kv=uses_kv,
        max_useful_blocks=sc.max_num_seqs * -(-declared_len // cc.block_size),
    )
