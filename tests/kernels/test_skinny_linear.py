"""skinny_linear_triton against its reference: random fp32 inputs on tiny shapes (TRITON_INTERPRET=1 on
the CPU), both paths (FMA for one row, DOT above), ragged N and K, with and without bias."""

from __future__ import annotations

import pytest
import torch

from pd_ssm.kernels.linear import logits_ref
from pd_ssm.kernels.skinny_linear_triton import (
    DOT_MAX_ROWS,
    FEW_ROWS_SPLIT,
    FEW_ROWS_TILE,
    FMA_MAX_ROWS,
    FMA_TILE,
    FMA_TILE_NARROW,
    LinearTile,
    balanced,
    few_rows_tile,
    linear_triton,
    logits_triton,
    skinny_linear_ref,
    skinny_linear_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_reference(rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows * 2 + bias)
    n, k = 37, 70  # neither a multiple of the tile
    x = torch.randn(rows, k, generator=g).to(DEVICE)
    w = torch.randn(n, k, generator=g).to(DEVICE)
    b = torch.randn(n, generator=g).to(DEVICE) if bias else None
    want = skinny_linear_ref(x, w, b)
    for split in (1, 3):  # split-K (DOT path only): ragged last slice, partials summed by a 2nd launch
        got = skinny_linear_triton(x, w, b, tile=LinearTile(16, 16, 4, 2, split))
        assert got.shape == (rows, n) and got.dtype == x.dtype
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("prefetch_k", [16, 32, 128])
def test_weights_loaded_before_the_gate(prefetch_k: int) -> None:
    """The FMA path with its first prefetch_k weight columns loaded up front (PDL), including more
    than K (the loop then has nothing left): the same result."""
    g = torch.Generator().manual_seed(prefetch_k)
    x, w, b = torch.randn(1, 70, generator=g), torch.randn(37, 70, generator=g), torch.randn(37, generator=g)
    x, w, b = x.to(DEVICE), w.to(DEVICE), b.to(DEVICE)
    got = skinny_linear_triton(x, w, b, tile=LinearTile(8, 16, 4, 2, prefetch_k=prefetch_k))
    torch.testing.assert_close(got, skinny_linear_ref(x, w, b), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="prefetch_k"):
        skinny_linear_triton(x, w, b, tile=LinearTile(8, 16, 4, 2, prefetch_k=prefetch_k + 8))


def test_bad_shapes_are_refused() -> None:
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="weight"):
        skinny_linear_triton(x, torch.randn(5, 9))
    with pytest.raises(ValueError, match="rows"):
        skinny_linear_triton(torch.randn(300, 8), torch.randn(5, 8))
    with pytest.raises(ValueError, match="bias"):
        skinny_linear_triton(x, torch.randn(5, 8), torch.randn(4))
    with pytest.raises(ValueError, match="prefetch_k"):  # the one-row GEMV's knob: the DOT path (4 rows) has none
        skinny_linear_triton(x, torch.randn(5, 8), tile=LinearTile(16, 16, 4, 2, prefetch_k=16))


def test_linear_triton_routes_by_rows_and_dtype() -> None:
    """fp32 rows at 1, FMA_MAX_ROWS and one more: cuBLAS (F.linear) off CUDA and for fp32 (bf16 rows on
    CUDA: test_linear_triton_few_rows_on_cuda); the results agree either way."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(24, 40, generator=g).to(DEVICE)
    for rows in (1, FMA_MAX_ROWS, FMA_MAX_ROWS + 1):
        x = torch.randn(rows, 40, generator=g).to(DEVICE)
        torch.testing.assert_close(linear_triton(x, w), torch.nn.functional.linear(x, w), rtol=1e-4, atol=1e-4)


def test_few_rows_tile_by_column_tiles() -> None:
    """K split where the 64-column tiles are fewer than the SMs, whole K from 1.5 SMs' worth, cuBLAS
    (None) in between: the shapes of the NOTE at DOT_MAX_ROWS, on the H200's 132 SMs."""
    split = FEW_ROWS_TILE._replace(split_k=FEW_ROWS_SPLIT)
    for n in (1024, 2560, 4096, 64 * 131):  # k / v, the 2.7B out_proj, out_proj / down / q / o; 131 tiles
        assert few_rows_tile(n, 132) == split
    for n in (64 * 198 - 63, 16768, 18560, 21504, 28672):  # exactly 198 tiles, the hybrids' in_proj, up, gate_up
        assert few_rows_tile(n, 132) == FEW_ROWS_TILE
    for n in (64 * 132, 10576, 64 * 197):  # from one wave to just short of 1.5: the 2.7B in_proj
        assert few_rows_tile(n, 132) is None


