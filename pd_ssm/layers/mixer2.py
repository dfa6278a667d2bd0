"""The Mamba2 mixer over a varlen batch whose conv / SSM states live in the CachePool.

Per step, with the batch ordered decodes first then prefill chunks (ForwardMeta):

    in_proj(x) -> z [T, d_inner] | xBC [T, conv_dim] | dt [T, nheads]          (HF split order)
    decode tokens:  causal_conv1d_update  -> selective_state_update            (one token each)
    prefill chunks: causal_conv1d_varlen  -> mamba_chunk_scan_varlen           (each from its own state)
    y [T, d_inner] -> gated RMSNorm(y, z) with groups of d_inner / n_groups -> out_proj

With `defer_norm_scale` (Mamba2 blocks; ungrouped norm, no out_proj bias) a step with fewer than
DEFER_BELOW_DECODE_ROWS decode rows instead returns
ScaledDelta(out_proj(weight * y * silu(z)), RowRms): the norm's per-row scale is applied by the
next block's add_rms_norm, and decode rows run the state update and the gate in one kernel
(kernels/mixer_decode.py) -- the gated norm's launch is gone. A decode step whose
block hands the mixer its boundary (NormBoundary: the residual stream and the next block's norm)
goes one further where the kernels have it (`kernels.pending_norm`: decode steps of up to 32 rows
on the Triton kernels): out_proj's epilogue does the residual add and the next norm's statistics,
and the next block's in_proj applies that norm's scale (kernels/pending_norm.py), so the mixer
returns a PendingBlock and the next block's norm launch is gone too.

Both paths read and write the states of the slots in `meta.state_indices` in place.  xBC splits
after the conv into x [d_inner] | B [n_groups * d_state] | C [n_groups * d_state].

NOTE: transformers >= 5 sizes in_proj exactly d_inner + conv_dim + nheads (the old "d_mlp" split
of 4.x derived two extra slices from the projection width, which HF's own in_proj never had);
a checkpoint with a wider in_proj is rejected by the loader's shape check, never sliced silently.

NOTE on dt clamping: the chunked scan clamps softplus(dt + dt_bias) to the model's
time_step_limit, the decode step does not clamp at all.  That is what every reference does
(transformers' torch path, mamba_ssm's `step`, hence `generate`), so prompt tokens are clamped
and generated tokens are not; it only matters for models whose limit is not (0, inf), e.g.
NemotronH (lower bound time_step_min).  Prefill and decode workers apply the same rule, so a
disaggregated run still equals a colocated one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pd_ssm.cache.pool import CachePool
from pd_ssm.config import ModelConfig
from pd_ssm.engine.forward_meta import ForwardMeta
from pd_ssm.kernels.dispatch import Kernels
from pd_ssm.kernels.l2_prefetch import (
    NEXT_WEIGHT_HEAD_BYTES,
    NEXT_WEIGHT_TILE_HEAD_BYTES,
    OUT_PROJ_HEAD_BYTES,
    L2Rows,
)
from pd_ssm.kernels.pending_norm import PendingNorm
from pd_ssm.kernels.rmsnorm import GatedSquares, RowRms
from pd_ssm.layers.norm import GatedRMSNorm, NormBoundary, PendingBlock, ScaledDelta

# the decode step's dt limit: none, as in the references (module docstring)
DECODE_DT_LIMIT = (0.0, float("inf"))
# NOTE: the deferred norm scale runs in steps with fewer decode rows than this: every batch the
# decode graphs capture (up to 256 rows). Measured whole-model on an H200 (2.7B shape, CUDA graphs):
# batch 1 2.32-2.34 ms against 2.48-2.54 on the three-kernel path (session 4). At 32 and 128 rows
# it lost 1-3% then, when each step's host work still added to the GPU's; with async scheduling
# (session 8, one A/B call) it wins there too: 5.445-5.450 against 5.495-5.502 ms at 32 rows,
# 13.99-14.00 against 14.31-14.34 ms at 128
DEFER_BELOW_DECODE_ROWS = 257


def conv1d_weight_from_hf(t: torch.Tensor) -> torch.Tensor:
    """HF nn.Conv1d depthwise weight [dim, 1, width] -> the kernels' [dim, width]."""
    return t[:, 0, :] if t.dim() == 3 and t.shape[1] == 1 else t


