"""Programmatic dependent launch (kernels/pdl.py): a batch-1 decode chain of the PDL kernels, run
eagerly and replayed in a CUDA graph, gives the same bits with PDL as without it (the gate only
moves *when* loads happen, never what they read), including padding rows and the GEMV's weight
columns loaded before the gate; off CUDA and with PD_SSM_PDL=0 nothing launches with PDL."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from pd_ssm.kernels.mixer_decode_triton import mamba2_decode_step_triton
from pd_ssm.kernels.pdl import launch_options, use_pdl
from pd_ssm.kernels.rmsnorm import RowRms
from pd_ssm.kernels.rmsnorm_triton import add_rms_norm_triton
from pd_ssm.kernels.skinny_linear_triton import FMA_TILE, LinearTile, skinny_linear_triton
from pd_ssm.kernels.ssu_triton import selective_state_update_triton

CUDA = torch.cuda.is_available()
HID, H, P, N, G, W, LAYERS = 256, 8, 32, 64, 1, 4, 6
D_INNER, CONV_DIM = H * P, H * P + 2 * G * N
PROJ = D_INNER + CONV_DIM + H


def test_off_without_cuda_or_when_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not use_pdl(torch.randn(3))
    # the launch option only when set: a Triton without it still launches every kernel
    assert launch_options(False) == {} and launch_options(True) == {"launch_pdl": True}
    if CUDA:
        monkeypatch.setenv("PD_SSM_PDL", "0")
        assert not use_pdl(torch.randn(3, device="cuda"))
        monkeypatch.setenv("PD_SSM_PDL", "1")
        assert use_pdl(torch.randn(3, device="cuda")) == (torch.cuda.get_device_capability()[0] >= 9)


class Chain:
    """LAYERS blocks of norm -> in_proj -> conv + gated state update -> out_proj -> plain state update."""

    def __init__(self, rows: int, padded: int) -> None:
        g = torch.Generator().manual_seed(rows)

        def r(*shape: int, scale: float = 1.0, dtype: torch.dtype = torch.bfloat16) -> Tensor:
            return (torch.randn(*shape, generator=g) * scale).to(dtype).cuda()

        self.w_in = [r(PROJ, HID, scale=HID ** -0.5) for _ in range(LAYERS)]
        self.w_out = [r(HID, D_INNER, scale=D_INNER ** -0.5) for _ in range(LAYERS)]
        self.norm_w = r(HID, scale=0.1) + 1
        self.conv0 = [r(rows + 1, CONV_DIM, W - 1) for _ in range(LAYERS)]
        self.ssm0 = [r(rows + 1, H, P, N, scale=0.1, dtype=torch.float32) for _ in range(LAYERS)]
        self.cw, self.cb = r(CONV_DIM, W, scale=0.5), r(CONV_DIM, scale=0.1)
        self.A = -torch.rand(H, generator=g).cuda() - 0.5
        self.D, self.dt_bias = r(H, dtype=torch.float32), r(H, scale=0.5, dtype=torch.float32)
        self.gate_w = r(D_INNER, scale=0.1) + 1
        # rows live sequences in shuffled slots, then padding rows (slot -1) as a CUDA graph pads
        live = torch.randperm(rows + 1, generator=g)[:rows].to(torch.int32)
        self.slots = torch.cat([live, torch.full((padded - rows,), -1, dtype=torch.int32)]).cuda()
        self.residual, self.delta = r(padded, HID), r(padded, HID)
        self.sq = (torch.rand(padded, H, generator=g) * D_INNER).cuda()

    def run(self, tile: LinearTile) -> list[Tensor]:
        conv = [c.clone() for c in self.conv0]
        ssm = [s.clone() for s in self.ssm0]
        delta, residual, x_rms = self.delta, self.residual, RowRms(self.sq, D_INNER, 1e-5)
        for i in range(LAYERS):
            normed, residual = add_rms_norm_triton(delta, residual, self.norm_w, 1e-5, residual_dtype=torch.bfloat16,
                                                   x_rms=x_rms)
            proj = skinny_linear_triton(normed, self.w_in[i], tile=tile) if normed.shape[0] == 1 \
                else torch.nn.functional.linear(normed, self.w_in[i])
            gs = mamba2_decode_step_triton(proj, conv[i], self.cw, self.cb, ssm[i], self.A, self.D, self.dt_bias,
                                           self.gate_w, state_indices=self.slots, ngroups=G)
            delta = skinny_linear_triton(gs.g, self.w_out[i], tile=tile) if normed.shape[0] == 1 \
                else torch.nn.functional.linear(gs.g, self.w_out[i])
            x_rms = RowRms(gs.sq, D_INNER, 1e-5)
            # the plain state update too (the path of 32 rows and more), on the next layer's pool
            xbc = proj[:, D_INNER:D_INNER + CONV_DIM]
            selective_state_update_triton(
                ssm[(i + 1) % LAYERS], xbc[:, :D_INNER].reshape(-1, H, P), proj[:, -H:], self.A,
                xbc[:, D_INNER:D_INNER + G * N].reshape(-1, G, N), xbc[:, D_INNER + G * N:].reshape(-1, G, N),
                state_indices=self.slots, D=self.D, dt_bias=self.dt_bias)
        return [delta, residual, *conv, *ssm]


def _graphed(chain: Chain, tile: LinearTile) -> list[Tensor]:
    chain.run(tile)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = chain.run(tile)
    graph.replay()
    torch.cuda.synchronize()
    return [o.clone() for o in outs]


@pytest.mark.skipif(not CUDA, reason="PDL needs a CUDA device")
@pytest.mark.parametrize(("rows", "padded"), [(1, 1), (3, 4)])
@pytest.mark.parametrize("prefetch_k", [0, 128])
def test_same_bits_with_and_without_pdl(rows: int, padded: int, prefetch_k: int,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    chain = Chain(rows, padded)
    tile = FMA_TILE._replace(block_k=64, prefetch_k=prefetch_k)
    monkeypatch.setenv("PD_SSM_PDL", "0")
    want = chain.run(tile)
    torch.cuda.synchronize()
    monkeypatch.setenv("PD_SSM_PDL", "1")
    for got in (chain.run(tile), _graphed(chain, tile)):
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)
