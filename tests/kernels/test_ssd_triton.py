"""mamba_chunk_scan_varlen_triton against mamba_chunk_scan_varlen_ref.

Without CUDA the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1) on
tiny shapes; with CUDA the same cases run with 4x the chunk, lengths and positions, and real head
sizes. Every case draws random inputs and a random pool whose unused slots must stay untouched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import unittest.mock
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch
from kernel_oracles import INF_LIMIT, cu_of, gen, i32, make_ssm_inputs
from torch import Tensor

pytest.importorskip("triton")

from pd_ssm.kernels import ssd_triton  # noqa: E402
from pd_ssm.kernels.launch import FastKernel  # noqa: E402
from pd_ssm.kernels.ssd import ScanOutput, _chunk_grid, mamba_chunk_scan_varlen_ref  # noqa: E402
from pd_ssm.kernels.ssd_config import LARGE_BATCH_TOKENS, SSDConfig, default_config  # noqa: E402
from pd_ssm.kernels.ssd_plan import kernel_chunk, max_logical_chunks, use_serial_states  # noqa: E402
from pd_ssm.kernels.ssd_triton import mamba_chunk_scan_varlen_triton, ssd_scan_with_config  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":
    # NOTE: Triton 3.6's interpreter turns a loop bound that is a kernel argument into int() of a
    # 1-element 1-D array, which numpy >= 2.4 rejects; read it with .item() instead. Installed for
    # the whole process once this module is imported (a conftest.py would be its natural home); it
    # rides on the interpreter's own per-launch patch/restore scope.
    from triton.runtime import interpreter as _interp

    _patch_lang_tensor = _interp._patch_lang_tensor

    def _patch_with_item_index(tensor, scope):  # type: ignore[no-untyped-def]
        _patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    _interp._patch_lang_tensor = _patch_with_item_index

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
# tiny in the interpreter; on a GPU 4x the chunk (and every length and position) and real head sizes
H, P, N, CHUNK, X = (8, 64, 64, 64, 4) if CUDA else (4, 16, 16, 16, 1)


# Every kernel test runs once per variant: the default path (C B^T fused into the scan, fp32 chunk
# states; the scan's tiles through TMA descriptors only from 4096 tokens, so never at these
# lengths), the shared-C B^T path (one CB launch per (chunk, group) in the dot dtype, two head sets
# looped per scan program, chunk states in the dot dtype), the TMA scan at every length (every
# dtype), and the pointer-load scan; its fields laid over those an explicit config leaves at their
# defaults. A variant whose fields the test's config overrides all runs the same config as an earlier
# one, and is skipped (run_case).
VARIANTS: dict[str, dict[str, Any]] = {
    "fused": {},
    "shared_cb": dict(scan_cb="low", scan_head_loop=2, chunk_states_low=True),
    # TMA at every length; the default takes C, B and x tiles by pointer loads, masked, below 4096
    # tokens, which no case here reaches (so a "pointers" variant would repeat "fused")
    "tma": dict(scan_tma_min_tokens=0),
    # NOTE: no variant for the serial state kernel: the default takes it wherever sequences average
    # at most 1024 tokens, i.e. in every case here ("fused" and "tma" run it by pointer loads and
    # through TMA), and test_serial_state_steps_within_a_chunk its steps shorter than a chunk
    "two_kernels": dict(state_serial=False),  # chunk states, then their passing, at every batch size
    # the large-batch default (ssd_config.default_config from LARGE_BATCH_TOKENS): C B^T made once per
    # (chunk, group) in fp32 and loaded by the scan a step ahead, two stages, the scan's registers
    # capped, dt' by its own launch on the two-kernel path, where the scan adds the entering states last
    # (after its PDL gate on a GPU)
    "large_batch": dict(scan_cb="fp32", scan_stages=2, scan_maxnreg=128, scan_prefetch=True, state_dt_launch=True,
                        scan_overlap=True),
    # the same on the two-kernel path at every batch size: the entering states added last everywhere
    "large_batch_two_kernels": dict(scan_cb="fp32", scan_stages=2, scan_maxnreg=128, scan_prefetch=True,
                                    state_dt_launch=True, scan_overlap=True, state_serial=False),
    # the serial path in chunks of a quarter of the model's where sequences average two of them (the
    # default's 128 of 256 never shows at these chunks): boundary states still at the model's multiples
    "serial_subchunk": dict(serial_max_tokens=1 << 30, serial_chunk=CHUNK // 4),
}
_variant: dict[str, Any] = {}
_variant_name: list[str] = []


@pytest.fixture(autouse=True, params=list(VARIANTS))
def ssd_variant(request: pytest.FixtureRequest) -> Iterator[None]:
    _variant.clear()
    _variant.update(VARIANTS[request.param])
    _variant_name[:] = [request.param]
    yield
    _variant.clear()
    _variant_name.clear()


def with_variant(config: SSDConfig | None, fields: dict[str, Any]) -> SSDConfig | None:
    """`config` with a variant's fields, where it left them at their defaults (None: no fields, no config)."""
    if not fields:
        return config
    config = config or SSDConfig()
    keep = {k: v for k, v in fields.items() if getattr(config, k) == getattr(SSDConfig(), k)}
    return dataclasses.replace(config, **keep)


