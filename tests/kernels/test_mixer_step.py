"""The decode step of a run of Mamba2 blocks at one row in one launch (kernels/mixer_step_triton.py)
against the three launches a block it replaces (in_proj_conv, the gated state update, out_proj_add:
every bit of the new residual, the next norm's input and both state pools of every block, where the
tiles sum in the same order) and against the references.

On CPU through Triton's interpreter (one program does every tile), tiny shapes; on CUDA also at the
Mamba2-2.7B shape with the grid resident at once and the barriers between phases, for several
calls in a row (the barrier counts go back to zero), and replayed from a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch
from kernel_oracles import gen
from torch import Tensor

from pd_ssm.kernels.in_proj_conv_triton import in_proj_conv_triton
from pd_ssm.kernels.mixer_decode import in_proj_conv_ref, mamba2_decode_step_ref
from pd_ssm.kernels.mixer_decode_triton import default_config, mamba2_decode_step_triton
from pd_ssm.kernels.mixer_step_triton import (
    MixerStepLayer,
    MixerStepTiles,
    MixerStepWorkspace,
    mixer_stack_step_triton,
)
from pd_ssm.kernels.out_proj_add_triton import out_proj_add_triton
from pd_ssm.kernels.pending_norm import PendingNorm, out_proj_add_ref
from pd_ssm.kernels.rmsnorm import RowRms
from pd_ssm.kernels.skinny_linear_triton import FMA_TILE, FMA_TILE_NARROW

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
EPS = 1e-5
WIDTH = 4
SLOTS = 3
# (hidden d, heads, headdim, dstate, groups)
SHAPES = [(46, 4, 8, 16, 1), (64, 4, 16, 16, 2)] + ([(2560, 80, 64, 128, 1)] if CUDA else [])


def rand(g: torch.Generator, *shape: int, scale: float = 1.0) -> Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(DEV)


def same_order_tiles(shape: tuple[int, ...]) -> MixerStepTiles:
    """The three launches' own tiles (so the same sums, in the same order, and the same partials)."""
    return MixerStepTiles(in_tile=FMA_TILE, out_tile=FMA_TILE_NARROW,
                          block_p=default_config(1, shape[2], shape[3], torch.float32).block_p)


