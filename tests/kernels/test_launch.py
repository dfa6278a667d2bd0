"""FastKernel (pd_ssm/kernels/launch.py): a compiled kernel is reused only for the argument
signature Triton compiled it for, and a direct launch computes what Triton's own launch does.

The direct path exists for compiled kernels only: without CUDA (TRITON_INTERPRET=1) a FastKernel
hands every call to the interpreter, which the SSD tests exercise.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from pd_ssm.kernels.launch import FastKernel  # noqa: E402

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device: the direct launch path is for compiled kernels")


@triton.jit
def _scaled_add_kernel(x_ptr, y_ptr, out_ptr, a, n, stride, BLOCK: tl.constexpr, SQUARE: tl.constexpr = False):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs * stride, mask=m, other=0.0)
    y = tl.load(y_ptr + offs * stride, mask=m, other=0.0)
    if SQUARE:
        x = x * x
    tl.store(out_ptr + offs, a * x + y, mask=m)


SCALED_ADD = FastKernel(_scaled_add_kernel)


@triton.jit
def _strided_copy_kernel(src_ptr, WIDTH: tl.constexpr, dst_ptr, rows, SCALE: tl.constexpr, stride=1):
    # a constexpr between runtime parameters (passed by position), and a runtime one with a default
    r = tl.program_id(0)
    offs = tl.arange(0, WIDTH)
    if r < rows:
        tl.store(dst_ptr + r * WIDTH + offs, SCALE * tl.load(src_ptr + r * stride * WIDTH + offs))


STRIDED_COPY = FastKernel(_strided_copy_kernel)


def scaled_add(x: torch.Tensor, y: torch.Tensor, a: float, stride: int, block: int = 64, **kw: bool) -> torch.Tensor:
    n = (x.numel() + stride - 1) // stride
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    SCALED_ADD[((n + block - 1) // block,)](x, y, out, a, n, stride, BLOCK=block, **kw)
    return out


def expected(x: torch.Tensor, y: torch.Tensor, a: float, stride: int, square: bool = False) -> torch.Tensor:
    xs, ys = x[::stride], y[::stride]
    return a * (xs * xs if square else xs) + ys


@needs_cuda
def test_signatures_triton_tells_apart_get_their_own_kernels() -> None:
    g = torch.Generator(device="cuda").manual_seed(3)
    base = torch.randn(4096, device="cuda", generator=g)
    other = torch.randn(4096, device="cuda", generator=g)
    SCALED_ADD._cache.clear()
    # n of 1 (a constexpr to Triton), a multiple of 16, neither; stride 1 (constexpr) and 3;
    # 16-byte aligned pointers and views one element in (misaligned); a constexpr and its default
    cases = [(base[:1], other[:1], 1), (base[:32], other[:32], 1), (base[:37], other[:37], 1),
             (base[1:38], other[1:38], 1), (base[:300], other[:300], 3), (base[5:305], other[5:305], 3)]
    for _ in range(3):  # the first round compiles; the next two launch from the cache
        for x, y, stride in cases:
            for square in (False, True):
                a = float(torch.rand(1, generator=torch.Generator().manual_seed(stride)))
                got = scaled_add(x, y, a, stride, SQUARE=square) if square else scaled_add(x, y, a, stride)
                torch.testing.assert_close(got, expected(x, y, a, stride, square), rtol=0, atol=1e-6)
    # each (case, square) its own entry: the six cases differ in Triton's specialization
    assert len(SCALED_ADD._cache) == 2 * len(cases)


@needs_cuda
def test_direct_launches_are_captured_by_cuda_graphs() -> None:
    g = torch.Generator(device="cuda").manual_seed(4)
    x, y = torch.randn(1000, device="cuda", generator=g), torch.randn(1000, device="cuda", generator=g)
    out = torch.empty(1000, device="cuda")
    for _ in range(2):  # compiled, then cached
        SCALED_ADD[(16,)](x, y, out, 2.0, 1000, 1, BLOCK=64)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        SCALED_ADD[(16,)](x, y, out, 2.0, 1000, 1, BLOCK=64)
    x.copy_(torch.randn(1000, device="cuda", generator=g))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, 2.0 * x + y, rtol=0, atol=1e-6)


@needs_cuda
def test_positional_constexprs_and_keyword_runtime_arguments() -> None:
    g = torch.Generator(device="cuda").manual_seed(5)
    src = torch.randn(12, 32, device="cuda", generator=g)
    STRIDED_COPY._cache.clear()
    for _ in range(3):  # compiled, then cached, then direct
        for width in (16, 32):  # a positional constexpr: its own kernel per value
            for scale in (1.0, 2.0):
                dst = torch.full((12, width), float("nan"), device="cuda")
                STRIDED_COPY[(12,)](src[:, :width].contiguous(), width, dst, 12, SCALE=scale)
                torch.testing.assert_close(dst, scale * src[:, :width], rtol=0, atol=0)
    assert len(STRIDED_COPY._cache) == 4
    # a runtime argument by keyword: launched through Triton every time, never cached
    dst = torch.full((6, 32), float("nan"), device="cuda")
    for _ in range(3):
        STRIDED_COPY[(6,)](src, 32, dst, 6, SCALE=1.0, stride=2)
        torch.testing.assert_close(dst, src[::2], rtol=0, atol=0)
    assert len(STRIDED_COPY._cache) == 4


def test_interpreted_or_unknown_layouts_go_through_triton() -> None:
    # interpreted (no CUDA), or compiled: either way the call's result is Triton's
    x = torch.randn(40, device="cuda" if CUDA else "cpu")
    y = torch.randn(40, device=x.device)
    torch.testing.assert_close(scaled_add(x, y, 0.5, 1), 0.5 * x + y, rtol=0, atol=1e-6)
    if not CUDA:
        assert not SCALED_ADD._specialize and not SCALED_ADD._cache
