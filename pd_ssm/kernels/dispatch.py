"""Which implementation of each kernel runs: Triton on CUDA, the pure-torch references elsewhere.

Layers are handed a `Kernels` (from `get_kernels`, once per model) and call `kernels.rms_norm(...)`;
nothing is looked up per call. The module-level functions of the same names (`rms_norm(...)`, ...)
are a convenience for tests and scripts: each call resolves "auto" from the device of its first
tensor argument.

There is no silent fallback: a missing Triton kernel on CUDA is an error, and the torch references
run on the GPU only when asked for (`kernel_backend="torch"`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any, Literal, TypeVar, cast

import torch
from torch import Tensor

from pd_ssm.kernels.argmax import greedy_argmax_ref
from pd_ssm.kernels.attention import (
    paged_decode_attention_ref,
    varlen_prefill_attention_ref,
    write_kv_cache_ref,
)
from pd_ssm.kernels.conv1d import causal_conv1d_update_ref, causal_conv1d_varlen_ref
from pd_ssm.kernels.linear import linear_ref, logits_ref
from pd_ssm.kernels.mixer_decode import in_proj_conv_ref, mamba2_decode_step_ref
from pd_ssm.kernels.mlp_act import mlp_act_ref
from pd_ssm.kernels.pending_norm import PendingNorm, out_proj_add_ref, pending_norm_ref
from pd_ssm.kernels.rmsnorm import (
    AddNormOutput,
    GatedSquares,
    add_rms_norm_ref,
    rms_norm_gated_ref,
    rms_norm_gated_squares_ref,
    rms_norm_ref,
)
from pd_ssm.kernels.ssd import ScanOutput, mamba_chunk_scan_varlen_ref
from pd_ssm.kernels.ssu import selective_state_update_ref

KernelBackend = Literal["auto", "torch", "triton"]


class KernelNotAvailable(RuntimeError):
    """The requested backend has no implementation of some kernel on this device."""


@dataclass(frozen=True, slots=True)
class Kernels:
    """One implementation of every kernel; the signatures are those of the `*_ref` functions."""

    backend: Literal["torch", "triton"]
    mamba_chunk_scan_varlen: Callable[..., ScanOutput]
    causal_conv1d_varlen: Callable[..., Tensor]
    causal_conv1d_update: Callable[..., Tensor]
    selective_state_update: Callable[..., Tensor]
    rms_norm: Callable[..., Tensor]
    rms_norm_gated: Callable[..., Tensor]
    rms_norm_gated_squares: Callable[..., GatedSquares]
    mamba2_decode_step: Callable[..., GatedSquares]
    in_proj_conv: Callable[..., tuple[Tensor, Tensor]]
    out_proj_add: Callable[..., tuple[Tensor, PendingNorm]]
    pending_norm: Callable[[Tensor, Tensor], bool]  # whether to call out_proj_add (pending_norm.py)
    add_rms_norm: Callable[..., AddNormOutput]
    write_kv_cache: Callable[..., None]
    varlen_prefill_attention: Callable[..., Tensor]
    paged_decode_attention: Callable[..., Tensor]
    linear: Callable[..., Tensor]
    logits: Callable[..., Tensor]
    mlp_act: Callable[..., Tensor]
    greedy_argmax: Callable[..., Tensor]


KERNEL_NAMES: tuple[str, ...] = tuple(f.name for f in fields(Kernels) if f.name != "backend")

_TORCH_KERNELS: Mapping[str, Callable[..., Any]] = MappingProxyType({
    "mamba_chunk_scan_varlen": mamba_chunk_scan_varlen_ref,
    "causal_conv1d_varlen": causal_conv1d_varlen_ref,
    "causal_conv1d_update": causal_conv1d_update_ref,
    "selective_state_update": selective_state_update_ref,
    "rms_norm": rms_norm_ref,
    "rms_norm_gated": rms_norm_gated_ref,
    "rms_norm_gated_squares": rms_norm_gated_squares_ref,
    "mamba2_decode_step": mamba2_decode_step_ref,
    "in_proj_conv": in_proj_conv_ref,
    "out_proj_add": out_proj_add_ref,
    "pending_norm": pending_norm_ref,
    "add_rms_norm": add_rms_norm_ref,
    "write_kv_cache": write_kv_cache_ref,
    "varlen_prefill_attention": varlen_prefill_attention_ref,
    "paged_decode_attention": paged_decode_attention_ref,
    "linear": linear_ref,
    "logits": logits_ref,
    "mlp_act": mlp_act_ref,
    "greedy_argmax": greedy_argmax_ref,
})

def _triton_kernels() -> dict[str, Callable[..., Any]]:
    """The Triton implementations, imported on first use (importing them loads Triton)."""
    from pd_ssm.kernels.argmax_triton import GreedyArgmax
    from pd_ssm.kernels.attention_decode_triton import paged_decode_attention_triton
    from pd_ssm.kernels.attention_prefill_triton import varlen_prefill_attention_triton
    from pd_ssm.kernels.conv1d_triton import causal_conv1d_update_triton, causal_conv1d_varlen_triton
    from pd_ssm.kernels.in_proj_conv_triton import in_proj_conv_triton
    from pd_ssm.kernels.kv_write_triton import write_kv_cache_triton
    from pd_ssm.kernels.mixer_decode_triton import mamba2_decode_step_triton
    from pd_ssm.kernels.mlp_act_triton import mlp_act_triton
    from pd_ssm.kernels.out_proj_add_triton import out_proj_add_triton, pending_norm_triton
    from pd_ssm.kernels.rmsnorm_triton import (
        add_rms_norm_triton,
        rms_norm_gated_squares_triton,
        rms_norm_gated_triton,
        rms_norm_triton,
    )
    from pd_ssm.kernels.skinny_linear_triton import linear_triton, logits_triton
    from pd_ssm.kernels.ssd_triton import mamba_chunk_scan_varlen_triton
    from pd_ssm.kernels.ssu_triton import selective_state_update_triton

    return {
        "mamba_chunk_scan_varlen": mamba_chunk_scan_varlen_triton,
        "causal_conv1d_varlen": causal_conv1d_varlen_triton,
        "causal_conv1d_update": causal_conv1d_update_triton,
        "selective_state_update": selective_state_update_triton,
        "rms_norm": rms_norm_triton,
        "rms_norm_gated": rms_norm_gated_triton,
        "rms_norm_gated_squares": rms_norm_gated_squares_triton,
        "mamba2_decode_step": mamba2_decode_step_triton,
        "in_proj_conv": in_proj_conv_triton,
        "out_proj_add": out_proj_add_triton,
        "pending_norm": pending_norm_triton,
        "add_rms_norm": add_rms_norm_triton,
        "write_kv_cache": write_kv_cache_triton,
        "varlen_prefill_attention": varlen_prefill_attention_triton,
        "paged_decode_attention": paged_decode_attention_triton,
        "linear": linear_triton,
        "logits": logits_triton,
        "mlp_act": mlp_act_triton,
        "greedy_argmax": GreedyArgmax(),
    }


def get_kernels(backend: KernelBackend, device: torch.device | str) -> Kernels:
    """The kernels of `backend` for `device`; "auto" is Triton on CUDA and torch anywhere else.

    Triton needs a CUDA device, or Triton's interpreter (TRITON_INTERPRET=1, tiny shapes, tests);
    asking for it elsewhere raises KernelNotAvailable rather than falling back to the references.
    """
    device = torch.device(device)
    if backend == "auto":
        backend = "triton" if device.type == "cuda" else "torch"
    if backend == "torch":
        return Kernels(backend="torch", **_TORCH_KERNELS)
    if backend == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise KernelNotAvailable(
                f"Triton kernels need a CUDA device, not {device} (or TRITON_INTERPRET=1 for tests); "
                "kernel_backend='torch' runs the pure-torch reference kernels"
            )
        try:
            impls = _triton_kernels()
        except ImportError as e:
            raise KernelNotAvailable(
                f"the Triton kernels cannot be imported ({e}); install triton, or pass "
                "kernel_backend='torch' to run the pure-torch reference kernels"
            ) from e
        missing = [name for name in KERNEL_NAMES if name not in impls]
        if missing:
            raise KernelNotAvailable(f"no Triton kernel for {', '.join(missing)}")
        return Kernels(backend="triton", **impls)
    raise ValueError(f"kernel backend must be one of 'auto', 'torch', 'triton', got {backend!r}")


_F = TypeVar("_F", bound=Callable[..., Any])


def _routed(name: str, ref: _F) -> _F:
    """A module-level kernel: `get_kernels("auto", <device of the first tensor>).<name>(...)`."""

    def call(*args: Any, **kwargs: Any) -> Any:
        first = next(a for a in (*args, *kwargs.values()) if isinstance(a, Tensor))
        return getattr(get_kernels("auto", first.device), name)(*args, **kwargs)

    functools.update_wrapper(call, ref)  # the reference's signature and docstring
    call.__name__ = call.__qualname__ = name
    return cast(_F, call)


mamba_chunk_scan_varlen = _routed("mamba_chunk_scan_varlen", mamba_chunk_scan_varlen_ref)
causal_conv1d_varlen = _routed("causal_conv1d_varlen", causal_conv1d_varlen_ref)
causal_conv1d_update = _routed("causal_conv1d_update", causal_conv1d_update_ref)
selective_state_update = _routed("selective_state_update", selective_state_update_ref)
rms_norm = _routed("rms_norm", rms_norm_ref)
rms_norm_gated = _routed("rms_norm_gated", rms_norm_gated_ref)
rms_norm_gated_squares = _routed("rms_norm_gated_squares", rms_norm_gated_squares_ref)
mamba2_decode_step = _routed("mamba2_decode_step", mamba2_decode_step_ref)
in_proj_conv = _routed("in_proj_conv", in_proj_conv_ref)
out_proj_add = _routed("out_proj_add", out_proj_add_ref)
pending_norm = _routed("pending_norm", pending_norm_ref)
add_rms_norm = _routed("add_rms_norm", add_rms_norm_ref)
write_kv_cache = _routed("write_kv_cache", write_kv_cache_ref)
varlen_prefill_attention = _routed("varlen_prefill_attention", varlen_prefill_attention_ref)
paged_decode_attention = _routed("paged_decode_attention", paged_decode_attention_ref)
linear = _routed("linear", linear_ref)
logits = _routed("logits", logits_ref)
mlp_act = _routed("mlp_act", mlp_act_ref)
greedy_argmax = _routed("greedy_argmax", greedy_argmax_ref)