class Run:
    """`n` blocks' random weights and pools, and a pending norm and residual into the first."""

    def __init__(self, shape: tuple[int, int, int, int, int], n: int, dtype: torch.dtype, seed: int) -> None:
        d, H, P, N, G = shape
        g = gen(seed)
        self.d_inner, self.G = H * P, G
        conv_dim = self.d_inner + 2 * G * N
        n_in = self.d_inner + conv_dim + H
        self.layers = [MixerStepLayer(
            in_weight=rand(g, n_in, d, scale=d ** -0.5).to(dtype), in_bias=None,
            conv_state=rand(g, SLOTS, conv_dim, WIDTH - 1).to(dtype),
            conv_weight=rand(g, conv_dim, WIDTH, scale=0.5).to(dtype), conv_bias=rand(g, conv_dim, scale=0.1).to(dtype),
            ssm_state=rand(g, SLOTS, H, P, N), A=-torch.rand(H, generator=g).to(DEV) - 0.5, D=rand(g, H),
            dt_bias=rand(g, H, scale=0.5), gated_norm_weight=(1 + 0.1 * rand(g, self.d_inner)).to(dtype),
            out_weight=rand(g, d, self.d_inner, scale=self.d_inner ** -0.5).to(dtype),
            next_norm_weight=(1 + 0.1 * rand(g, d)).to(dtype)) for _ in range(n)]
        self.residual = rand(g, 1, d)
        self.hidden = PendingNorm(rand(g, 1, d).to(dtype), torch.rand(1, 7, generator=g).to(DEV) * d / 7, EPS)

    def pools(self) -> list[tuple[Tensor, Tensor]]:
        return [(ly.conv_state.clone(), ly.ssm_state.clone()) for ly in self.layers]

    def with_pools(self, pools: list[tuple[Tensor, Tensor]]) -> list[MixerStepLayer]:
        return [ly._replace(conv_state=c, ssm_state=s) for ly, (c, s) in zip(self.layers, pools, strict=True)]

    def three_launches(self, slots: Tensor, layers: list[MixerStepLayer]) -> tuple[Tensor, PendingNorm]:
        hidden, residual = self.hidden, self.residual
        for ly in layers:
            # NOTE: fused=True: off CUDA in_proj_conv_triton would take the reference GEMV
            proj, xbc = in_proj_conv_triton(hidden, ly.in_weight, None, ly.conv_state, ly.conv_weight, ly.conv_bias,
                                            state_indices=slots, conv_start=self.d_inner, fused=True)
            gs = mamba2_decode_step_triton(proj, ly.conv_state, ly.conv_weight, ly.conv_bias, ly.ssm_state, ly.A, ly.D,
                                           ly.dt_bias, ly.gated_norm_weight, state_indices=slots, ngroups=self.G,
                                           xbc=xbc)
            residual, hidden = out_proj_add_triton(gs.g, ly.out_weight, RowRms(gs.sq, self.d_inner, EPS), residual,
                                                   ly.next_norm_weight, EPS, residual_dtype=torch.float32,
                                                   tile=FMA_TILE_NARROW)
        return residual, hidden

    def reference(self, slots: Tensor, layers: list[MixerStepLayer]) -> tuple[Tensor, PendingNorm]:
        hidden, residual = self.hidden, self.residual
        for ly in layers:
            proj, xbc = in_proj_conv_ref(hidden, ly.in_weight, None, ly.conv_state, ly.conv_weight, ly.conv_bias,
                                         state_indices=slots, conv_start=self.d_inner)
            gs = mamba2_decode_step_ref(proj, ly.conv_state, ly.conv_weight, ly.conv_bias, ly.ssm_state, ly.A, ly.D,
                                        ly.dt_bias, ly.gated_norm_weight, state_indices=slots, ngroups=self.G, xbc=xbc)
            residual, hidden = out_proj_add_ref(gs.g, ly.out_weight, RowRms(gs.sq, self.d_inner, EPS), residual,
                                                ly.next_norm_weight, EPS, residual_dtype=torch.float32)
        return residual, hidden

    def step(self, slots: Tensor, layers: list[MixerStepLayer], ws: MixerStepWorkspace,
             tiles: MixerStepTiles | None = None) -> tuple[Tensor, PendingNorm]:
        return mixer_stack_step_triton(self.hidden, self.residual, layers, state_indices=slots, ngroups=self.G,
                                       gated_eps=EPS, norm_eps=EPS, residual_dtype=torch.float32, workspace=ws,
                                       tiles=tiles)


def assert_pools_equal(a: list[tuple[Tensor, Tensor]], b: list[tuple[Tensor, Tensor]]) -> None:
    for (ca, sa), (cb, sb) in zip(a, b, strict=True):
        assert torch.equal(ca, cb) and torch.equal(sa, sb)


@pytest.mark.parametrize("blocks", [1, 3])
@pytest.mark.parametrize("slot", [1, -1], ids=["slot", "padding"])
@pytest.mark.parametrize("shape", SHAPES)
def test_one_launch_is_the_three_a_block_to_the_bit(shape: tuple[int, int, int, int, int], slot: int,
                                                    blocks: int) -> None:
    run = Run(shape, blocks, torch.bfloat16, seed=sum(shape) + slot + blocks)
    slots = torch.tensor([slot], dtype=torch.int32, device=DEV)
    pools_a, pools_b = run.pools(), run.pools()
    want_res, want = run.three_launches(slots, run.with_pools(pools_a))
    ws = MixerStepWorkspace(torch.device(DEV))
    got_res, got = run.step(slots, run.with_pools(pools_b), ws, same_order_tiles(shape))
    ws.check()
    assert torch.equal(got_res, want_res)
    assert torch.equal(got.x, want.x) and got.eps == want.eps
    torch.testing.assert_close(got.ss.sum(-1), want.ss.sum(-1), rtol=1e-6, atol=0)
    assert_pools_equal(pools_b, pools_a)
    if slot < 0:  # padding touches no state
        assert_pools_equal(pools_b, run.pools())


