"""skinny_linear_triton against its reference: random fp32 inputs on tiny shapes (TRITON_INTERPRET=1 on
the CPU), both paths (FMA for one row, DOT above), ragged N and K, with and without bias."""

from __future__ import annotations

import pytest
import torch

from pd_ssm.kernels.skinny_linear_triton import (
    FMA_TILE,
    FMA_TILE_NARROW,
    LinearTile,
    balanced,
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
    """cuBLAS (F.linear) off CUDA, for fp32, and past FMA_MAX_ROWS; the results agree either way."""
    from pd_ssm.kernels.skinny_linear_triton import FMA_MAX_ROWS, linear_triton

    g = torch.Generator().manual_seed(5)
    w = torch.randn(24, 40, generator=g).to(DEVICE)
    for rows in (1, FMA_MAX_ROWS, FMA_MAX_ROWS + 1):
        x = torch.randn(rows, 40, generator=g).to(DEVICE)
        torch.testing.assert_close(linear_triton(x, w), torch.nn.functional.linear(x, w), rtol=1e-4, atol=1e-4)


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
