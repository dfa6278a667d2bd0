"""The GPU memory plan: sizing arithmetic (pure, CPU) and the plan an engine makes on a GPU."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pd_ssm import LLM
from pd_ssm.bench.shapes import MAMBA2_2_7B
from pd_ssm.cache.pool import CachePool
from pd_ssm.config import CacheConfig, EngineConfig, ModelConfig
from pd_ssm.engine.memory_plan import (
    InsufficientMemoryError,
    MemoryProfile,
    kv_block_bytes,
    plan_pools,
    state_slot_bytes,
)
from tests.conftest import needs_cuda

GIB = 1 << 30
MIB = 1 << 20


@pytest.mark.parametrize("name", ["mamba2-g1", "bamba-attn-first", "nemotron-h"])
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ssm", ["float32", "bfloat16"])
def test_sizes_match_the_pool(name: str, act: torch.dtype, ssm: str, hf_checkpoint: Any) -> None:
    mc = ModelConfig.from_pretrained(hf_checkpoint(name)[0])
    cc = CacheConfig(num_state_slots=3, num_kv_blocks=5, block_size=4, mamba_ssm_cache_dtype=ssm)  # type: ignore[arg-type]
    pool = CachePool(mc, cc, "cpu", act)
    slot, block = state_slot_bytes(mc, cc, act), kv_block_bytes(mc, cc, act)
    assert pool.nbytes() == 3 * slot + 5 * block
    assert (block == 0) == (not mc.attention_layer_ids)


def test_mamba2_2_7b_slot() -> None:
    mc = ModelConfig.from_hf_dict(MAMBA2_2_7B)
    slot = state_slot_bytes(mc, CacheConfig(), torch.bfloat16)
    # 64 layers x (80*64*128 fp32 SSM state + (5120 + 2*128) * 3 bf16 conv state)
    assert slot == 64 * (80 * 64 * 128 * 4 + 5376 * 3 * 2)
    assert kv_block_bytes(mc, CacheConfig(), torch.bfloat16) == 0


def profile(**kw: int) -> MemoryProfile:
    base = dict(total=100 * GIB, free_at_start=99 * GIB, weights=10 * GIB, activations=5 * GIB,
                non_torch=GIB, graphs=2 * GIB)
    base.update(kw)
    return MemoryProfile(**base)


def test_pure_ssm_gets_slots_and_no_blocks() -> None:
    plan = plan_pools(profile(), utilization=0.9, num_slots=128, num_scratch=1, slot_bytes=170 * MIB,
                      block_bytes=0, uses_kv=False, max_useful_blocks=0)
    assert (plan.num_state_slots, plan.num_scratch_slots, plan.num_kv_blocks) == (128, 1, 0)
    assert plan.pool_budget == 90 * GIB - 18 * GIB
    assert plan.pool_bytes == 129 * 170 * MIB
    assert "128+1 state slots" in plan.describe()


def test_hybrid_gets_the_rest_as_blocks() -> None:
    plan = plan_pools(profile(), utilization=0.9, num_slots=64, num_scratch=1, slot_bytes=100 * MIB,
                      block_bytes=2 * MIB, uses_kv=True, max_useful_blocks=10**9)
    rest = 72 * GIB - 65 * 100 * MIB
    assert plan.num_kv_blocks == rest // (2 * MIB)
    assert plan.pool_bytes <= plan.pool_budget < plan.pool_bytes + 2 * MIB
    capped = plan_pools(profile(), utilization=0.9, num_slots=64, num_scratch=0, slot_bytes=100 * MIB,
                        block_bytes=2 * MIB, uses_kv=True, max_useful_blocks=1000)
    assert capped.num_kv_blocks == 1000 and capped.num_scratch_slots == 0


def test_utilization_scales_the_budget() -> None:
    small = plan_pools(profile(), utilization=0.5, num_slots=8, num_scratch=1, slot_bytes=MIB,
                       block_bytes=MIB, uses_kv=True, max_useful_blocks=10**9)
    big = plan_pools(profile(), utilization=0.9, num_slots=8, num_scratch=1, slot_bytes=MIB,
                     block_bytes=MIB, uses_kv=True, max_useful_blocks=10**9)
    assert big.num_kv_blocks - small.num_kv_blocks == (int(0.9 * 100 * GIB) - int(0.5 * 100 * GIB)) // MIB


def test_slots_that_do_not_fit_are_a_clear_error() -> None:
    with pytest.raises(InsufficientMemoryError) as e:
        plan_pools(profile(), utilization=0.3, num_slots=256, num_scratch=1, slot_bytes=170 * MIB,
                   block_bytes=0, uses_kv=False, max_useful_blocks=0)
    msg = str(e.value)
    assert "max_num_seqs=256" in msg and "--gpu-memory-utilization" in msg and "--max-num-seqs" in msg


def test_no_room_for_a_block_and_busy_gpu_are_clear_errors() -> None:
    with pytest.raises(InsufficientMemoryError, match="KV block"):
        plan_pools(profile(), utilization=0.9, num_slots=1, num_scratch=0, slot_bytes=72 * GIB - MIB,
                   block_bytes=2 * MIB, uses_kv=True, max_useful_blocks=10)
    with pytest.raises(InsufficientMemoryError, match="free"):
        plan_pools(profile(free_at_start=50 * GIB), utilization=0.9, num_slots=1, num_scratch=0,
                   slot_bytes=MIB, block_bytes=0, uses_kv=False, max_useful_blocks=0)
    with pytest.raises(ValueError):
        plan_pools(profile(), utilization=1.5, num_slots=1, num_scratch=0, slot_bytes=MIB, block_bytes=0,
                   uses_kv=False, max_useful_blocks=0)


@pytest.mark.parametrize("value", [0.0, -0.1, 1.01])
def test_engine_config_checks_utilization(value: float) -> None:
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(model="x", gpu_memory_utilization=value)


@needs_cuda
@pytest.mark.parametrize("name", ["mamba2-g1", "bamba-attn-middle"])
def test_engine_plans_its_pools_on_gpu(name: str, hf_checkpoint: Any) -> None:
    path, _ = hf_checkpoint(name)
    hybrid = name.startswith("bamba")
    llm = LLM(model=str(path), device="cuda", kernel_backend="torch", max_num_seqs=8, max_num_batched_tokens=256,
              gpu_memory_utilization=0.5, enforce_eager=hybrid, num_kv_blocks=7)
    engine = llm.engine
    plan = engine.memory_plan
    assert plan is not None
    assert plan.num_state_slots == engine.cache.num_slots == 8
    assert engine.pool.num_slots == 8 + plan.num_scratch_slots == (8 if hybrid else 9)
    assert plan.profile.weights > 0 and plan.profile.activations > 0
    if hybrid:
        assert engine.cache.num_blocks == plan.num_kv_blocks > 7  # the plan, not the explicit size
    else:
        assert plan.num_kv_blocks == 0 and plan.profile.graphs > 0
    assert engine.pool.nbytes() == plan.pool_bytes
