"""Triton causal depthwise conv1d: varlen prefill and one-token decode, in place on the state pool.

Same signatures, layout and numerics as `conv1d.causal_conv1d_varlen_ref` / `causal_conv1d_update_ref`:
the taps accumulate in fp32, the sum (with bias) is rounded once to x.dtype (what F.conv1d returns),
and silu runs in fp32 on that rounded value and rounds again. History read from the pool is
rounded to x.dtype first, and the new history is the x.dtype value cast to the pool's dtype, so a
sequence shorter than width-1 writes back its old history exactly as the reference does.

Neither launcher synchronizes with the host. The kernels live in `conv1d_triton_varlen` (a
sequence-blind stencil over all tokens, then one program per sequence for its first width-1
outputs and its new state) and `conv1d_triton_update` (decode); this module is their public face.
"""

from __future__ import annotations

from pd_ssm.kernels.conv1d_triton_update import (
    UpdateTile,
    causal_conv1d_update_triton,
    default_update_tile,
    launch_conv_update,
)
from pd_ssm.kernels.conv1d_triton_varlen import (
    VARLEN_TILE,
    ConvTile,
    causal_conv1d_varlen_triton,
    launch_conv_varlen,
)

__all__ = [
    "VARLEN_TILE",
    "ConvTile",
    "UpdateTile",
    "causal_conv1d_update_triton",
    "causal_conv1d_varlen_triton",
    "default_update_tile",
    "launch_conv_update",
    "launch_conv_varlen",
]
