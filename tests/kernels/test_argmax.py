"""The greedy argmax (kernels/argmax_triton.py) against torch.argmax: the first index of each row's
maximum, ties planted before and after it, NaN rows (the first NaN wins, as torch), rows of -inf,
bf16 logits, a broadcast row (stride 0), every split of a row, and the tickets back at zero after
each call. On CPU through Triton's interpreter on tiny shapes; on CUDA also at the 2.7B vocabulary.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from pd_ssm.kernels.argmax import greedy_argmax_ref
from pd_ssm.kernels.argmax_triton import ArgmaxWorkspace, GreedyArgmax, launch_argmax, split_for

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
# (rows, vocab): a vocabulary not a multiple of any block; on CUDA the 2.7B model's
SHAPES = [(1, 300), (5, 1037)] + ([(1, 50280), (32, 50280), (130, 50280)] if CUDA else [])


def planted(n: int, v: int, seed: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """Random logits [n, v] whose row maxima also sit at a later and an earlier index; row 1 holds NaNs,
    row 2 -inf only, row 3 an early +inf (where rows exist)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, v, generator=g) * 3).to(dtype)
    top = x.max(dim=1)
    for r in range(n):
        j = int(top.indices[r])
        x[r, (j + v // 3) % v] = top.values[r]
        x[r, (j * 7 + 3) % v] = top.values[r]
    if n > 1:
        x[1, v // 2] = float("nan")
        x[1, v // 5] = float("nan")
    if n > 2:
        x[2] = float("-inf")
    if n > 3:
        x[3, 1] = float("inf")
    return x.to(DEV)


@pytest.mark.parametrize("n,v", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_torch(n: int, v: int, dtype: torch.dtype) -> None:
    x = planted(n, v, seed=n * 7 + v, dtype=dtype)
    argmax = GreedyArgmax()
    for _ in range(2):  # a ticket left above zero would break the next call
        got = argmax(x)
        assert got.dtype == torch.int64
        assert torch.equal(got, x.argmax(dim=-1))
        assert torch.equal(got, greedy_argmax_ref(x))


@pytest.mark.parametrize("n,v", SHAPES[:2])
@pytest.mark.parametrize("split", [1, 2, 8, 64])
def test_every_split_and_tickets_reset(n: int, v: int, split: int) -> None:
    x = planted(n, v, seed=v - n + split)
    ws = ArgmaxWorkspace(n + 3, x.device)
    for _ in range(2):
        assert torch.equal(launch_argmax(x, ws, split, block=64), x.argmax(dim=-1))
        assert not ws.tickets.any()


@pytest.mark.parametrize("n,v", SHAPES)
def test_host_out_gets_the_tokens(n: int, v: int) -> None:
    """The tokens written to the host by the kernel itself (pinned memory where logits are on CUDA)."""
    x = planted(n, v, seed=n + 2 * v)
    host = torch.full((n,), -1, dtype=torch.int64, pin_memory=CUDA)
    got = GreedyArgmax()(x, host)
    if CUDA:
        torch.cuda.synchronize()
    assert torch.equal(host, x.argmax(dim=-1).cpu())
    assert torch.equal(got, x.argmax(dim=-1))
    with pytest.raises(ValueError, match="host_out"):
        GreedyArgmax()(x, torch.empty(n + 1, dtype=torch.int64))


def test_split_for() -> None:
    assert [split_for(n, 50280) for n in (1, 8, 16, 32, 64, 128, 256)] == [64, 64, 32, 16, 8, 8, 8]
    assert split_for(1, 300) == 1 and split_for(1, 1100) == 2  # at most one program a block


def test_broadcast_row_and_bad_input() -> None:
    argmax = GreedyArgmax()
    row = planted(1, 300, seed=3)
    x = row.expand(4, -1)  # stride 0 over rows
    assert torch.equal(argmax(x), x.argmax(dim=-1))
    with pytest.raises(ValueError, match="stride 1"):
        argmax(planted(3, 300, seed=4).t())
    with pytest.raises(ValueError, match=r"\[N, V\]"):
        argmax(torch.randn(5, device=DEV))
    assert argmax(torch.randn(0, 7, device=DEV)).shape == (0,)
    with pytest.raises(ValueError, match="power of two"):
        launch_argmax(row, ArgmaxWorkspace(1, row.device), 3)