@pytest.mark.parametrize("shape", SHAPES)
def test_default_tiles_sum_in_their_own_order(shape: tuple[int, int, int, int, int]) -> None:
    """The default tiles (in_proj's first weight columns summed apart, wider out_proj tiles) move last
    bits only."""
    run = Run(shape, 2, torch.bfloat16, seed=3)
    slots = torch.tensor([0], dtype=torch.int32, device=DEV)
    pools_a, pools_b = run.pools(), run.pools()
    want_res, want = run.three_launches(slots, run.with_pools(pools_a))
    got_res, got = run.step(slots, run.with_pools(pools_b), MixerStepWorkspace(torch.device(DEV)))
    torch.testing.assert_close(got_res, want_res, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.scale(), want.scale(), rtol=1e-2, atol=0)
    for (ca, sa), (cb, sb) in zip(pools_a, pools_b, strict=True):
        torch.testing.assert_close(cb, ca, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(sb, sa, rtol=2e-2, atol=2e-2)


def test_one_launch_against_the_references() -> None:
    shape = SHAPES[0]
    run = Run(shape, 2, torch.float32, seed=7)
    slots = torch.tensor([2], dtype=torch.int32, device=DEV)
    pools_r, pools_t = run.pools(), run.pools()
    want_res, want = run.reference(slots, run.with_pools(pools_r))
    got_res, got = run.step(slots, run.with_pools(pools_t), MixerStepWorkspace(torch.device(DEV)))
    torch.testing.assert_close(got_res, want_res, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got.x, want.x, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got.scale(), want.scale(), rtol=1e-4, atol=0)
    for (cr, sr), (ct, st) in zip(pools_r, pools_t, strict=True):
        torch.testing.assert_close(st, sr, rtol=1e-4, atol=1e-5)
        # the newest tap is in_proj's output: the GEMV sums in its own order
        torch.testing.assert_close(ct, cr, rtol=1e-5, atol=1e-6)


def test_blocks_that_differ_are_refused() -> None:
    run = Run(SHAPES[0], 2, torch.bfloat16, seed=1)
    slots = torch.tensor([0], dtype=torch.int32, device=DEV)
    ws = MixerStepWorkspace(torch.device(DEV))
    odd = [run.layers[0], run.layers[1]._replace(conv_bias=None)]
    with pytest.raises(ValueError, match="optional tensors"):
        run.step(slots, odd, ws)
    odd = [run.layers[0], run.layers[1]._replace(D=run.layers[1].D.double())]
    with pytest.raises(ValueError, match="dtype, shape"):
        run.step(slots, odd, ws)
    with pytest.raises(ValueError, match="share a dtype"):
        mixer_stack_step_triton(run.hidden, run.residual.double(), run.layers, state_indices=slots, ngroups=run.G,
                                gated_eps=EPS, norm_eps=EPS, residual_dtype=torch.float32, workspace=ws)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device: the grid barriers, a CUDA graph")
def test_calls_chain_and_replay_in_a_graph() -> None:
    shape = SHAPES[-1]
    run = Run(shape, 4, torch.bfloat16, seed=11)
    slots = torch.tensor([0], dtype=torch.int32, device=DEV)
    ws = MixerStepWorkspace(torch.device(DEV))
    tiles = same_order_tiles(shape)
    pools_a, pools_b = run.pools(), run.pools()
    layers_a, layers_b = run.with_pools(pools_a), run.with_pools(pools_b)
    for _ in range(3):  # the states move on at each call: the same three calls both ways
        want_res, want = run.three_launches(slots, layers_a)
        got_res, got = run.step(slots, layers_b, ws, tiles)
    ws.check()
    assert torch.equal(got_res, want_res) and torch.equal(got.x, want.x)
    assert_pools_equal(pools_b, pools_a)
    assert int(ws.sync[:2].abs().sum()) == 0  # the counts are back at zero
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # recorded, not run
        out_res, out = run.step(slots, layers_b, ws, tiles)
    for _ in range(3):
        want_res, want = run.three_launches(slots, layers_a)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out_res, want_res) and torch.equal(out.x, want.x)
        assert_pools_equal(pools_b, pools_a)
    ws.check()
    assert int(ws.sync[:2].abs().sum()) == 0
