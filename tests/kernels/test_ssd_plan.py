"""plan_scan (pd_ssm/kernels/ssd_plan.py): the SSD scan's launches from shapes and config alone,
checked without a GPU or a kernel run (the kernel tests run every path the plan picks)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from pd_ssm.kernels.ssd import NO_DT_LIMIT  # noqa: E402
from pd_ssm.kernels.ssd_config import LARGE_BATCH_TOKENS, SSDConfig, default_config  # noqa: E402
from pd_ssm.kernels.ssd_plan import ScanShape, plan_scan  # noqa: E402

H, P, G, N = 80, 64, 1, 128


def shape(lengths: list[int], *, dtype: torch.dtype = torch.bfloat16, tma: bool = True, **kw: object) -> ScanShape:
    T = sum(lengths)
    strides = (H * P, P, H, 1, G * N, N, G * N, N)  # x, dt, B, C as separate contiguous tensors
    base = ScanShape(T=T, H=H, P=P, G=G, N=N, S=len(lengths), chunk_size=256, dot_dtype=dtype,
                     elem_size=dtype.itemsize, strides=strides, has_D=True, has_dt_bias=True, dt_softplus=True,
                     dt_limit=NO_DT_LIMIT, boundaries=False, max_seqlen=None, tma_readable=tma)
    return dataclasses.replace(base, **kw)  # type: ignore[arg-type]


def test_one_long_sequence_runs_the_two_state_kernels_and_the_fused_scan() -> None:
    sh = shape([4096])
    plan = plan_scan(sh, default_config(torch.bfloat16, 4096), False)
    assert plan.serial is None and plan.state is not None and plan.passing is not None
    assert plan.dt is None and plan.cb is None and plan.cb_shape is None  # below LARGE_BATCH_TOKENS
    assert plan.Q == 256 and plan.K == 4096 // 256 + 1  # the bound: (T - S) // Q + 2 S
    assert plan.scan.grid == (H, 256 // 64, plan.K) and plan.passing.grid == (P * N // 512, 1, H)
    # the state kernels' scalars: dimensions, the dt' limits (none), x / dt / B strides
    assert plan.state.scalars == (plan.K, H, P, N, H // G, 0.0, 0.0, H * P, P, H, 1, G * N, N)
    assert plan.scan.scalars[-2:] == (H * P, P)  # the fresh output's strides
    assert plan.scan_tiles == ((32, P), (32, N), (64, N)) and plan.state_tiles == ((32, P), (32, N))
    assert plan.work_sizes == (H * plan.K * 256, H * plan.K * 256, plan.K * H * P * N)  # fp32 chunk states
    assert plan.low_states == 0 and plan.starts == plan.K * H * P * N and plan.dot_dtype == torch.bfloat16


def test_large_batches_add_the_dt_and_cb_launches() -> None:
    plan = plan_scan(shape([LARGE_BATCH_TOKENS]), default_config(torch.bfloat16, LARGE_BATCH_TOKENS), False)
    assert plan.dt is not None and plan.cb is not None and plan.cb_shape == (plan.K, G, 256, 256)
    assert plan.cb_dtype == torch.float32 and plan.dt.grid == (H, plan.K)
    assert plan.scan.constexprs["PREFETCH"] and plan.scan.constexprs["CB_LOADED"]
    assert plan.scan.constexprs["maxnreg"] == 128 and plan.state is not None and plan.state.constexprs["DT_DONE"]
    # the scan adds the entering states last; under PDL only where the device has it
    assert plan.scan.constexprs["LATE_START"] and not plan.scan.constexprs["PDL"]
    assert plan.passing is not None and not plan.passing.constexprs["PDL"]
    assert "launch_pdl" not in plan.scan.constexprs


def test_the_scan_overlaps_the_passing_kernel_under_pdl() -> None:
    """With PDL the passing kernel releases the scan at its gate and the scan waits for it only
    before the entering states; the serial path and configs without dt' launch or look-ahead keep
    the entering states first."""
    cfg = default_config(torch.bfloat16, LARGE_BATCH_TOKENS)
    plan = plan_scan(shape([LARGE_BATCH_TOKENS], pdl=True), cfg, False)
    assert plan.passing is not None and plan.passing.constexprs["PDL"] and plan.passing.constexprs["launch_pdl"]
    assert plan.scan.constexprs["LATE_START"] and plan.scan.constexprs["PDL"] and plan.scan.constexprs["launch_pdl"]
    for other in (dataclasses.replace(cfg, scan_overlap=False), dataclasses.replace(cfg, state_dt_launch=False),
                  dataclasses.replace(cfg, scan_prefetch=False)):
        off = plan_scan(shape([LARGE_BATCH_TOKENS], pdl=True), other, False)
        assert not off.scan.constexprs["LATE_START"] and not off.scan.constexprs["PDL"]
    serial = plan_scan(shape([1024] * 16, pdl=True), cfg, False)
    assert serial.serial is not None and not serial.scan.constexprs["LATE_START"]


def test_short_sequences_walk_serially_in_smaller_chunks() -> None:
    sh = shape([1024] * 16)
    plan = plan_scan(sh, default_config(torch.bfloat16, sh.T), False)
    assert plan.serial is not None and plan.state is None and plan.passing is None and plan.dt is None
    assert plan.Q == 128 and plan.serial.grid == (N // 64, H, 16)
    assert plan.serial.scalars[-1] == 2  # model chunks are two kernel chunks
    assert plan.work_sizes[2] == 0  # no fp32 chunk-state round trip


def test_descriptors_only_where_the_layout_and_length_allow() -> None:
    cfg = default_config(torch.bfloat16, 4096)
    assert plan_scan(shape([8192], tma=False), cfg, False).scan_tiles is None
    assert plan_scan(shape([cfg.scan_tma_min_tokens - 1]), cfg, False).scan_tiles is None
    assert plan_scan(shape([8192]), dataclasses.replace(cfg, scan_tma=False, state_tma=False), False).state_tiles is None


def test_fp32_inputs_dot_in_ieee_and_limits_reach_the_kernels() -> None:
    sh = shape([3000], dtype=torch.float32, dt_limit=(0.01, 5.0), boundaries=True)
    plan = plan_scan(sh, default_config(torch.float32, sh.T), False)
    assert plan.scan.constexprs["DOT_PRECISION"] == "ieee" and plan.dot_dtype == torch.float32
    assert plan.state is not None and plan.state.constexprs["HAS_DT_LIMIT"]
    assert plan.state.scalars[5:7] == (0.01, 5.0) and plan.meta.constexprs["AT_POSITIONS"]
    assert plan.passing is not None and plan.passing.constexprs["RETURN_BOUNDARY"]


def test_low_chunk_states_take_their_own_allocation() -> None:
    cfg = SSDConfig(chunk_states_low=True, state_serial=False)
    plan = plan_scan(shape([2048]), cfg, False)
    assert plan.low_states == plan.K * H * P * N and plan.work_sizes[2] == 0


def _scan_args(T: int, *, offset: int = 0) -> tuple[tuple[torch.Tensor, ...], dict[str, object]]:
    """A 1 x T bf16 scan's arguments on the CPU, x `offset` elements into its buffer."""
    g = torch.Generator().manual_seed(T + offset)
    h, p, n = 4, 16, 16
    x = torch.randn(T * h * p + offset, generator=g).to(torch.bfloat16)[offset:].view(T, h, p)
    B, C = (torch.randn(T, 1, n, generator=g).to(torch.bfloat16) for _ in range(2))
    dt = torch.randn(T, h, generator=g).to(torch.bfloat16)
    kw: dict[str, object] = dict(
        cu_seqlens=torch.tensor([0, T], dtype=torch.int32), context_lens=torch.zeros(1, dtype=torch.int32),
        ssm_state=torch.randn(2, h, p, n, generator=g), state_indices=torch.ones(1, dtype=torch.int32),
        has_initial_state=torch.tensor([False]), D=None, dt_bias=None, dt_softplus=True, dt_limit=NO_DT_LIMIT,
        return_boundary_states=False, config=None)
    return (x, dt, -torch.rand(h, generator=g), B, C, 16), kw


