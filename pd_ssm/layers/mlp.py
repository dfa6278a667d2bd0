"""Feed-forward blocks: the gated (SwiGLU) MLP of Bamba and the plain up/act/down MLP of NemotronH.

The gated MLP's gate_proj and up_proj are one stacked matmul, gate_up_proj (the checkpoint's two
tensors fill its two halves: the model's loader maps them, models/weights.py `stacked_name`), and
the activation is one kernel (kernels/mlp_act.py) that reads gate | up once: two launches fewer a
layer than gate, up, act, product.
"""

from __future__ import annotations

import torch
from torch import nn

from pd_ssm.kernels.dispatch import Kernels
from pd_ssm.kernels.mlp_act import check_activation


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)); HF names gate_proj / up_proj (stacked as gate_up_proj) / down_proj."""

    def __init__(self, hidden_size: int, intermediate_size: int, kernels: Kernels, *, act: str = "silu",
                 bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)  # [gate | up]
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act = check_activation(act, "MLP")
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        k = self.kernels
        h = k.mlp_act(k.linear(x, self.gate_up_proj.weight, self.gate_up_proj.bias), self.act, gated=True)
        return k.linear(h, self.down_proj.weight, self.down_proj.bias)


class MLP(nn.Module):
    """down(act(up(x))), NemotronH's non-gated MLP (act = relu2, i.e. relu(x)**2)."""

    def __init__(self, hidden_size: int, intermediate_size: int, kernels: Kernels, *, act: str = "relu2",
                 bias: bool = False) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act = check_activation(act, "MLP")
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        k = self.kernels
        h = k.mlp_act(k.linear(x, self.up_proj.weight, self.up_proj.bias), self.act, gated=False)
        return k.linear(h, self.down_proj.weight, self.down_proj.bias)
