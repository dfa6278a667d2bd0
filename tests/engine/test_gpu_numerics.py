"""GPU numerics of the whole model: bf16 logits against fp32 logits on the same tokens."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pd_ssm import LLM, SamplingParams
from tests.conftest import needs_cuda, random_prompts, record_logits


def step_logits(llm: LLM, prompts: list[list[int]], n: int) -> dict[str, list[torch.Tensor]]:
    """Greedy-run the prompts; return every sampled row's logits per request, in order."""
    seen = record_logits(llm)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return seen


@needs_cuda
@pytest.mark.parametrize("name", ["mamba2-g1", "bamba-attn-middle", "nemotron-h"])
def test_bf16_logits_close_to_fp32(name: str, hf_checkpoint: Any) -> None:
    path, _ = hf_checkpoint(name)
    prompts = random_prompts(384, [5, 40, 77, 16], seed=4)
    kw: dict[str, Any] = dict(device="cuda", max_num_seqs=4, max_num_batched_tokens=24, gpu_memory_utilization=0.3)
    ref = step_logits(LLM(model=str(path), dtype="float32", **kw), prompts, 1)
    got = step_logits(LLM(model=str(path), dtype="bfloat16", **kw), prompts, 1)
    for rid, rows in ref.items():
        cos = torch.nn.functional.cosine_similarity(rows[0], got[rid][0], dim=0).item()
        assert cos >= 0.999, f"{name} {rid}: bf16 vs fp32 last-token logits cosine {cos:.5f}"
