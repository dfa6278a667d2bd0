"""get_kernels: which implementation runs where, and the error when one is missing."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_oracles import gen

from pd_ssm.kernels import dispatch
from pd_ssm.kernels.dispatch import KERNEL_NAMES, KernelNotAvailable, Kernels, get_kernels
from pd_ssm.kernels.rmsnorm import rms_norm_ref


def test_auto_on_cpu_is_torch() -> None:
    kernels = get_kernels("auto", torch.device("cpu"))
    assert kernels.backend == "torch"
    assert kernels.rms_norm is rms_norm_ref
    for name in KERNEL_NAMES:
        assert getattr(kernels, name).__name__ == f"{name}_ref"


def test_torch_backend_on_cuda_device_is_allowed() -> None:
    # constructing it touches no device: the references run wherever their tensors are
    assert get_kernels("torch", torch.device("cuda")).backend == "torch"


def test_triton_on_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(KernelNotAvailable) as info:
        get_kernels("triton", torch.device("cpu"))
    assert "CUDA device" in str(info.value) and "kernel_backend='torch'" in str(info.value)


@pytest.mark.parametrize(("backend", "device"), [("triton", "cuda"), ("auto", "cuda:1")])
def test_triton_backend_is_complete(backend: dispatch.KernelBackend, device: str) -> None:
    pytest.importorskip("triton")
    kernels = get_kernels(backend, torch.device(device))  # touches no device
    assert kernels.backend == "triton"
    for name in KERNEL_NAMES:
        assert getattr(kernels, name).__name__ == f"{name}_triton"


def test_unknown_backend() -> None:
    with pytest.raises(ValueError, match="kernel backend"):
        get_kernels("cuda", "cpu")  # type: ignore[arg-type]


def test_kernels_is_frozen_and_complete() -> None:
    kernels = get_kernels("torch", "cpu")
    with pytest.raises(dataclasses.FrozenInstanceError):
        kernels.rms_norm = rms_norm_ref  # type: ignore[misc]
    assert set(KERNEL_NAMES) == {f.name for f in dataclasses.fields(Kernels)} - {"backend"}
    for name in KERNEL_NAMES:
        assert callable(getattr(dispatch, name)), f"no module-level {name}"


def test_module_level_functions_route_by_device() -> None:
    g = gen(1)
    x, w = torch.randn(3, 8, generator=g), torch.randn(8, generator=g)
    assert torch.equal(dispatch.rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))
    assert dispatch.rms_norm.__name__ == "rms_norm"
    assert dispatch.rms_norm.__doc__ == rms_norm_ref.__doc__
