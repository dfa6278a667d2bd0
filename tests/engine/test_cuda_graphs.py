"""CUDA graphs for decode steps.

CPU: bucket sizes and padding, the static buffers' filling, and the captured body run eagerly
through the static buffers (`capture=False`) against the plain eager path — same greedy tokens,
with batches that need padding.  GPU: captured graphs against eager, and the GPU engine against
the CPU engine, on tiny transformers checkpoints.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from pd_ssm import LLM, SamplingParams
from pd_ssm.cache.pool import CachePool
from pd_ssm.config import EngineConfig, ModelConfig
from pd_ssm.engine.cuda_graphs import (
    MAX_CAPTURE_SIZE,
    DecodeBuffers,
    DecodeGraphs,
    DecodeRows,
    GraphCaptureError,
    bucket_for,
    capture_sizes,
    check_capturable,
    pad_decode,
    table_width,
)
from pd_ssm.engine.engine import Engine
from pd_ssm.kernels.dispatch import KernelNotAvailable, get_kernels
from tests.conftest import needs_cuda, random_prompts

PURE = ["mamba2-g1", "mamba2-g2-tied"]
HYBRID = ["bamba-attn-middle", "nemotron-h"]
# lengths and max_tokens chosen so requests finish at different steps: the decode batch walks
# through 7, 6, 5, 4, 3, 2, 1 sequences, most of which pad to a bucket of 4 or 8
LENGTHS = [3, 17, 9, 30, 1, 12, 21]
MAX_TOKENS = [5, 12, 20, 8, 15, 3, 10]


# --- buckets and padding (pure) ----------------------------------------------------------
def test_capture_sizes() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(100) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 100]
    big = capture_sizes(1000)
    assert big[:9] == [1, 2, 4, 8, 16, 24, 32, 48, 64] and big[-1] == MAX_CAPTURE_SIZE == 256
    assert all(b - a == 16 for a, b in zip(big[7:], big[8:], strict=False))


def test_bucket_for() -> None:
    sizes = capture_sizes(128)
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 5, 8, 9, 25, 33, 49, 128)] == [1, 2, 4, 8, 8, 16, 32, 48, 64, 128]
    assert bucket_for(129, sizes) is None
    with pytest.raises(ValueError):
        bucket_for(0, sizes)


def hybrid_rows() -> DecodeRows:
    return DecodeRows(
        input_ids=[11, 12, 13],
        positions=[5, 9, 2],
        slot_mapping=[21, 37, 6],
        state_indices=[3, 0, 2],
        block_tables=[[5, 1], [4, 9, 7], [1]],
    )


def test_pad_decode_layout() -> None:
    p = pad_decode(hybrid_rows(), 4, scratch_slot=8, max_width=4)
    assert (p.num_rows, p.size, p.width) == (3, 4, 3)
    assert p.stage == [
        11, 12, 13, 0,  # input_ids
        5, 9, 2, 0,  # positions
        21, 37, 6, -1,  # slot_mapping: the padding row writes no KV
        5, 9, 2, 0,  # context_lens
        6, 10, 3, 1,  # seq_lens
        3, 0, 2, 8,  # state_indices: the padding row uses the scratch slot
    ]
    assert p.tables == [[5, 1, 0], [4, 9, 7], [1, 0, 0], [0, 0, 0]]


def test_pad_decode_pure_ssm_and_errors() -> None:
    rows = DecodeRows([7], [40], [-1], [2], [[]])
    p = pad_decode(rows, 2, scratch_slot=5, max_width=1)
    assert p.width == 0 and p.tables == []
    assert p.stage == [7, 0, 40, 0, -1, -1, 40, 0, 41, 1, 2, 5]
    assert pad_decode(rows, 1, scratch_slot=5, max_width=1).stage == [7, 40, -1, 40, 41, 2]
    with pytest.raises(ValueError, match="cannot pad"):
        pad_decode(hybrid_rows(), 2, scratch_slot=8, max_width=4)
    with pytest.raises(ValueError, match="width"):
        pad_decode(hybrid_rows(), 4, scratch_slot=8, max_width=2)


def test_buffers_fill_and_inputs() -> None:
    buf = DecodeBuffers(max_size=8, width=4, vocab_size=10, device=torch.device("cpu"))
    buf.fill(pad_decode(hybrid_rows(), 8, scratch_slot=9, max_width=4))
    for size in (8, 4, 1):  # each bucket reads its own layout: padding must be written per size
        buf.pad_with_scratch(size, 9)
        ids, _, meta = buf.inputs(size)
        assert meta.state_indices.tolist() == [9] * size and meta.slot_mapping.tolist() == [-1] * size
        assert meta.seq_lens.tolist() == [1] * size and ids.tolist() == [0] * size
        assert meta.block_tables.abs().sum() == 0

    buf.fill(pad_decode(hybrid_rows(), 4, scratch_slot=9, max_width=4))
    ids, positions, meta = buf.inputs(4)
    assert ids.tolist() == [11, 12, 13, 0] and positions.tolist() == [5, 9, 2, 0]
    assert (meta.num_decodes, meta.num_prefills, meta.num_tokens) == (4, 0, 4)
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert meta.context_lens.tolist() == [5, 9, 2, 0] and meta.seq_lens.tolist() == [6, 10, 3, 1]
    assert meta.has_initial_state.tolist() == [True, True, True, False]
    assert meta.state_indices.tolist() == [3, 0, 2, 9] and meta.slot_mapping.tolist() == [21, 37, 6, -1]
    for t in (meta.context_lens, meta.seq_lens, meta.state_indices, meta.block_tables, meta.query_start_loc):
        assert t.dtype == torch.int32
    assert meta.slot_mapping.dtype == ids.dtype == positions.dtype == torch.int64
    assert meta.block_tables.tolist() == [[5, 1, 0, 0], [4, 9, 7, 0], [1, 0, 0, 0], [0, 0, 0, 0]]
    # every per-row input is a view of the stage (the captured step casts nothing), and a token
    # feed writes the ids through `input_ids`
    stage = buf.stage.untyped_storage().data_ptr()
    for t in (ids, positions, meta.slot_mapping, meta.context_lens, meta.seq_lens, meta.state_indices):
        assert t.untyped_storage().data_ptr() == stage
    buf.input_ids(4)[:2].copy_(torch.tensor([70, -3]))
    assert buf.inputs(4)[0].tolist() == [70, -3, 13, 0] and buf.inputs(4)[1].tolist() == [5, 9, 2, 0]

    # a narrower batch afterwards: the columns it does not use are zero again, not stale
    buf.fill(pad_decode(DecodeRows([1, 2], [3, 4], [3, 4], [0, 1], [[6], [2]]), 2, scratch_slot=9, max_width=4))
    _, _, meta = buf.inputs(2)
    assert meta.block_tables.tolist() == [[6, 0, 0, 0], [2, 0, 0, 0]]


def test_table_width() -> None:
    assert table_width(100, 16, uses_kv=True) == 7
    assert table_width(96, 16, uses_kv=True) == 6
    assert table_width(1 << 20, 16, uses_kv=False) == 1


def test_hybrid_on_torch_kernels_is_refused_before_capture(hf_checkpoint: Any) -> None:
    torch_kernels = get_kernels("torch", "cpu")
    hybrid = ModelConfig.from_pretrained(hf_checkpoint("bamba-attn-middle")[0])
    with pytest.raises(GraphCaptureError, match="enforce_eager"):
        check_capturable(torch_kernels, hybrid)
    check_capturable(torch_kernels, ModelConfig.from_pretrained(hf_checkpoint("mamba2-g1")[0]))


# --- the graph body run eagerly through the static buffers (CPU) --------------------------
def add_scratch_slot(engine: Engine) -> tuple[int, int]:
    """What the engine does on CUDA before capturing graphs: a pool with one scratch slot past the
    manager's. Returns (scratch slot, block-table width of the graphs)."""
    n = engine.cache.num_slots
    cc = dataclasses.replace(engine.config.cache, num_state_slots=n + 1)
    engine.pool = engine.runner.pool = CachePool(engine.model_config, cc, engine.device, engine.dtype)
    return n, table_width(engine.max_model_len, cc.block_size, engine.cache.uses_kv)


