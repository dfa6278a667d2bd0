"""`pd-ssm bench kernels`: the baseline notes on the CPU; the SSD rows, eager and graphed, on a GPU."""

from __future__ import annotations

import pytest
import torch

from pd_ssm.bench.kernels import _baseline, _baseline_note, bench_ssd
from tests.conftest import needs_cuda


def test_baseline_notes() -> None:
    assert _baseline_note("ssd [graph]", importable=False, base_ms=None) == "baseline not available"
    assert _baseline_note("ssd [graph]", importable=True, base_ms=None) == "baseline not capturable"
    assert _baseline_note("ssd", importable=True, base_ms=0.3) == ""
    assert _baseline_note("rms_norm_gated", importable=False, base_ms=None) == ""  # mamba_ssm has no twin


def test_bench_kernels_refuses_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from pd_ssm.bench.kernels import run

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a machine without one
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        run()


@needs_cuda
@pytest.mark.parametrize("graph", [False, True])
def test_ssd_rows_time_ours_and_the_baseline(graph: bool) -> None:
    from pd_ssm.kernels.dispatch import get_kernels

    dev = torch.device("cuda")
    base = _baseline()
    ms, base_ms, nbytes, flops = bench_ssd(get_kernels("triton", dev), base, dev, [2048], [0], graph=graph)
    assert 0 < ms < 50 and nbytes > 0 and flops > 0
    assert (base_ms is None) == (base is None) or (graph and base_ms is None)  # captured, or reported as not


@needs_cuda
def test_conv_and_attention_rows_time_the_kernels() -> None:
    from pd_ssm.bench.kernels import (
        bench_conv_varlen,
        bench_decode_attention,
        bench_gated_norm,
        bench_mlp_act,
        bench_prefill_attention,
        bench_sdpa_prefill,
    )
    from pd_ssm.kernels.dispatch import get_kernels

    dev = torch.device("cuda")
    k = get_kernels("triton", dev)
    for ms, base_ms, nbytes, flops in (
        bench_conv_varlen(k, dev, [300, 17], init=True), bench_decode_attention(k, dev, 2, 100),
        bench_prefill_attention(k, dev, [40, 7], [0, 33]), bench_sdpa_prefill(dev, 64),
        bench_gated_norm(k, dev, 64, groups=8), bench_mlp_act(k, dev, 8, 1000, "silu", True),
        bench_mlp_act(k, dev, 8, 1000, "relu2", False),
    ):
        assert 0 < ms < 50 and base_ms is None and nbytes > 0 and flops > 0


def test_causal_pairs_count_every_query_key_pair() -> None:
    from pd_ssm.bench.kernels import _causal_keys

    # one chunk of 3 after 2 tokens of context: queries see 3, 4, 5 keys; a chunk of 2 alone: 1, 2
    assert _causal_keys([3, 2], [2, 0]) == 3 + 4 + 5 + 1 + 2
