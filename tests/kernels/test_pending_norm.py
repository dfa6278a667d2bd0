"""A one-row block boundary with the norm's scale pending (kernels/pending_norm.py): out_proj with the
residual add in its epilogue (out_proj_add_triton.py), and in_proj with the conv folded in taking the
pending norm (in_proj_conv_triton.py).

Checks: out_proj_add's new residual against `add_rms_norm_ref` on the plain GEMV's output (the add
to the bit; the row scale's sum order may move the last bit), its weighted input and squares
against the norm's; in_proj_conv on a pending norm against `in_proj_conv_ref` on it and against
the reference path (add_rms_norm, then in_proj) within the dtype's rounding; the pair chained as
the engine chains them. On CPU through Triton's interpreter on tiny shapes; on CUDA also at the
Mamba2-2.7B shape.
"""

from __future__ import annotations

import pytest
import torch
from kernel_oracles import compiled_ptx, gen
from torch import Tensor

from pd_ssm.kernels.in_proj_conv_triton import DOT_CONV_MAX_ROWS, fusable, in_proj_conv_triton
from pd_ssm.kernels.l2_prefetch import L2Rows
from pd_ssm.kernels.mixer_decode import in_proj_conv_ref
from pd_ssm.kernels.out_proj_add_triton import (
    PENDING_MAX_ROWS,
    WIDE_TILE,
    _out_proj_add_kernel,
    out_proj_add_triton,
    pending_norm_triton,
)
from pd_ssm.kernels.pending_norm import PendingNorm, linear_pending_ref, out_proj_add_ref
from pd_ssm.kernels.rmsnorm import RowRms, add_rms_norm_ref
from pd_ssm.kernels.skinny_gemm_triton import _skinny_dot_kernel
from pd_ssm.kernels.skinny_linear_triton import FMA_TILE_NARROW, LinearTile, skinny_linear_triton

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
WIDTH = 4
EPS = 1e-5
# (hidden d, d_inner, H, N, G): d not a multiple of out_proj's 4-column tile in the first
SHAPES = [(46, 40, 4, 8, 1), (64, 64, 4, 16, 2)] + ([(2560, 5120, 80, 128, 1)] if CUDA else [])
# one row (the GEMVs) and more (the split-K GEMM and in_proj's DOT path): a decode step's rows
ROWS = [1, 3] + ([32] if CUDA else [])


def rand(g: torch.Generator, *shape: int, scale: float = 1.0) -> Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(DEV)


def boundary(d: int, d_inner: int, dtype: torch.dtype, residual_dtype: torch.dtype, seed: int,
             rows: int = 1) -> dict[str, Tensor]:
    g = gen(seed)
    return {
        "g": rand(g, rows, d_inner).to(dtype),
        "w_out": rand(g, d, d_inner, scale=d_inner ** -0.5).to(dtype),
        "sq": torch.rand(rows, 7, generator=g).to(DEV) * d_inner / 7,
        "residual": rand(g, rows, d).to(residual_dtype),
        "norm_w": (1 + 0.1 * rand(g, d)).to(dtype),
    }


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("residual_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_out_proj_add_is_the_reference_add(shape: tuple[int, ...], dtype: torch.dtype,
                                           residual_dtype: torch.dtype, rows: int) -> None:
    d, d_inner = shape[:2]
    c = boundary(d, d_inner, dtype, residual_dtype, seed=d + d_inner + rows, rows=rows)
    x_rms = RowRms(c["sq"], d_inner, EPS)
    new, got = out_proj_add_triton(c["g"], c["w_out"], x_rms, c["residual"], c["norm_w"], EPS,
                                   residual_dtype=torch.float32)
    # the same GEMM stored (one row: the GEMV; more: the split-K GEMM and its reduce), then the
    # reference's add and norm
    out = skinny_linear_triton(c["g"], c["w_out"], tile=None if rows == 1 else WIDE_TILE)
    want = add_rms_norm_ref(out, c["residual"], c["norm_w"], EPS, residual_dtype=torch.float32, x_rms=x_rms)
    assert new.dtype == torch.float32 and got.x.dtype == dtype and got.eps == EPS
    torch.testing.assert_close(new, want.residual, rtol=1e-6, atol=1e-6)
    # NOTE: Triton's interpreter rounds fp32 -> bf16 by truncation (NOTES_small_kernels.md): up to
    # one ulp a value there, round-to-nearest-even (torch's) on the GPU
    loose = dtype == torch.bfloat16 and not CUDA
    h = new.to(dtype)
    torch.testing.assert_close(got.x, c["norm_w"] * h, rtol=1.6e-2 if loose else 0, atol=1e-6 if loose else 0)
    assert got.ss.shape[0] == rows
    torch.testing.assert_close(got.ss.sum(-1), h.float().pow(2).sum(-1), rtol=1.6e-2 if loose else 1e-5, atol=1e-5)
    # the pending norm's scale is the norm's: r * x is what the norm puts out, within one rounding
    normed = (got.x.float() * got.scale()[:, None]).to(dtype)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(normed, want.normed, **tol)
    # and the reference of the fused op (torch's linear: another sum order)
    new_r, ref = out_proj_add_ref(c["g"], c["w_out"], x_rms, c["residual"], c["norm_w"], EPS,
                                  residual_dtype=torch.float32)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(new, new_r, **tol)
    torch.testing.assert_close(got.x, ref.x, **tol)
    torch.testing.assert_close(got.ss.sum(-1, keepdim=True), ref.ss, rtol=2e-2, atol=1e-3)


