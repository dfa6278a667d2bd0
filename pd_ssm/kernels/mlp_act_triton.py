"""Triton `mlp_act_ref`: the feed-forward activation in one pass, one program per (row, column block).

A gated MLP's act(gate) * up reads gate | up once and writes the product (torch: the act kernel
writes act(gate), the product kernel reads it back with up); NemotronH's relu(x)^2 is one kernel
instead of two. Same roundings as the reference: act in fp32 rounded to x.dtype, the product with
up in fp32 rounded once. silu's exp and gelu's erf are Triton's, not torch's (about an fp32 ulp:
a bf16 result rounds the same almost always, an fp32 one differs in its last bits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from pd_ssm.kernels._device import on_device
from pd_ssm.kernels._grid import cdiv
from pd_ssm.kernels.launch import FastKernel
from pd_ssm.kernels.mlp_act import check_mlp_act_args
from pd_ssm.kernels.pdl import launch_options, pdl_gate, use_pdl

# the kernel's code of each activation name (constexpr: one compiled kernel per activation)
_ACT_CODE = {"silu": 0, "swish": 0, "relu": 1, "relu2": 2, "gelu": 3}
BLOCK = 1024  # columns a program: 8 bf16 per thread at 4 warps, 16-byte accesses


@triton.jit
def _act(v, ACT: tl.constexpr):
    """act(v), v in fp32."""
    if ACT == 0:
        return v / (1.0 + tl.exp(-v))
    if ACT == 1:
        return tl.maximum(v, 0.0)
    if ACT == 2:
        r = tl.maximum(v, 0.0)
        return r * r
    return 0.5 * v * (1.0 + tl.math.erf(v * 0.7071067811865476))


@triton.jit
def _mlp_act_kernel(x_ptr, out_ptr, width, stride_x_t, stride_out_t,
                    ACT: tl.constexpr, GATED: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    # width: the output's columns (I); a gated x row is gate [0, I) | up [I, 2 I)
    pdl_gate(PDL)  # x is the launch before's output (pdl.py)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < width
    x_row = x_ptr + row * stride_x_t
    dtype = out_ptr.dtype.element_ty
    y = _act(tl.load(x_row + offs, mask=ok, other=0.0).to(tl.float32), ACT).to(dtype)
    if GATED:
        up = tl.load(x_row + width + offs, mask=ok, other=0.0)
        y = (y.to(tl.float32) * up.to(tl.float32)).to(dtype)
    tl.store(out_ptr + row * stride_out_t + offs, y, mask=ok)


_MLP_ACT = FastKernel(_mlp_act_kernel)


def mlp_act_triton(x: Tensor, act: str, *, gated: bool) -> Tensor:
    """Triton `mlp_act_ref`: x [T, width] -> act(x), or gate | up [T, 2 I] -> act(gate) * up [T, I]."""
    check_mlp_act_args(x, act, gated)
    T = x.shape[0]
    width = x.shape[1] // 2 if gated else x.shape[1]
    out = torch.empty((T, width), dtype=x.dtype, device=x.device)  # [T, width]
    if T == 0 or width == 0:
        return out
    pdl = use_pdl(x)
    with on_device(x):
        _MLP_ACT[(T, cdiv(width, BLOCK))](
            x, out, width, x.stride(0), out.stride(0),
            ACT=_ACT_CODE[act], GATED=gated, BLOCK=BLOCK, PDL=pdl, num_warps=4, **launch_options(pdl),
        )
    return out
