"""The feed-forward blocks' activation, torch reference: act(x), or act(gate) * up for a gated MLP
whose gate and up projections are one stacked matmul (x = gate | up along the last axis).

The casts are those of the HF modules' separate ops, because in bf16 their order changes the
result: act computed in fp32 and rounded to x.dtype (torch's F.silu, F.gelu, relu and square each
round once), then the product with up computed in fp32 and rounded once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from pd_ssm.kernels._checks import FLOAT_DTYPES, check_dtype, check_last_dim_contiguous, check_ndim


def _relu2(x: Tensor) -> Tensor:
    return torch.square(F.relu(x))


ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "relu": F.relu,
    "relu2": _relu2,
    "gelu": F.gelu,  # the exact (erf) form, transformers' "gelu"
}


def check_activation(act: str, where: str = "mlp_act") -> str:
    """`act` if the kernels have it (the MLP layers check at construction, the kernels per call)."""
    if act not in ACTIVATIONS:
        raise ValueError(f"{where}: unsupported activation {act!r}; supported: {sorted(ACTIVATIONS)}")
    return act


def check_mlp_act_args(x: Tensor, act: str, gated: bool) -> None:
    k = "mlp_act"
    check_activation(act, k)
    check_ndim(k, "x", x, "[T, width]")
    check_dtype(k, "x", x, FLOAT_DTYPES)
    check_last_dim_contiguous(k, "x", x)
    if gated and x.shape[1] % 2:
        raise ValueError(f"{k}: a gated x is gate | up, an even width; got {x.shape[1]}")


def mlp_act_ref(x: Tensor, act: str, *, gated: bool) -> Tensor:
    """x [T, width] -> act(x) [T, width], or with `gated` x = gate | up [T, 2 I] -> act(gate) * up [T, I];
    in x.dtype."""
    check_mlp_act_args(x, act, gated)
    f = ACTIVATIONS[act]
    if not gated:
        return f(x)
    gate, up = x.chunk(2, dim=-1)
    return f(gate) * up
