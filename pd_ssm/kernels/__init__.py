"""Compute kernels: each file holds one kernel's launcher(s) and pure-torch reference (`*_ref`);
`dispatch.get_kernels` picks the implementation for a device."""

from pd_ssm.kernels.dispatch import KernelBackend, KernelNotAvailable, Kernels, get_kernels
from pd_ssm.kernels.ssd import ScanOutput

__all__ = ["KernelBackend", "KernelNotAvailable", "Kernels", "ScanOutput", "get_kernels"]