class DepthwiseConv1dParams(nn.Module):
    """Parameters of the depthwise causal conv, named like HF's `conv1d` (weight, bias)."""

    def __init__(self, dim: int, width: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, width))  # [dim, width], kernels' layout
        self.weight.weight_converter = conv1d_weight_from_hf  # type: ignore[attr-defined]
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)


class Mamba2Mixer(nn.Module):
    def __init__(
        self, config: ModelConfig, *, layer_idx: int, kernels: Kernels, activation: str = "silu",
        defer_norm_scale: bool = False,
    ) -> None:
        super().__init__()
        if activation != "silu":
            raise ValueError(f"Mamba2 mixer: conv activation {activation!r} is not supported (only silu)")
        self.layer_idx = layer_idx
        self.kernels = kernels
        self.activation = activation
        self.num_heads = config.mamba_num_heads
        self.head_dim = config.mamba_head_dim
        self.n_groups = config.mamba_n_groups
        self.d_state = config.mamba_d_state
        self.d_inner = config.mamba_d_inner
        self.conv_dim = config.mamba_conv_dim
        self.chunk_size = config.mamba_chunk_size
        self.prefill_dt_limit = config.time_step_limit

        hidden = config.hidden_size
        self.in_proj = nn.Linear(hidden, self.d_inner + self.conv_dim + self.num_heads, bias=config.mamba_proj_bias)
        self.conv1d = DepthwiseConv1dParams(self.conv_dim, config.mamba_d_conv, config.mamba_conv_bias)
        # NOTE: kept in fp32 whatever the activation dtype: the kernels compute dt, exp(A dt) and the
        # D skip in fp32, and storing a bf16 checkpoint value in fp32 is lossless
        self.dt_bias = nn.Parameter(torch.ones(self.num_heads, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, self.num_heads + 1, dtype=torch.float32)))
        self.D = nn.Parameter(torch.ones(self.num_heads, dtype=torch.float32))
        self.norm = GatedRMSNorm(self.d_inner, config.rms_norm_eps, config.mamba_norm_group_size, kernels)
        self.out_proj = nn.Linear(self.d_inner, hidden, bias=config.mamba_proj_bias)
        # NOTE: the gated norm's scale moves past out_proj (ScaledDelta) only where it is one scalar
        # per row (the norm is not grouped) and out_proj adds no bias after it
        self.defer_norm_scale = (
            defer_norm_scale and config.mamba_norm_group_size == self.d_inner and not config.mamba_proj_bias
        )
        self._A: torch.Tensor | None = None
        self._A_key: tuple[int, int] = (-1, -1)

    def A(self) -> torch.Tensor:
        """-exp(A_log) in fp32 [nheads], recomputed only when A_log changes (its version counter
        moves on every in-place write, e.g. loading): two launches fewer per layer and step."""
        key = (self.A_log._version, self.A_log.data_ptr())
        if self._A is None or key != self._A_key:
            self._A = -torch.exp(self.A_log.detach().float())
            self._A_key = key
        return self._A

    def _split_xbc(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[N, conv_dim] -> x [N, nheads, headdim], B [N, ng, ds], C [N, ng, ds] (views)."""
        n = xbc.shape[0]
        gs = self.n_groups * self.d_state
        x, B, C = xbc.split([self.d_inner, gs, gs], dim=-1)
        return (
            x.view(n, self.num_heads, self.head_dim),
            B.view(n, self.n_groups, self.d_state),
            C.view(n, self.n_groups, self.d_state),
        )

    def forward(
        self, hidden: torch.Tensor | PendingNorm, meta: ForwardMeta, cache: CachePool,
        boundary: NormBoundary | None = None,
    ) -> torch.Tensor | ScaledDelta | PendingBlock:
        """[T, hidden] -> [T, hidden]; with `defer_norm_scale`, the output still to be scaled per row,
        or with `boundary` in a decode step the block boundary finished (module docstring). A
        PendingNorm input comes from the previous block's PendingBlock: a decode step."""
        k = self.kernels
        rows = (hidden.x if isinstance(hidden, PendingNorm) else hidden).shape[0]
        defer = self.defer_norm_scale and meta.num_decodes < DEFER_BELOW_DECODE_ROWS
        if isinstance(hidden, PendingNorm) and not (defer and meta.num_prefills == 0):
            raise RuntimeError("a pending norm reaches only a deferred-norm mixer's decode step: the block before "
                               "chose it for this step's decode rows")
        if defer:
            if meta.num_prefills == 0 and (rows == 1 or isinstance(hidden, PendingNorm)):
                # decode rows through in_proj_conv: the conv rides in_proj at one row; a pending norm's
                # scale is applied by in_proj at any number
                gated = self._in_proj_conv_gated_squares(hidden, meta, cache)
            else:
                assert isinstance(hidden, torch.Tensor)
                # NOTE: through the kernels: a decode step of a few rows streams the weights faster than cuBLAS
                proj = k.linear(hidden, self.in_proj.weight, self.in_proj.bias)  # [T, d_inner + conv_dim + nheads]
                gated = self._gated_squares(proj, meta, cache)
            rms = RowRms(gated.sq, self.d_inner, self.norm.eps)
            if (boundary is not None and meta.num_prefills == 0 and not boundary.next_norm.weight_in_fp32
                    and k.pending_norm(gated.g, self.out_proj.weight)):
                nxt = boundary.next_norm
                # the next block's in_proj streams right after: its head is asked of L2 by this kernel's tail
                head = NEXT_WEIGHT_HEAD_BYTES if rows == 1 else NEXT_WEIGHT_TILE_HEAD_BYTES
                ahead = None if boundary.next_weight is None else L2Rows(boundary.next_weight, head)
                residual, pending = k.out_proj_add(gated.g, self.out_proj.weight, rms, boundary.residual, nxt.weight,
                                                   nxt.eps, residual_dtype=boundary.residual_dtype, prefetch=ahead)
                return PendingBlock(residual, pending)
            out = k.linear(gated.g, self.out_proj.weight, None)  # [T, hidden]; no bias (see __init__)
            return ScaledDelta(out, rms)
        assert isinstance(hidden, torch.Tensor)
        proj = k.linear(hidden, self.in_proj.weight, self.in_proj.bias)  # [T, d_inner + conv_dim + nheads]
        z = proj[:, :self.d_inner]
        nd = meta.num_decodes
        ys: list[torch.Tensor] = []
        if nd:
            ys.append(self._decode_y(proj[:nd], meta, cache))
        if meta.num_prefills:
            ys.append(self._prefill_y(proj[nd:], meta, cache))
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=0)  # [T, nheads, headdim]
        y = self.norm(y.reshape(proj.shape[0], self.d_inner), z)
        return k.linear(y, self.out_proj.weight, self.out_proj.bias)

    def _in_proj_conv_gated_squares(self, hidden: torch.Tensor | PendingNorm, meta: ForwardMeta,
                                    cache: CachePool) -> GatedSquares:
        """A decode-only step: in_proj and the conv (in one launch where the kernels have it: one row,
        or a pending norm's rows, kernels/in_proj_conv_triton.py), then the state update and the gate."""
        k = self.kernels
        slots = meta.decode_view().state_indices
        proj, xbc = k.in_proj_conv(
            hidden, self.in_proj.weight, self.in_proj.bias, cache.conv(self.layer_idx), self.conv1d.weight,
            self.conv1d.bias, state_indices=slots, conv_start=self.d_inner,
            # NOTE: out_proj streams next, after the state update: its head is asked of L2 meanwhile
            prefetch=L2Rows(self.out_proj.weight, OUT_PROJ_HEAD_BYTES),
        )
        return k.mamba2_decode_step(
            proj, cache.conv(self.layer_idx), self.conv1d.weight, self.conv1d.bias, cache.ssm(self.layer_idx), self.A(),
            self.D, self.dt_bias, self.norm.weight, state_indices=slots, ngroups=self.n_groups, xbc=xbc,
        )

    def _gated_squares(self, proj: torch.Tensor, meta: ForwardMeta, cache: CachePool) -> GatedSquares:
        """The gated norm's input and squares of every row, decode rows by the fused kernel."""
        k, nd = self.kernels, meta.num_decodes
        parts: list[GatedSquares] = []
        if nd:
            parts.append(k.mamba2_decode_step(
                proj[:nd], cache.conv(self.layer_idx), self.conv1d.weight, self.conv1d.bias,
                cache.ssm(self.layer_idx), self.A(), self.D, self.dt_bias, self.norm.weight,
                state_indices=meta.decode_view().state_indices, ngroups=self.n_groups,
            ))
        if meta.num_prefills:
            y = self._prefill_y(proj[nd:], meta, cache).reshape(-1, self.d_inner)
            parts.append(k.rms_norm_gated_squares(y, proj[nd:, :self.d_inner], self.norm.weight))
        if len(parts) == 1:
            return parts[0]
        # a mixed step: the two parts' partial sums differ in number; zeros pad the narrower
        width = max(p.sq.shape[1] for p in parts)
        sq = torch.cat([F.pad(p.sq, (0, width - p.sq.shape[1])) for p in parts])  # [T, width]
        return GatedSquares(torch.cat([p.g for p in parts]), sq)

    def _decode_y(self, proj: torch.Tensor, meta: ForwardMeta, cache: CachePool) -> torch.Tensor:
        """y [nd, nheads, headdim] of the decode rows (one token each)."""
        k = self.kernels
        _, xbc, dt = proj.split([self.d_inner, self.conv_dim, self.num_heads], dim=-1)
        dec = meta.decode_view()
        xbc = k.causal_conv1d_update(
            xbc, cache.conv(self.layer_idx), self.conv1d.weight, self.conv1d.bias,
            state_indices=dec.state_indices, activation=self.activation,
        )
        x, B, C = self._split_xbc(xbc)
        return k.selective_state_update(
            cache.ssm(self.layer_idx), x, dt, self.A(), B, C,
            state_indices=dec.state_indices, D=self.D, dt_bias=self.dt_bias,
            dt_softplus=True, dt_limit=DECODE_DT_LIMIT,
        )

    def _prefill_y(self, proj: torch.Tensor, meta: ForwardMeta, cache: CachePool) -> torch.Tensor:
        """y [tokens, nheads, headdim] of the prefill chunks, each from its own state."""
        k = self.kernels
        _, xbc, dt = proj.split([self.d_inner, self.conv_dim, self.num_heads], dim=-1)
        pre = meta.prefill_view()
        xbc = k.causal_conv1d_varlen(
            xbc, self.conv1d.weight, self.conv1d.bias, cache.conv(self.layer_idx),
            cu_seqlens=pre.query_start_loc, state_indices=pre.state_indices,
            has_initial_state=pre.has_initial_state, activation=self.activation,
        )
        x, B, C = self._split_xbc(xbc)
        return k.mamba_chunk_scan_varlen(
            x, dt, self.A(), B, C, self.chunk_size,
            cu_seqlens=pre.query_start_loc, context_lens=pre.context_lens, ssm_state=cache.ssm(self.layer_idx),
            state_indices=pre.state_indices, has_initial_state=pre.has_initial_state,
            D=self.D, dt_bias=self.dt_bias, dt_softplus=True, dt_limit=self.prefill_dt_limit,
            max_seqlen=pre.max_query_len,  # picks the Triton scan's state path (ssd_plan.use_serial_states)
        ).out