@pytest.mark.skipif(DEVICE != "cuda", reason="linear_triton routes to the Triton kernels only on a CUDA device")
@pytest.mark.parametrize("rows", [2, 5, DOT_MAX_ROWS, DOT_MAX_ROWS + 1])
@pytest.mark.parametrize("n", [1024, 16768, 10576])
def test_linear_triton_few_rows_on_cuda(rows: int, n: int) -> None:
    """bf16 at 2..DOT_MAX_ROWS rows: the DOT tile few_rows_tile names, equal in bits to that launch
    and within a rounding of the fp32 reference; past DOT_MAX_ROWS, or where it names none, cuBLAS."""
    g = torch.Generator(device=DEVICE).manual_seed(rows * 7 + n)
    k = 4096 if n != 10576 else 2560
    x = torch.randn(rows, k, device=DEVICE, generator=g).bfloat16()
    w = (torch.randn(n, k, device=DEVICE, generator=g) * 0.02).bfloat16()
    b = torch.randn(n, device=DEVICE, generator=g).bfloat16()
    got = linear_triton(x, w, b)
    tile = few_rows_tile(n, torch.cuda.get_device_properties(DEVICE).multi_processor_count)
    if rows <= DOT_MAX_ROWS and tile is not None:
        assert torch.equal(got, skinny_linear_triton(x, w, b, tile=tile))
        torch.testing.assert_close(got, skinny_linear_ref(x, w, b), rtol=1.6e-2, atol=1e-2)
    else:
        assert torch.equal(got, torch.nn.functional.linear(x, w, b))


def test_balanced_tiles_even_out_the_programs_a_sm() -> None:
    """`balanced`: the grid a whole number of programs a SM, as many as the full tiles would take."""
    # in_proj at the 2.7B shape on 132 SMs: 331 tiles of 32 (2-3 a SM) -> 27 columns, 392 programs
    t = balanced(FMA_TILE, 10576, 132)
    assert t.cols == 27 and -(-10576 // t.cols) <= 3 * 132
    assert t._replace(cols=0) == FMA_TILE
    # out_proj's 640 tiles of 4 columns already fill 5 a SM to within one: unchanged
    assert balanced(FMA_TILE_NARROW, 2560, 132).cols == 4
    # never wider than the tile
    assert balanced(FMA_TILE, 100, 132).cols == 1 and balanced(FMA_TILE, 10 ** 6, 4).cols <= FMA_TILE.block_n


def test_cols_refused_where_no_kernel_reads_it() -> None:
    """LinearTile.cols is the one-row in_proj_conv / out_proj_add kernels' knob: the plain GEMV and the
    DOT path refuse it rather than ignore it."""
    x = torch.randn(3, 32).to(DEVICE)
    w = torch.randn(16, 32).to(DEVICE)
    for rows in (1, 3):
        with pytest.raises(ValueError, match="cols"):
            skinny_linear_triton(x[:rows], w, tile=LinearTile(16, 16, 4, 2, cols=8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_ref_is_fp32_into_out(dtype: torch.dtype) -> None:
    """logits_ref: [M, vocab] fp32, the same values returned as written into a given `out`; off CUDA
    they are the weight dtype's linear, then cast (transformers' lm_head, then .float())."""
    g = torch.Generator().manual_seed(11)
    h = torch.randn(3, 24, generator=g).to(dtype)
    w = torch.randn(40, 24, generator=g).to(dtype)
    got = logits_ref(h, w)
    assert got.dtype == torch.float32 and got.shape == (3, 40)
    assert torch.equal(got, torch.nn.functional.linear(h, w).float())
    out = torch.full((3, 40), float("nan"))
    assert logits_ref(h, w, out) is out and torch.equal(out, got)


def test_out_is_checked() -> None:
    """An `out` of the wrong shape, dtype or layout is refused by name, never written around."""
    g = torch.Generator().manual_seed(12)
    x = torch.randn(3, 32, generator=g).to(DEVICE)
    w = torch.randn(16, 32, generator=g).to(DEVICE)
    for bad in (torch.empty(3, 15), torch.empty(3, 16, dtype=torch.float64), torch.empty(16, 3).t()):
        with pytest.raises(ValueError, match="out must be"):
            skinny_linear_triton(x, w, out=bad.to(DEVICE))
    out = torch.full((3, 16), float("nan"), device=DEVICE)
    assert skinny_linear_triton(x, w, out=out) is out
    torch.testing.assert_close(out, skinny_linear_ref(x, w), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(DEVICE != "cuda", reason="logits_triton routes to the Triton kernels only on a CUDA device")
@pytest.mark.parametrize("rows", [1, 2, 8, DOT_MAX_ROWS, DOT_MAX_ROWS + 1])
def test_logits_triton_fp32_sums_on_cuda(rows: int) -> None:
    """bf16 hidden rows against a bf16 lm_head of the 2.7B shape: the streaming kernels' fp32 sums,
    stored unrounded (within fp32 summation order of cuBLAS's fp32-output launch, far inside one bf16
    rounding); past DOT_MAX_ROWS cuBLAS itself. Into a given `out` as without one."""
    g = torch.Generator(device=DEVICE).manual_seed(rows)
    h = torch.randn(rows, 2560, device=DEVICE, generator=g).bfloat16()
    w = (torch.randn(50288, 2560, device=DEVICE, generator=g) * 0.02).bfloat16()
    want = logits_ref(h, w)
    got = logits_triton(h, w)
    assert got.dtype == torch.float32
    if rows > DOT_MAX_ROWS:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert not torch.equal(got, want.bfloat16().float())  # not rounded to bf16 on the way
    out = torch.full((rows, 50288), float("nan"), device=DEVICE)
    assert logits_triton(h, w, out) is out and torch.equal(out, got)