def in_proj_case(d: int, d_inner: int, H: int, N: int, G: int, dtype: torch.dtype, seed: int) -> dict[str, Tensor]:
    g = gen(seed)
    conv_dim = d_inner + 2 * G * N
    n = d_inner + conv_dim + H
    return {
        "weight": rand(g, n, d, scale=d ** -0.5).to(dtype),
        "bias": rand(g, n, scale=0.1).to(dtype),
        "conv_state": rand(g, 5, conv_dim, WIDTH - 1).to(dtype),
        "conv_weight": rand(g, conv_dim, WIDTH, scale=0.5).to(dtype),
        "conv_bias": rand(g, conv_dim, scale=0.1).to(dtype),
        "slot": torch.tensor([int(torch.randint(0, 5, (1,), generator=g))], dtype=torch.int32, device=DEV),
    }


def pending(d: int, dtype: torch.dtype, seed: int, rows: int = 1) -> tuple[Tensor, Tensor, PendingNorm]:
    """(residual [rows, d] fp32, norm weight [d], the norm of the residual left pending)."""
    g = gen(seed)
    residual = rand(g, rows, d)  # fp32, the stream of residual_in_fp32
    w = (1 + 0.1 * rand(g, d)).to(dtype)
    h = residual.to(dtype)
    # the squares split unevenly over partials, as out_proj's programs split them
    sq = h.float().pow(2)
    ss = torch.stack([sq[:, :5].sum(-1), sq[:, 5:].sum(-1), torch.zeros(rows, device=DEV)], dim=1)
    return residual, w, PendingNorm(w * h, ss, EPS)


