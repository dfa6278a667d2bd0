"""CUDA graphs for prefill-only steps.

CPU: buckets, padding layout, static buffers, and the captured body run eagerly through the static
buffers (`capture=False`) against the plain eager path — same greedy tokens, steps that need
padding sequences; steps that mix decodes and prefill chunks run as a prefill graph and a decode
graph.  GPU: captured prefill graphs against eager on tiny transformers checkpoints, mixed steps
included.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pd_ssm import LLM, SamplingParams
from pd_ssm.engine.cuda_graphs import DecodeGraphs, capture_sizes
from pd_ssm.engine.engine import Engine
from pd_ssm.engine.prefill_graphs import (
    PrefillBuffers,
    PrefillGraphs,
    VarlenRows,
    fits,
    pad_prefill,
    prefill_buckets,
)
from tests.conftest import needs_cuda, random_prompts
from tests.engine.test_cuda_graphs import add_scratch_slot, tiny_llm


# --- buckets and padding (pure) ----------------------------------------------------------
def test_prefill_buckets() -> None:
    small = [(t, s) for t in (256, 512, 1024) for s in (1, 4, 16, 17)]
    assert prefill_buckets(2048, 128) == small + [(2048, s) for s in range(1, 18)]
    assert prefill_buckets(3000, 2) == [(t, s) for t in (256, 512, 1024, 2048) for s in (1, 3)] + [
        (3000, 1), (3000, 2), (3000, 3)]
    assert prefill_buckets(100, 1) == [(100, 1), (100, 2)]
    with pytest.raises(ValueError):
        prefill_buckets(0, 4)


@pytest.mark.parametrize("max_tokens,max_seqs", [(2048, 128), (300, 5), (64, 2)])
def test_every_step_up_to_the_cap_has_a_bucket(max_tokens: int, max_seqs: int) -> None:
    buckets = prefill_buckets(max_tokens, max_seqs)
    cap = min(max_seqs, 16)
    for s in range(1, cap + 1):
        for t in range(s, max_tokens + 1):
            assert any(fits(t, s, b) for b in buckets), (t, s)
    assert not any(fits(max_tokens, cap + 2, b) for b in buckets)


def test_fits() -> None:
    assert fits(2048, 1, (2048, 1))  # exact: no padding at all
    assert not fits(2000, 1, (2048, 1))  # 48 padding tokens but no padding sequence to hold them
    assert fits(2000, 1, (2048, 4))  # three padding sequences of 46, 1 and 1 tokens
    assert not fits(2047, 1, (2048, 4))  # one padding token cannot make three sequences
    assert fits(2045, 1, (2048, 4)) and fits(2048, 4, (2048, 4))
    assert not fits(2049, 1, (4096, 1)) and fits(2049, 1, (4096, 4))
    assert not fits(10, 5, (2048, 4)) and not fits(0, 0, (256, 1))


def hybrid_rows() -> VarlenRows:
    return VarlenRows(
        input_ids=[11, 12, 13, 14, 15],
        positions=[4, 5, 6, 0, 1],
        slot_mapping=[20, 21, 22, 36, 37],
        query_start_loc=[0, 3, 5],
        context_lens=[4, 0],
        state_indices=[3, 1],
        block_tables=[[5, 1], [9]],
    )


def test_pad_prefill_layout() -> None:
    p = pad_prefill(hybrid_rows(), (9, 4), scratch_slot=7, max_width=3)
    assert p.tokens == [
        11, 12, 13, 14, 15, 0, 0, 0, 0,  # input_ids
        4, 5, 6, 0, 1, 0, 1, 2, 0,  # positions: two padding sequences of 3 and 1 tokens from 0
        20, 21, 22, 36, 37, -1, -1, -1, -1,  # slot_mapping: padding writes no KV
    ]
    assert p.seqs == [
        0, 3, 5, 8, 9,  # query_start_loc
        4, 0, 0, 0,  # context_lens
        7, 2, 3, 1,  # seq_lens
        3, 1, 7, 7,  # state_indices: padding in the scratch slot
    ]
    assert p.width == 2 and p.tables == [[5, 1], [9, 0], [0, 0], [0, 0]]
    with pytest.raises(ValueError, match="does not pad"):
        pad_prefill(hybrid_rows(), (6, 4), scratch_slot=7, max_width=3)
    with pytest.raises(ValueError, match="width"):
        pad_prefill(hybrid_rows(), (9, 4), scratch_slot=7, max_width=1)


def test_buffers_fill_and_inputs() -> None:
    buf = PrefillBuffers(max_tokens=16, max_seqs=4, width=3, device=torch.device("cpu"))
    buf.fill(pad_prefill(hybrid_rows(), (9, 4), scratch_slot=7, max_width=3), (9, 4))
    ids, positions, meta = buf.inputs((9, 4))
    assert ids.tolist() == [11, 12, 13, 14, 15, 0, 0, 0, 0]
    assert positions.tolist() == [4, 5, 6, 0, 1, 0, 1, 2, 0]
    assert (meta.num_decodes, meta.num_prefills, meta.num_tokens) == (0, 4, 9)
    assert meta.query_start_loc.tolist() == [0, 3, 5, 8, 9]
    assert meta.context_lens.tolist() == [4, 0, 0, 0] and meta.seq_lens.tolist() == [7, 2, 3, 1]
    assert meta.has_initial_state.tolist() == [True, False, False, False]
    assert meta.state_indices.tolist() == [3, 1, 7, 7]
    assert meta.slot_mapping.tolist() == [20, 21, 22, 36, 37, -1, -1, -1, -1]
    assert meta.block_tables.tolist() == [[5, 1, 0], [9, 0, 0], [0, 0, 0], [0, 0, 0]]
    for t in (meta.query_start_loc, meta.context_lens, meta.seq_lens, meta.state_indices, meta.block_tables):
        assert t.dtype == torch.int32
    assert meta.prefill_view().query_start_loc.tolist() == [0, 3, 5, 8, 9]  # rebased by element 0


# --- the graph body run eagerly through the static buffers (CPU) --------------------------
LENGTHS = [150, 5, 90, 21, 9, 130]  # long ones take several prefill-only steps
MAX_TOKENS = [4, 9, 6, 12, 3, 7]


def install_static_prefill(engine: Engine, buckets: list[tuple[int, int]]) -> PrefillGraphs:
    """A scratch slot, and PrefillGraphs(capture=False) in the runner (the engine's CUDA setup)."""
    scratch, width = add_scratch_slot(engine)
    graphs = PrefillGraphs(engine.model, engine.pool, buckets=buckets, scratch_slot=scratch, width=width,
                           capture=False)
    engine.runner.prefill_graphs = graphs
    return graphs


def generate(llm: LLM, name: str, *, seeded: bool = False) -> list[list[int]]:
    prompts = random_prompts(384, LENGTHS, seed=len(name))
    params = [SamplingParams(temperature=0.8 if seeded else 0, seed=17 + i if seeded else None, max_tokens=n,
                             ignore_eos=True) for i, n in enumerate(MAX_TOKENS)]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("name", ["mamba2-g1", "bamba-attn-middle", "nemotron-h"])
@pytest.mark.parametrize("seeded", [False, True])
def test_static_buffer_path_matches_eager(name: str, seeded: bool, hf_checkpoint: Any) -> None:
    path, _ = hf_checkpoint(name)
    reference = generate(tiny_llm(path), name, seeded=seeded)
    # max_num_seqs 2 keeps decodes out of the first steps: several prefill-only steps, some padded
    reference_2 = generate(tiny_llm(path, max_num_seqs=2), name, seeded=seeded)
    assert reference_2 == reference
    llm = tiny_llm(path, max_num_seqs=2)
    graphs = install_static_prefill(llm.engine, prefill_buckets(64, 2))
    seen: list[tuple[int, int]] = []
    inner = graphs.run

    def run(rows: VarlenRows) -> torch.Tensor:
        seen.append((len(rows.input_ids), len(rows.context_lens)))
        return inner(rows)

    graphs.run = run  # type: ignore[method-assign]
    assert generate(llm, name, seeded=seeded) == reference
    assert graphs.replays == len(seen) >= 3
    assert any(graphs.bucket(t, s) != (t, s) for t, s in seen), f"no step needed padding: {seen}"


@pytest.mark.parametrize("name", ["mamba2-g1", "bamba-attn-middle", "nemotron-h"])
@pytest.mark.parametrize("seeded", [False, True])
def test_mixed_steps_run_as_a_prefill_and_a_decode_graph(name: str, seeded: bool, hf_checkpoint: Any) -> None:
    path, _ = hf_checkpoint(name)
    reference = generate(tiny_llm(path), name, seeded=seeded)
    llm = tiny_llm(path)
    engine = llm.engine
    scratch, width = add_scratch_slot(engine)  # one scratch slot for both kinds, as on CUDA
    decode = DecodeGraphs(engine.model, engine.pool, sizes=capture_sizes(8), scratch_slot=scratch, width=width,
                          capture=False)
    prefill = PrefillGraphs(engine.model, engine.pool, buckets=prefill_buckets(64, 8), scratch_slot=scratch,
                            width=width, capture=False)
    engine.runner.graphs, engine.runner.prefill_graphs = decode, prefill
    mixed: list[tuple[int, int]] = []
    inner = engine.runner._split_step

    def split(sched: Any) -> Any:
        mixed.append((len(sched.decodes), len(sched.prefills)))
        return inner(sched)

    engine.runner._split_step = split  # type: ignore[method-assign]
    assert generate(llm, name, seeded=seeded) == reference
    assert engine.runner.split_steps == len(mixed) >= 3, mixed
    assert any(d > 1 for d, _ in mixed) and any(p > 1 for _, p in mixed), mixed
    # every step ran in one of the two kinds of graph: none was eager
    assert decode.replays >= len(mixed) and prefill.replays >= len(mixed)


def test_warm_up_touches_only_the_scratch_slot(hf_checkpoint: Any) -> None:
    llm = tiny_llm(hf_checkpoint("nemotron-h")[0])
    graphs = install_static_prefill(llm.engine, [(16, 1), (16, 4), (32, 1), (32, 4)])
    for bucket in graphs.buckets:  # what capture runs, eagerly
        graphs._padding_only(bucket)
        graphs._body(bucket)
    pool, scratch = llm.engine.pool, llm.engine.cache.num_slots
    for states in (pool.conv_state, pool.ssm_state):
        assert states[:, :scratch].abs().sum() == 0
        assert states[:, scratch].abs().sum() > 0
    assert pool.k_cache.abs().sum() == 0 and pool.v_cache.abs().sum() == 0


# --- GPU ---------------------------------------------------------------------------------
def gpu_pair(path: Any, name: str, max_num_seqs: int) -> tuple[list[list[int]], LLM, dict[str, Any]]:
    """(the tokens of an enforce_eager GPU engine, an engine with its graphs, their flags)."""
    gpu: dict[str, Any] = dict(device="cuda", kernel_backend="triton", gpu_memory_utilization=0.5,
                               max_num_seqs=max_num_seqs)
    return generate(tiny_llm(path, enforce_eager=True, **gpu), name), tiny_llm(path, **gpu), gpu


@needs_cuda
@pytest.mark.parametrize("name", ["mamba2-g1", "bamba-attn-middle", "nemotron-h"])
def test_prefill_graphs_match_eager_on_gpu(name: str, hf_checkpoint: Any) -> None:
    path, _ = hf_checkpoint(name)
    reference, llm, gpu = gpu_pair(path, name, max_num_seqs=2)
    graphs = llm.engine.runner.prefill_graphs
    assert graphs is not None and list(graphs.graphs) == graphs.buckets[::-1] == prefill_buckets(64, 2)[::-1]
    replays = graphs.replays
    assert generate(llm, name) == reference
    assert graphs.replays > replays
    off = tiny_llm(path, prefill_cuda_graphs=False, **gpu)
    assert off.engine.runner.prefill_graphs is None and generate(off, name) == reference


@needs_cuda
@pytest.mark.parametrize("name", ["mamba2-g1", "bamba-attn-middle", "nemotron-h"])
def test_mixed_steps_in_graphs_match_eager_on_gpu(name: str, hf_checkpoint: Any) -> None:
    reference, llm, _ = gpu_pair(hf_checkpoint(name)[0], name, max_num_seqs=8)  # decodes beside prefills
    assert generate(llm, name) == reference
    assert llm.engine.runner.split_steps >= 3