def install_static_decode(engine: Engine, sizes: list[int]) -> DecodeGraphs:
    """A scratch slot, and DecodeGraphs(capture=False) in the runner (the engine's CUDA setup)."""
    scratch, width = add_scratch_slot(engine)
    graphs = DecodeGraphs(engine.model, engine.pool, sizes=sizes, scratch_slot=scratch, width=width, capture=False)
    engine.runner.graphs = graphs
    return graphs


def record_batches(graphs: DecodeGraphs) -> list[int]:
    seen: list[int] = []
    inner = graphs.run

    def run(rows: DecodeRows, *args: Any) -> torch.Tensor:
        seen.append(len(rows.input_ids))
        return inner(rows, *args)

    graphs.run = run  # type: ignore[method-assign]
    return seen


def generate(llm: LLM, name: str) -> list[list[int]]:
    prompts = random_prompts(384, LENGTHS, seed=len(name))
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def tiny_llm(path: Any, **kw: Any) -> LLM:
    args: dict[str, Any] = dict(max_num_seqs=8, max_num_batched_tokens=64, block_size=4, num_kv_blocks=256)
    args.update(kw)
    return LLM(model=str(path), **args)


@pytest.mark.parametrize("name", ["mamba2-g1", "nemotron-h"])
def test_warm_up_steps_touch_only_the_scratch_slot(name: str, hf_checkpoint: Any) -> None:
    llm = tiny_llm(hf_checkpoint(name)[0])
    install_static_decode(llm.engine, capture_sizes(8))  # runs every bucket's padding-only step
    pool, scratch = llm.engine.pool, llm.engine.cache.num_slots
    for states in (pool.conv_state, pool.ssm_state):
        assert states[:, :scratch].abs().sum() == 0
        assert states[:, scratch].abs().sum() > 0
    assert pool.k_cache.abs().sum() == 0 and pool.v_cache.abs().sum() == 0  # slot_mapping -1: no KV write