@pytest.mark.parametrize("shape", SHAPES)
def test_out_proj_add_with_fewer_columns_a_program(shape: tuple[int, ...]) -> None:
    """LinearTile.cols at one row: the same sums and epilogue per column, the next norm's squares in
    more or fewer partials (their total moves by rounding only)."""
    d, d_inner = shape[:2]
    c = boundary(d, d_inner, torch.bfloat16, torch.float32, seed=d + 1)
    x_rms = RowRms(c["sq"], d_inner, EPS)
    base, fewer = FMA_TILE_NARROW, LinearTile(8, 512, 4, 4, prefetch_k=2048, cols=5)
    new_a, p_a = out_proj_add_triton(c["g"], c["w_out"], x_rms, c["residual"], c["norm_w"], EPS,
                                     residual_dtype=torch.float32, tile=base)
    new_b, p_b = out_proj_add_triton(c["g"], c["w_out"], x_rms, c["residual"], c["norm_w"], EPS,
                                     residual_dtype=torch.float32, tile=fewer)
    assert torch.equal(new_b, new_a) and torch.equal(p_b.x, p_a.x)
    assert p_b.ss.shape[1] == -(-d // 5) and p_a.ss.shape[1] == -(-d // 4)
    torch.testing.assert_close(p_b.ss.sum(-1), p_a.ss.sum(-1), rtol=1e-6, atol=0)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", SHAPES)
def test_out_proj_add_asking_l2_for_the_next_weight_changes_nothing(shape: tuple[int, ...], rows: int) -> None:
    """An L2Rows hint (the next block's in_proj weight) moves bytes earlier, no value: the outputs are
    the same bits with and without it. On the GPU the kernel that asks (the one-row GEMV, at more rows
    the split-K GEMM) is compiled with the prefetch."""
    d, d_inner = shape[:2]
    c = boundary(d, d_inner, torch.bfloat16, torch.float32, seed=d + rows, rows=rows)
    x_rms = RowRms(c["sq"], d_inner, EPS)
    nxt = rand(gen(d + 7), 2 * d_inner + 3, 64).to(torch.bfloat16)  # [N, K]: odd rows, 128-byte rows
    args = (c["g"], c["w_out"], x_rms, c["residual"], c["norm_w"], EPS)
    new_a, p_a = out_proj_add_triton(*args, residual_dtype=torch.float32)
    for head in (128, 1024, 8192):  # 8192: longer than the row, cut at its end
        new_b, p_b = out_proj_add_triton(*args, residual_dtype=torch.float32, prefetch=L2Rows(nxt, head))
        assert torch.equal(new_b, new_a) and torch.equal(p_b.x, p_a.x) and torch.equal(p_b.ss, p_a.ss)
    if CUDA:
        asking = _out_proj_add_kernel if rows == 1 else _skinny_dot_kernel
        assert any("prefetch.global.L2" in ptx for ptx in compiled_ptx(asking))


def test_a_bad_l2_hint_refused() -> None:
    b = boundary(46, 40, torch.bfloat16, torch.float32, seed=5)
    x_rms = RowRms(b["sq"], 40, EPS)
    w = rand(gen(6), 90, 46).to(torch.bfloat16)
    for fn in (out_proj_add_triton, out_proj_add_ref):
        with pytest.raises(ValueError, match="stride 1"):
            fn(b["g"], b["w_out"], x_rms, b["residual"], b["norm_w"], EPS, residual_dtype=torch.float32,
               prefetch=L2Rows(w.t(), 128))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_in_proj_conv_on_a_pending_norm(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    d, d_inner, H, N, G = shape
    c = in_proj_case(d, d_inner, H, N, G, dtype, seed=d + H)
    residual, w, p = pending(d, dtype, seed=d)
    state = c["conv_state"].clone()
    proj, xbc = in_proj_conv_triton(p, c["weight"], c["bias"], state, c["conv_weight"], c["conv_bias"],
                                    state_indices=c["slot"], conv_start=d_inner, fused=True)
    # its reference: the same roundings, torch's sum order
    state_r = c["conv_state"].clone()
    proj_r, xbc_r = in_proj_conv_ref(p, c["weight"], c["bias"], state_r, c["conv_weight"], c["conv_bias"],
                                     state_indices=c["slot"], conv_start=d_inner)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(proj, proj_r, **tol)
    torch.testing.assert_close(xbc, xbc_r, **tol)
    torch.testing.assert_close(state, state_r, **tol)
    untouched = [s for s in range(5) if s != int(c["slot"])]
    assert torch.equal(state[untouched], c["conv_state"][untouched])
    # the path it replaces: the norm rounded to its dtype, then in_proj
    normed = add_rms_norm_ref(None, residual, w, EPS, residual_dtype=torch.float32).normed
    want = torch.nn.functional.linear(normed.float(), c["weight"].float(), c["bias"].float())
    torch.testing.assert_close(proj.float(), want, **tol)
    # and the two-launch path on the same pending norm
    state_2 = c["conv_state"].clone()
    proj_2, xbc_2 = in_proj_conv_triton(p, c["weight"], c["bias"], state_2, c["conv_weight"], c["conv_bias"],
                                        state_indices=c["slot"], conv_start=d_inner, fused=False)
    torch.testing.assert_close(proj_2, proj, **tol)
    torch.testing.assert_close(xbc_2, xbc, **tol)


@pytest.mark.parametrize("rows", [r for r in ROWS if r > 1] + [17])  # 17: a 32-row tile, the taps loaded early
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_in_proj_conv_on_a_pending_norm_of_several_rows(shape: tuple[int, ...], dtype: torch.dtype, rows: int) -> None:
    """One launch (the DOT path's tile, the scale per row, the conv in its epilogue) equals the two
    it replaces (the DOT path, then the conv update's launch) to the bit, a padding row (slot -1)
    included; both near the reference."""
    d, d_inner, H, N, G = shape
    c = in_proj_case(d, d_inner, H, N, G, dtype, seed=d + rows)
    g = gen(rows)
    pool = rand(g, rows + 3, c["conv_weight"].shape[0], WIDTH - 1).to(dtype)
    slots = torch.randperm(rows + 3, generator=g)[:rows].to(torch.int32).to(DEV)
    slots[rows // 2] = -1  # CUDA-graph padding: no state touched, zeros out
    residual, w, p = pending(d, dtype, seed=d + 1, rows=rows)
    outs = []
    for one_launch in (True, False):
        state = pool.clone()
        proj, xbc = in_proj_conv_triton(p, c["weight"], c["bias"], state, c["conv_weight"], c["conv_bias"],
                                        state_indices=slots, conv_start=d_inner, fused=one_launch)
        outs.append((proj, xbc, state))
    for name, a, b in zip(("proj", "xbc", "conv state"), *outs, strict=True):
        assert torch.equal(a, b), f"{name}: one launch differs from the two it replaces"
    proj, xbc, state = outs[0]
    assert not xbc[rows // 2].any()
    live = slots >= 0
    assert torch.equal(state[[s for s in range(rows + 3) if s not in slots[live].tolist()]],
                       pool[[s for s in range(rows + 3) if s not in slots[live].tolist()]])
    # the reference on the live rows (it has no padding rule)
    state_r = pool.clone()
    proj_r, xbc_r = in_proj_conv_ref(p._replace(x=p.x[live], ss=p.ss[live]), c["weight"], c["bias"], state_r,
                                     c["conv_weight"], c["conv_bias"], state_indices=slots[live], conv_start=d_inner)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(proj[live], proj_r, **tol)
    torch.testing.assert_close(xbc[live], xbc_r, **tol)
    torch.testing.assert_close(state, state_r, **tol)
    normed = add_rms_norm_ref(None, residual, w, EPS, residual_dtype=torch.float32).normed
    want = torch.nn.functional.linear(normed.float(), c["weight"].float(), c["bias"].float())
    torch.testing.assert_close(proj.float(), want, **tol)
    with pytest.raises(ValueError, match="split"):
        skinny_linear_triton(p, c["weight"], tile=WIDE_TILE)


def test_linear_pending_ref_is_the_norm_then_the_linear_in_fp32() -> None:
    d = 24
    residual, nw, p = pending(d, torch.float32, seed=5)
    w = rand(gen(6), 10, d)
    normed = add_rms_norm_ref(None, residual, nw, EPS, residual_dtype=torch.float32).normed
    torch.testing.assert_close(linear_pending_ref(p, w), normed @ w.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", SHAPES)
def test_chained_as_the_engine_chains_them(shape: tuple[int, ...]) -> None:
    """out_proj_add's output handed on as a pending norm: the next in_proj equals the reference
    path's (add_rms_norm, then in_proj) within bf16 rounding."""
    d, d_inner, H, N, G = shape
    dtype = torch.bfloat16
    b = boundary(d, d_inner, dtype, torch.float32, seed=11)
    c = in_proj_case(d, d_inner, H, N, G, dtype, seed=12)
    x_rms = RowRms(b["sq"], d_inner, EPS)
    _, p = out_proj_add_triton(b["g"], b["w_out"], x_rms, b["residual"], b["norm_w"], EPS,
                               residual_dtype=torch.float32)
    state = c["conv_state"].clone()
    proj, _ = in_proj_conv_triton(p, c["weight"], c["bias"], state, c["conv_weight"], c["conv_bias"],
                                  state_indices=c["slot"], conv_start=d_inner, fused=True)
    out = skinny_linear_triton(b["g"], b["w_out"])
    ref = add_rms_norm_ref(out, b["residual"], b["norm_w"], EPS, residual_dtype=torch.float32, x_rms=x_rms)
    want = torch.nn.functional.linear(ref.normed.float(), c["weight"].float(), c["bias"].float())
    torch.testing.assert_close(proj.float(), want, rtol=2e-2, atol=2e-2)
    # both against the norm and in_proj in exact (fp32) arithmetic on the same residual: the pending
    # norm rounds the input as often as the reference, in other places (pending_norm.py)
    res = ref.residual
    exact = torch.nn.functional.linear(
        b["norm_w"].float() * res * torch.rsqrt(res.pow(2).mean(-1, keepdim=True) + EPS), c["weight"].float(),
        c["bias"].float())
    err = (proj.float() - exact).norm() / exact.norm()
    err_ref = (want.to(dtype).float() - exact).norm() / exact.norm()
    # NOTE: the interpreter truncates every fp32 -> bf16 rounding (benchmarks/NOTES_small_kernels.md)
    assert err < (1.5 if CUDA else 4.0) * err_ref, f"relative L2 error {err:.2e}, the reference path's {err_ref:.2e}"


def test_where_the_fused_kernels_serve() -> None:
    _, _, p = pending(2560, torch.bfloat16, seed=1)
    w = torch.empty(16, 2560, dtype=torch.bfloat16, device=DEV)
    assert fusable(p, w) == CUDA
    for rows in (2, DOT_CONV_MAX_ROWS, DOT_CONV_MAX_ROWS + 1):  # more rows: the DOT tile with the conv, up to a bound
        many = p._replace(x=p.x.expand(rows, -1).contiguous(), ss=p.ss.expand(rows, -1).contiguous())
        assert fusable(many, w) == (CUDA and rows <= DOT_CONV_MAX_ROWS)
    for rows in (1, 2, PENDING_MAX_ROWS):
        assert pending_norm_triton(torch.empty(rows, 2560, dtype=torch.bfloat16, device=DEV), w) == CUDA
    assert not pending_norm_triton(torch.empty(PENDING_MAX_ROWS + 1, 2560, dtype=torch.bfloat16, device=DEV), w)
    assert not pending_norm_triton(torch.empty(1, 2560, dtype=torch.float32, device=DEV), w.float())
    assert not fusable(p._replace(x=p.x.float()), w)


def test_bad_arguments_refused() -> None:
    b = boundary(46, 40, torch.float32, torch.float32, seed=2)
    x_rms = RowRms(b["sq"], 40, EPS)
    with pytest.raises(ValueError, match="rows"):
        out_proj_add_triton(b["g"].expand(300, -1), b["w_out"], x_rms, b["residual"], b["norm_w"], EPS,
                            residual_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"residual must have shape \[M, d\]"):
        out_proj_add_triton(b["g"].expand(2, -1), b["w_out"], x_rms, b["residual"], b["norm_w"], EPS,
                            residual_dtype=torch.float32)
    with pytest.raises(ValueError, match="norm_weight"):
        out_proj_add_triton(b["g"], b["w_out"], x_rms, b["residual"], b["norm_w"][:40], EPS,
                            residual_dtype=torch.float32)
    with pytest.raises(ValueError, match="residual"):
        out_proj_add_triton(b["g"], b["w_out"], x_rms, b["residual"][:, :40], b["norm_w"], EPS,
                            residual_dtype=torch.float32)
    # the one-row GEMV's prefetch is no knob of the DOT tile (measured slower: RESULTS.md session 20)
    c = in_proj_case(64, 64, 4, 16, 2, torch.float32, seed=3)
    _, _, p = pending(64, torch.float32, seed=4, rows=3)
    with pytest.raises(ValueError, match="prefetch_k"):
        in_proj_conv_triton(p, c["weight"], c["bias"], torch.randn(3, c["conv_weight"].shape[0], WIDTH - 1).to(DEV),
                            c["conv_weight"], c["conv_bias"], state_indices=torch.arange(3, dtype=torch.int32).to(DEV),
                            conv_start=64, fused=True, tile=LinearTile(16, 16, 4, 2, prefetch_k=16))
