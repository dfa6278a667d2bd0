"""GPU numerics of the whole model: bf16 logits against fp32 logits on the same tokens."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pd_ssm import LLM, SamplingParams
from tests.conftest import random_prompts

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def step_logits(llm: LLM, prompts: list[list[int]], n: int) -> dict[str, list[torch.Tensor]]:
    """Greedy-run the prompts; return every sampled row's logits per request, in order."""
    seen: dict[str, list[torch.Tensor]] = {}
    runner = llm.engine.runner
    inner = runner.forward_logits

    def wrapped(sched: Any) -> Any:
        logits, reqs = inner(sched)
        for row, req in zip(logits, reqs, strict=True):
            seen.setdefault(req.req_id, []).append(row.float().cpu())
        return logits, reqs

    runner.forward_logits = wrapped  # type: ignore[method-assign]
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
