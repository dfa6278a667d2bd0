"""Programmatic dependent launch (PDL, Hopper and later) for the kernels of a decode step.

A decode step at batch 1 is a chain of 3 launches a layer (in_proj with the conv folded in, state
update, out_proj with the residual add: pending_norm.py), the state update too short to fill the
GPU (a few hundred programs), each one waiting for the last to drain. With PDL a kernel is
launched while its predecessor still runs: it loads what does not depend on that predecessor
(weights, the state of its own slot), then waits in `griddepcontrol.wait` for the predecessor to
finish and its writes to be visible, and only then reads the predecessor's output. A
weight-streaming GEMV thus streams its first weight tiles while the small kernel before it
computes, and the state update loads its state while in_proj runs.
CUDA graphs keep these programmatic edges (CUDA >= 12.3).

The contract every PDL kernel here keeps (`pdl_gate` is its one implementation):
  1. before the gate, read nothing that the kernel launched just before it may write; reading
     what a launch two or more back wrote is safe, by (2) and (3);
  2. write nothing before the gate;
  3. release its dependents only after its own wait (`gdc_launch_dependents` follows
     `gdc_wait`): so when a kernel starts, the launch before its predecessor has completed, and
     nothing runs ahead of more than one unfinished launch;
  4. every program passes the gate, early exits included: a grid whose programs all skipped the
     wait could complete before its predecessor and break the chain of (3).
A kernel launched without the PDL attribute (torch's own ops, cuBLAS) starts after its predecessor
completes and releases its dependents only when it completes: the chain holds across them.

`PD_SSM_PDL=0` launches every kernel without PDL (the gate compiles away): for A/B measurements.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

_ENV = "PD_SSM_PDL"


@functools.lru_cache(maxsize=16)
def _device_has_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


# NOTE: Triton before 3.3 has neither the griddepcontrol intrinsics nor the launch option
_TRITON_HAS_PDL = hasattr(tl.extra.cuda, "gdc_wait")


def use_pdl(t: Tensor) -> bool:
    """Whether kernels working on `t` launch with PDL: a CUDA device of compute capability >= 9
    (Hopper) and a Triton that can, unless PD_SSM_PDL=0. Never under the Triton interpreter (CPU
    tensors)."""
    if not t.is_cuda or not _TRITON_HAS_PDL or os.environ.get(_ENV, "1") == "0":
        return False
    return _device_has_pdl(t.device.index if t.device.index is not None else torch.cuda.current_device())


def launch_options(pdl: bool) -> dict[str, bool]:
    """The launch keyword for a kernel call: `launch_pdl` only when set, so a Triton without the
    option still runs every kernel without PDL."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def pdl_gate(PDL: tl.constexpr):
    """Wait for the predecessor launch to complete, then let the dependents launch (contract 3)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