def test_plans_are_kept_per_signature_and_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    from pd_ssm.kernels import ssd_triton

    checks: list[int] = []
    check = ssd_triton._check_scan_args
    monkeypatch.setattr(ssd_triton, "_check_scan_args", lambda *a: checks.append(1) or check(*a))
    monkeypatch.setattr(ssd_triton, "_scan", lambda prepared, *a: prepared.plan)  # plans only, no kernels
    monkeypatch.setattr(ssd_triton, "_PLANS", {})
    monkeypatch.setattr(ssd_triton, "_MAX_PLANS", 2)
    args, kw = _scan_args(40)
    first = ssd_triton.ssd_scan_with_config(*args, **kw)  # type: ignore[arg-type]
    again = ssd_triton.ssd_scan_with_config(*_scan_args(40)[0], **kw)  # type: ignore[arg-type]
    assert again is first and len(checks) == 1  # new tensors, same signature: no checks, no new plan
    misaligned = ssd_triton.ssd_scan_with_config(*_scan_args(40, offset=1)[0], **kw)  # type: ignore[arg-type]
    assert misaligned is not first and len(checks) == 2  # x one element into its buffer: not 16-byte aligned
    ssd_triton.ssd_scan_with_config(*_scan_args(48)[0], **kw)  # type: ignore[arg-type]
    assert len(ssd_triton._PLANS) <= 2 and len(checks) == 3  # the table was full: cleared, then this plan
    with pytest.raises(ValueError, match="dt"):  # a bad argument is a new signature: checked
        ssd_triton.ssd_scan_with_config(*args[:1], args[1][:, :2], *args[2:], **kw)  # type: ignore[arg-type]