@pytest.mark.parametrize("name", ["mamba2-g1", "bamba-attn-middle", "nemotron-h"])
def test_static_buffer_path_matches_eager(name: str, hf_checkpoint: Any) -> None:
    path, _ = hf_checkpoint(name)
    reference = generate(tiny_llm(path), name)
    llm = tiny_llm(path)
    graphs = install_static_decode(llm.engine, capture_sizes(8))
    seen = record_batches(graphs)
    assert generate(llm, name) == reference
    assert graphs.replays == len(seen) > 0
    assert {3, 5, 6, 7} & set(seen), f"no batch needed padding: {sorted(set(seen))}"


def test_graphs_off_on_cpu(hf_checkpoint: Any) -> None:
    path, _ = hf_checkpoint("mamba2-g1")
    llm = tiny_llm(path, num_state_slots=6)
    assert llm.engine.runner.graphs is None and llm.engine.memory_plan is None
    assert llm.engine.pool.num_slots == llm.engine.cache.num_slots == 6  # explicit sizes, no scratch slot
    assert not EngineConfig(model=str(path)).use_cuda_graphs


# --- GPU ---------------------------------------------------------------------------------
def gpu_backend() -> str:
    """Triton once every kernel has landed, the torch references until then."""
    try:
        get_kernels("triton", "cuda")
    except KernelNotAvailable:
        return "torch"
    return "triton"


def gpu_llm(path: Any, **kw: Any) -> LLM:
    args: dict[str, Any] = dict(device="cuda", kernel_backend=gpu_backend(), gpu_memory_utilization=0.5)
    args.update(kw)
    return tiny_llm(path, **args)


@needs_cuda
@pytest.mark.parametrize("name", PURE + HYBRID)
def test_graphs_match_eager_on_gpu(name: str, hf_checkpoint: Any) -> None:
    path, _ = hf_checkpoint(name)
    if name in HYBRID and gpu_backend() == "torch":
        with pytest.raises(GraphCaptureError, match="enforce_eager"):
            gpu_llm(path)
        pytest.skip("hybrid graphs need a capture-safe write_kv_cache (the Triton kernels)")
    eager = gpu_llm(path, enforce_eager=True)
    assert eager.engine.runner.graphs is None
    reference = generate(eager, name)
    del eager
    llm = gpu_llm(path)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and sorted(graphs.graphs) == capture_sizes(8)
    assert llm.engine.pool.num_slots == llm.engine.cache.num_slots + 1  # the scratch slot
    seen = record_batches(graphs)
    assert generate(llm, name) == reference
    assert graphs.replays == len(seen) > 0
    assert {3, 5, 6, 7} & set(seen), f"no batch needed padding: {sorted(set(seen))}"


@needs_cuda
@pytest.mark.parametrize("name", ["mamba2-g1", "mamba2-g2-tied", "bamba-attn-middle"])
def test_gpu_fp32_matches_cpu_engine(name: str, hf_checkpoint: Any) -> None:
    path, _ = hf_checkpoint(name)
    cpu = generate(tiny_llm(path), name)
    eager = name in HYBRID and gpu_backend() == "torch"
    llm = gpu_llm(path, dtype="float32", enforce_eager=eager)
    assert generate(llm, name) == cpu
