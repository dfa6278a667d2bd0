"""The kernels composed as a Mamba2 mixer reproduce transformers' Mamba2Mixer torch path.

in_proj -> causal_conv1d -> SSD scan (or selective state update) -> gated RMSNorm -> out_proj,
with state pools in between, against the HF module on the same random weights: a whole prompt
without cache, and a prompt prefilled in two chunks then decoded token by token with HF's cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from kernel_oracles import gen, i32
from torch import Tensor
from transformers import DynamicCache, Mamba2Config
from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer

from pd_ssm.kernels.conv1d import causal_conv1d_update_ref, causal_conv1d_varlen_ref
from pd_ssm.kernels.rmsnorm import rms_norm_gated_ref
from pd_ssm.kernels.ssd import mamba_chunk_scan_varlen_ref
from pd_ssm.kernels.ssu import selective_state_update_ref
from tests.conftest import needs_reference_transformers

pytestmark = needs_reference_transformers

HIDDEN, HEADS, HEAD_DIM, STATE, GROUPS, WIDTH, CHUNK = 16, 8, 4, 8, 2, 4, 8
D_INNER = HEADS * HEAD_DIM
CONV_DIM = D_INNER + 2 * GROUPS * STATE
SLOT = 2  # the mixer's sequence lives in slot 2 of 4-slot pools


def make_mixer(seed: int, time_step_limit: Sequence[float]) -> tuple[Mamba2Config, Mamba2Mixer]:
    config = Mamba2Config(
        hidden_size=HIDDEN, num_heads=HEADS, head_dim=HEAD_DIM, expand=2, state_size=STATE, n_groups=GROUPS,
        conv_kernel=WIDTH, chunk_size=CHUNK, num_hidden_layers=1, vocab_size=32,
        time_step_limit=tuple(time_step_limit),
    )
    mixer = Mamba2Mixer(config, layer_idx=0).eval()
    g = gen(seed)
    with torch.no_grad():
        for name, p in mixer.named_parameters():
            scale = {"A_log": 1.0, "dt_bias": 1.0, "D": 1.0, "norm.weight": 1.0}.get(name, 0.3)
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    return config, mixer


class PoolMixer:
    """The mixer's math through the pd_ssm kernels, its state in pools (slot SLOT of each)."""

    def __init__(self, mixer: Mamba2Mixer, config: Mamba2Config, g: torch.Generator):
        self.m, self.limit = mixer, tuple(config.time_step_limit)
        self.conv_pool = torch.randn(4, CONV_DIM, WIDTH - 1, generator=g)
        self.ssm_pool = torch.randn(4, HEADS, HEAD_DIM, STATE, generator=g)
        self.A = -torch.exp(mixer.A_log.float())

    def _split(self, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return self.m.in_proj(h).split([D_INNER, CONV_DIM, HEADS], dim=-1)  # gate, xBC, dt

    def _finish(self, y: Tensor, gate: Tensor) -> Tensor:
        y = rms_norm_gated_ref(y.reshape(-1, D_INNER), gate, self.m.norm.weight, self.m.norm.variance_epsilon,
                               D_INNER // GROUPS)
        return self.m.out_proj(y)

    def prefill(self, h: Tensor, context_len: int) -> Tensor:
        """h [L, hidden] continuing a sequence that has seen `context_len` tokens."""
        L = h.shape[0]
        gate, xBC, dt = self._split(h)
        common = dict(cu_seqlens=i32([0, L]), state_indices=i32([SLOT]),
                      has_initial_state=torch.tensor([context_len > 0]))
        xBC = causal_conv1d_varlen_ref(xBC, self.m.conv1d.weight[:, 0, :], self.m.conv1d.bias, self.conv_pool,
                                       **common)
        x, B, C = xBC.split([D_INNER, GROUPS * STATE, GROUPS * STATE], dim=-1)
        y = mamba_chunk_scan_varlen_ref(
            x.view(L, HEADS, HEAD_DIM), dt, self.A, B.view(L, GROUPS, STATE), C.view(L, GROUPS, STATE), CHUNK,
            context_lens=i32([context_len]), ssm_state=self.ssm_pool, D=self.m.D, dt_bias=self.m.dt_bias,
            dt_limit=self.limit, **common,
        ).out
        return self._finish(y, gate)

    def decode(self, h: Tensor) -> Tensor:
        """h [1, hidden]: one new token."""
        gate, xBC, dt = self._split(h)
        xBC = causal_conv1d_update_ref(xBC, self.conv_pool, self.m.conv1d.weight[:, 0, :], self.m.conv1d.bias,
                                       state_indices=i32([SLOT]))
        x, B, C = xBC.split([D_INNER, GROUPS * STATE, GROUPS * STATE], dim=-1)
        # NOTE: HF's decode step ignores time_step_limit; the default limit reproduces it
        y = selective_state_update_ref(
            self.ssm_pool, x.view(1, HEADS, HEAD_DIM), dt, self.A, B.view(1, GROUPS, STATE),
            C.view(1, GROUPS, STATE), state_indices=i32([SLOT]), D=self.m.D, dt_bias=self.m.dt_bias,
        )
        return self._finish(y, gate)


@pytest.mark.parametrize("limit", [(0.0, float("inf")), (0.05, 0.5)])
@torch.no_grad()
def test_whole_prompt_without_cache(limit: tuple[float, float]) -> None:
    config, mixer = make_mixer(1, limit)
    g = gen(2)
    h = torch.randn(1, 21, HIDDEN, generator=g)
    expected = mixer(h)[0]  # the torch_forward path: no cache, eval mode
    ours = PoolMixer(mixer, config, g).prefill(h[0], context_len=0)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_chunked_prefill_then_decode_with_hf_cache() -> None:
    config, mixer = make_mixer(3, (0.0, float("inf")))
    g = gen(4)
    h = torch.randn(1, 26, HIDDEN, generator=g)
    cache = DynamicCache(config=config)
    ours = PoolMixer(mixer, config, g)
    # 11 then 9 prompt tokens: the second chunk starts mid-chunk (11 % 8 = 3), then 6 decode steps
    for a, b in [(0, 11), (11, 20)]:
        expected = mixer(h[:, a:b], cache=cache)[0]
        torch.testing.assert_close(ours.prefill(h[0, a:b], context_len=a), expected, rtol=1e-5, atol=1e-5)
    for t in range(20, 26):
        expected = mixer(h[:, t:t + 1], cache=cache)[0]
        torch.testing.assert_close(ours.decode(h[0, t:t + 1]), expected, rtol=1e-5, atol=1e-5)
    hf_layer = cache.layers[0]
    torch.testing.assert_close(ours.ssm_pool[SLOT], hf_layer.recurrent_states[0][0], rtol=1e-5, atol=1e-5)
    # HF keeps WIDTH inputs; ours the newest WIDTH-1 of them
    torch.testing.assert_close(ours.conv_pool[SLOT], hf_layer.conv_states[0][0, :, 1:], rtol=0, atol=0)