@contextlib.contextmanager
def nan_scratch() -> Iterator[None]:
    """torch.empty hands out floating tensors full of NaN, and int32 ones full of a large number,
    while the kernels run: an output or scratch element read before any kernel wrote it shows up as
    NaN, or as a wrong chunk or count (on a GPU the caching allocator may hand back such memory; on
    a CPU fresh memory is mostly zeros, which hides the read)."""
    empty = torch.empty

    def poisoned(*args: Any, **kwargs: Any) -> Tensor:
        t = empty(*args, **kwargs)
        if t.dtype == torch.int32:
            return t.fill_(0x3A3A3A3A)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    with unittest.mock.patch.object(torch, "empty", poisoned):
        yield


def rel_err(a: Tensor, b: Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def run_case(
    lengths: Sequence[int], ctx: Sequence[int], has_init: Sequence[bool], *, G: int = 1, seed: int,
    chunk: int = CHUNK, dtype: torch.dtype = torch.float32, pool_dtype: torch.dtype = torch.float32,
    limit: Sequence[float] = INF_LIMIT, boundaries: bool = True, with_D_bias: bool = True,
    softplus: bool = True, strided: bool = False, nan_in_unread_slots: bool = False,
    dstate: int = N, config: SSDConfig | None = None, fp32_tol: float = 1e-4, max_seqlen: int | None = None,
) -> tuple[ScanOutput, ScanOutput]:
    """Scan one batch with both implementations; check out, pool and boundary states; return both."""
    g = gen(seed)
    lengths = [n * X for n in lengths]
    ctx = [c * X for c in ctx]
    S, T = len(lengths), sum(lengths)
    # NOTE: the pointer-load path is tested as the default's below this length (VARIANTS)
    assert T < SSDConfig().scan_tma_min_tokens, "a case this long needs a pointer-load variant back"
    N = dstate
    inp = make_ssm_inputs(g, T, H, P, G, N, dtype)
    x, dt, B, C = inp.x, inp.dt, inp.B, inp.C
    if not softplus:  # the caller passes step sizes: positive, or the recurrence grows without bound
        dt = torch.nn.functional.softplus(dt.float()).to(dtype)
    if strided:  # views into one projection, as the mixer passes them: token stride > row size
        proj = torch.randn(T, H * P + 2 * G * N + H + 5, generator=g).to(dtype)
        x = proj[:, : H * P].view(T, H, P).copy_(x)
        B = proj[:, H * P: H * P + G * N].view(T, G, N).copy_(B)
        C = proj[:, H * P + G * N: H * P + 2 * G * N].view(T, G, N).copy_(C)
        dt = proj[:, H * P + 2 * G * N: H * P + 2 * G * N + H].copy_(dt)
    num_slots = S + 3
    pool = torch.randn(num_slots, H, P, N, generator=g).to(pool_dtype)
    slots = torch.randperm(num_slots, generator=g)[:S].tolist()
    if nan_in_unread_slots:
        for s, use in zip(slots, has_init, strict=True):
            if not use:
                pool[s] = float("nan")
    D, dt_bias = (inp.D, inp.dt_bias) if with_D_bias else (None, None)

    def scan(fn, pool_: Tensor) -> ScanOutput:  # type: ignore[no-untyped-def]
        return fn(
            x.to(DEV), dt.to(DEV), inp.A.to(DEV), B.to(DEV), C.to(DEV), chunk,
            cu_seqlens=i32(cu_of(lengths)).to(DEV), context_lens=i32(ctx).to(DEV), ssm_state=pool_,
            state_indices=i32(slots).to(DEV), has_initial_state=torch.tensor(list(has_init), device=DEV),
            D=None if D is None else D.to(DEV), dt_bias=None if dt_bias is None else dt_bias.to(DEV),
            dt_softplus=softplus, dt_limit=limit, return_boundary_states=boundaries, max_seqlen=max_seqlen,
        )

    if _variant_name:  # the variant's fields, where an explicit config left them at their defaults
        mine = with_variant(config, _variant)
        for name in VARIANTS:
            if name == _variant_name[0]:
                break
            if with_variant(config, VARIANTS[name]) == mine:
                pytest.skip(f"runs the config of variant {name!r}: the test's config sets every field this one changes")
        config = mine
    pool_ref, pool_tri = pool.to(DEV, copy=True), pool.to(DEV, copy=True)
    ref = scan(mamba_chunk_scan_varlen_ref, pool_ref)
    with nan_scratch():
        if config is None:
            tri = scan(mamba_chunk_scan_varlen_triton, pool_tri)
        else:
            tri = scan(functools.partial(ssd_scan_with_config, config=config), pool_tri)

    assert tri.out.dtype == dtype and tri.out.shape == (T, H, P)
    assert torch.isfinite(tri.out).all()
    low = dtype != torch.float32
    if low:  # bf16 / fp16 operands of the dots, and bf16 / fp16 passed states
        assert rel_err(tri.out, ref.out) < 1e-2
    else:
        torch.testing.assert_close(tri.out, ref.out, rtol=fp32_tol, atol=fp32_tol)
    unused = sorted(set(range(num_slots)) - set(slots))
    assert torch.equal(pool_tri[unused].cpu(), pool[unused]), "a slot no sequence owns was written"
    for s in slots:
        if low or pool_dtype != torch.float32:
            assert rel_err(pool_tri[s], pool_ref[s]) < (1e-2 if low else 4e-3), f"final state of slot {s}"
        else:
            torch.testing.assert_close(pool_tri[s], pool_ref[s], rtol=fp32_tol, atol=fp32_tol)

    if not boundaries:
        assert tri.boundary_states is None and tri.boundary_cu is None
        return ref, tri
    assert tri.boundary_states is not None and tri.boundary_cu is not None
    assert ref.boundary_states is not None and ref.boundary_cu is not None
    assert tri.boundary_cu.dtype == torch.int32 and tri.boundary_states.dtype == torch.float32
    assert tri.boundary_cu.tolist() == ref.boundary_cu.tolist()
    assert tri.boundary_states.shape == ref.boundary_states.shape
    if ref.boundary_states.numel():
        if low:
            assert rel_err(tri.boundary_states, ref.boundary_states) < 1e-2
        else:
            torch.testing.assert_close(tri.boundary_states, ref.boundary_states, rtol=fp32_tol, atol=fp32_tol)
    return ref, tri


@pytest.mark.parametrize("G", [1, 2])
def test_varlen_lengths_around_the_chunk(G: int) -> None:
    # one token, shorter than a chunk, exactly a chunk, several chunks, straddling from mid-chunk
    run_case([1, 7, 16, 40, 23], [0, 0, 0, 0, 9], [False] * 5, G=G, seed=1 + G)


def test_mid_chunk_starts_with_initial_states() -> None:
    # every context_len off the grid; sequences ending on, before and past a boundary
    run_case([3, 13, 20, 1, 30], [5, 3, 7, 15, 18], [True, True, False, True, True], G=2, seed=10)


def test_mid_chunk_starts_without_boundary_states() -> None:
    # no boundary states: the kernels cut each sequence from its first token, not at the absolute
    # multiples of the chunk; the same function of the inputs (and the same final states)
    run_case([3, 13, 20, 1, 30, 41], [5, 3, 7, 15, 18, 9], [True, True, False, True, True, True], G=2, seed=26,
             boundaries=False)


def test_single_long_sequence_from_an_aligned_history() -> None:
    run_case([96], [32], [True], seed=11)


def test_no_initial_state_never_reads_the_slot() -> None:
    run_case([9, 18], [0, 4], [False, False], seed=12, nan_in_unread_slots=True)


def test_dt_limit_clamps() -> None:
    ref, _ = run_case([12, 21], [0, 6], [False, True], G=2, seed=13, limit=(0.2, 0.6))
    free, _ = run_case([12, 21], [0, 6], [False, True], G=2, seed=13)
    assert not torch.allclose(ref.out, free.out), "the limit changed nothing: the test does not exercise it"


def test_without_D_dt_bias_and_softplus() -> None:
    run_case([5, 19], [2, 0], [True, False], seed=14, with_D_bias=False, softplus=False, boundaries=False)


def test_boundary_states_off_returns_none() -> None:
    run_case([20, 3], [10, 0], [True, False], seed=15, boundaries=False)


def test_chunk_size_not_a_power_of_two() -> None:
    run_case([7, 25], [5, 11], [True, True], seed=16, chunk=12 * X)


def test_strided_views_of_one_projection() -> None:
    run_case([6, 17], [3, 0], [True, False], G=2, seed=17, strided=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_and_pool(dtype: torch.dtype) -> None:
    run_case([1, 6, 19, 33], [0, 2, 5, 16], [False, True, True, True], G=2, seed=18, dtype=dtype,
             pool_dtype=dtype)


def test_fp32_inputs_bf16_pool() -> None:
    run_case([5, 21], [1, 4], [True, True], seed=19, pool_dtype=torch.bfloat16)


@pytest.mark.parametrize(("G", "chunk", "config"), [
    # four heads share each C B^T block; dstate split over two programs of the state kernel
    (1, CHUNK, SSDConfig(scan_heads=4, state_block_n=N)),
    # two heads; two row blocks and several source blocks per chunk; dt' recomputed in the state kernel
    (2, 2 * CHUNK, SSDConfig(scan_heads=2, scan_block_m=CHUNK, scan_block_k=CHUNK // 2, state_block_k=CHUNK,
                             state_reread=False)),
    # C B^T made once per (chunk, group) in fp32, three row blocks; two sets of two heads per program
    (1, 3 * CHUNK, SSDConfig(scan_cb="fp32", scan_heads=2, scan_head_loop=2, scan_block_m=CHUNK, cb_block=CHUNK,
                             chunk_states_low=True)),
])
def test_block_configs(G: int, chunk: int, config: SSDConfig) -> None:
    run_case([1, 9, 30], [0, 3, 12], [False, True, True], G=G, seed=21, chunk=chunk, dstate=2 * N,
             config=config)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dt_by_a_launch_of_its_own(dtype: torch.dtype) -> None:
    # the chunk-state kernel's dt' pass as its own launch (two-kernel path): mid-chunk starts, a
    # chunk that is not a power of two (its total read at CHUNK - 1 of a padded pass), a dt clamp
    run_case([7, 25, 3], [5, 11, 0], [True, True, False], G=2, seed=27, chunk=12 * X, limit=(0.2, 0.6),
             dtype=dtype, config=SSDConfig(state_serial=False, state_dt_launch=True))


# NOTE: in chunks of 256 (on a GPU) the running sums cs of dt' A reach ~ -900 with these inputs'
# decays (down to e^-3.6 a token); each fp32 partial sum there is rounded by ~3e-5, differently by the
# kernel's tree cumsum and torch's, and e^{cs_l - cs_s} carries that: 1-2 of 580 K outputs differ by
# 1.3-2.4e-4 (H200, session 13). Shorter chunks keep 1e-4
LONG_CHUNK_FP32_TOL = 5e-4


# NOTE: the serial state kernel's own tests run under the variants that take it as it ships: by pointer
# loads, through TMA, and beside the large-batch scan (16 x 1024 tokens); the scan's variants run
# in every other test
SERIAL_VARIANTS = pytest.mark.parametrize("ssd_variant", ["fused", "tma", "large_batch"], indirect=True)


@SERIAL_VARIANTS
@pytest.mark.parametrize("block_k", [16, 4 * CHUNK])
def test_serial_state_steps_within_a_chunk(block_k: int) -> None:
    # chunks of 4 steps (or one whole step): short first chunks after mid-chunk histories, sequences
    # ending a step, a chunk or a token past a boundary, one shorter than a step
    config = SSDConfig(serial_max_tokens=1 << 30, serial_block_k=block_k, serial_block_n=N // 2)
    run_case([3, 70, 64, 17, 129], [0, 9, 64, 50, 31], [True, False, True, True, True], G=2, seed=22,
             chunk=4 * CHUNK, dstate=N, config=config, fp32_tol=LONG_CHUNK_FP32_TOL)
    run_case([3, 70, 64, 17, 129], [0, 9, 64, 50, 31], [True, False, True, True, True], G=2, seed=22,
             chunk=4 * CHUNK, dtype=torch.bfloat16, pool_dtype=torch.bfloat16, config=config)


@SERIAL_VARIANTS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("serial_chunk", [CHUNK, CHUNK // 2])
def test_serial_kernel_chunks_keep_the_models_boundaries(dtype: torch.dtype, serial_chunk: int) -> None:
    # kernel chunks of a quarter / an eighth of the model's: sequences starting mid-chunk and
    # mid-kernel-chunk, ending on a model boundary (64 + 64), on a kernel chunk's end that is not one
    # (9 + 7 * CHUNK / X), a token past a boundary (50 + 15) and inside a kernel chunk; boundary states
    # only at the model's multiples (the reference's count and order)
    config = SSDConfig(serial_max_tokens=1 << 30, serial_chunk=serial_chunk)
    assert kernel_chunk(config, 4 * CHUNK, True, 363 * X, 6) == serial_chunk
    run_case([3, 7 * CHUNK // X, 64, 15, 129, 40], [0, 9, 64, 50, 31, 2], [True, False, True, True, True, False],
             G=2, seed=25, chunk=4 * CHUNK, dtype=dtype, pool_dtype=dtype, config=config,
             fp32_tol=LONG_CHUNK_FP32_TOL)


def test_kernel_chunk_only_on_the_serial_path_where_it_pays() -> None:
    cfg = SSDConfig(serial_chunk=128)
    assert kernel_chunk(cfg, 256, True, 16 * 1024, 16) == 128 and kernel_chunk(cfg, 384, True, 256, 1) == 128
    assert kernel_chunk(cfg, 256, False, 16 * 1024, 16) == 256  # the two kernels keep the model's
    assert kernel_chunk(cfg, 128, True, 1024, 1) == 128 and kernel_chunk(cfg, 64, True, 1024, 1) == 64
    assert kernel_chunk(cfg, 200, True, 1024, 1) == 200  # 128 does not divide it
    assert kernel_chunk(cfg, 256, True, 64 * 128, 64) == 256  # sequences of one or two chunks either way
    with pytest.raises(ValueError, match="serial_chunk"):
        SSDConfig(serial_chunk=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scan_row_blocks_of_long_chunks(dtype: torch.dtype) -> None:
    # four row blocks a chunk, each with 0 to 3 blocks of sources before it (decays down to e^-190,
    # past fp32's range); mid-chunk starts, sequences shorter than a block and ending inside one
    config = SSDConfig(scan_block_m=CHUNK, scan_block_k=CHUNK // 2)
    run_case([3, 70, 64, 17, 129], [0, 9, 64, 50, 31], [True, False, True, True, True], seed=23,
             chunk=4 * CHUNK, dtype=dtype, pool_dtype=dtype, config=config, fp32_tol=LONG_CHUNK_FP32_TOL)


def test_serial_states_only_for_short_sequences() -> None:
    cfg = SSDConfig(serial_max_tokens=1024)
    assert use_serial_states(cfg, 16 * 1024, 16, None)  # the average stands in for the longest
    assert not use_serial_states(cfg, 8192, 1, None)
    assert use_serial_states(cfg, 7680 + 7 * 64, 8, None)  # one long among short ones: unseen
    assert not use_serial_states(cfg, 7680 + 7 * 64, 8, 7680)  # ... unless the caller says so
    assert use_serial_states(cfg, 64 * 128, 64, 128) and use_serial_states(cfg, 1024, 1, 1024)
    assert not use_serial_states(SSDConfig(state_serial=False), 64 * 128, 64, 128)


@pytest.mark.parametrize("hint", [False, True])
def test_longest_sequence_hint(hint: bool) -> None:
    # the average (26 tokens) is under the serial threshold, the longest (90) over it: without the
    # hint the serial kernel runs, with it the two kernels; the same results either way
    config = SSDConfig(serial_max_tokens=40 * X)
    run_case([5, 90, 5, 5], [3, 20, 0, 17], [True, True, False, True], seed=24, config=config,
             max_seqlen=90 * X if hint else None)


def test_default_config_by_dtype_and_batch() -> None:
    small, large = default_config(torch.bfloat16, LARGE_BATCH_TOKENS - 1), default_config(torch.float16, LARGE_BATCH_TOKENS)
    assert small == SSDConfig() and small.scan_cb == "fused"
    assert large.scan_cb == "fp32" and large.scan_stages == 2 and large.scan_maxnreg == 128
    assert large.scan_prefetch and large.state_dt_launch and not small.scan_prefetch and not small.state_dt_launch
    fp32 = default_config(torch.float32, 1 << 20)  # IEEE dots on FMA units: their own tiles, no C B^T launch
    assert fp32.scan_cb == "fused" and not fp32.scan_tma and not fp32.state_serial


def test_logical_chunk_bound_holds() -> None:
    """max_logical_chunks (shapes only) >= the chunks the reference's grid actually makes."""
    g = gen(20)
    for _ in range(300):
        q = int(torch.randint(1, 20, (1,), generator=g))
        S = int(torch.randint(1, 8, (1,), generator=g))
        lengths = torch.randint(1, 3 * q + 2, (S,), generator=g).tolist()
        ctx = torch.randint(0, 4 * q, (S,), generator=g).tolist()
        cu = cu_of(lengths)
        grid = _chunk_grid(cu, ctx, q, torch.device("cpu"))
        assert sum(grid.num_chunks) <= max_logical_chunks(cu[-1], S, q)


def test_a_repeated_signature_launches_by_its_first_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    # an engine scans with the same shapes layer after layer: later calls of a signature reuse the
    # first one's checks, plan and compiled kernels (on a GPU, FastKernel.verify recomputes Triton's
    # specialization of every such launch and raises where it would pick another kernel)
    monkeypatch.setattr(FastKernel, "verify", True)
    monkeypatch.setattr(ssd_triton, "_PLANS", {})
    # new inputs every call; on a GPU compiled, then cached, then direct. The interpreter caches no
    # compiled kernel (launch.py): past the second call a CPU run repeats the second
    for seed in (31, 32, 33, 34) if CUDA else (31, 32):
        run_case([5, 50, 27], [0, 37, 64], [False, True, True], seed=seed, dtype=torch.bfloat16)
    assert len(ssd_triton._PLANS) == 1
    prepared = next(iter(ssd_triton._PLANS.values()))
    assert (prepared.plan.serial is None) == (prepared.plan.state is not None)
    if CUDA:  # every launch the plan makes has its compiled kernel
        launches = [prepared.plan.meta, prepared.plan.serial, prepared.plan.dt, prepared.plan.state,
                    prepared.plan.passing, prepared.plan.cb, prepared.plan.scan]
        assert [c is not None for c in prepared.compiled] == [launch is not None for launch in launches]
    run_case([5, 50, 26], [0, 37, 64], [False, True, True], seed=35, dtype=torch.bfloat16)
    assert len(ssd_triton._PLANS) == 2  # another token count: another plan


def test_a_known_signature_with_bad_arguments_still_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ssd_triton, "_PLANS", {})
    ref, _ = run_case([7, 20], [0, 3], [False, True], seed=36)
    g = gen(37)
    inp = make_ssm_inputs(g, 27 * X, H, P, 1, N, torch.float32)
    pool = torch.randn(4, H, P, N, generator=g).to(DEV)
    kw: dict[str, Any] = dict(cu_seqlens=i32(cu_of([7 * X, 20 * X])).to(DEV), context_lens=i32([0, 3 * X]).to(DEV),
                              ssm_state=pool, state_indices=i32([0, 2]).to(DEV),
                              has_initial_state=torch.tensor([False, True], device=DEV), D=inp.D.to(DEV),
                              dt_bias=inp.dt_bias.to(DEV), dt_limit=INF_LIMIT, return_boundary_states=True)
    args = (inp.x.to(DEV), inp.dt.to(DEV), inp.A.to(DEV), inp.B.to(DEV), inp.C.to(DEV), CHUNK)
    mamba_chunk_scan_varlen_triton(*args, **kw)  # the signature is known now
    plans = len(ssd_triton._PLANS)
    with pytest.raises(ValueError, match="state_indices"):
        mamba_chunk_scan_varlen_triton(*args, **{**kw, "state_indices": i32([0, 2, 3]).to(DEV)})
    with pytest.raises(ValueError, match="dt_bias"):
        mamba_chunk_scan_varlen_triton(*args, **{**kw, "dt_bias": inp.dt_bias.to(DEV).int()})
    assert len(ssd_triton._PLANS) == plans and ref.out.shape == (27 * X, H, P)
