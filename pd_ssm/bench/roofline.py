"""Roofline floors of whole-model steps, from the built model: the bytes a step must move and the
matmul FLOPs a prompt must go through (`pd-ssm bench engine` prints each step beside its floor).

  decode    (weight bytes + state bytes read and written + KV bytes read and written) / copy
            bandwidth; weights count once per step (an untied embedding only for the rows read)
  prefill   the larger of the same memory floor and the matmul floor, 2 · tokens · (parameters of
            the linear layers) / bf16 matmul rate (the SSD scan's few % of FLOPs left out)
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True, slots=True)
class ModelBytes:
    """What one step must move or compute, per model (from the built model, not from a formula)."""

    weights: int  # read once per decode step (an untied embedding table only for its rows)
    embedding_row: int  # bytes of one embedding row (untied: read per sequence)
    untied_embedding: int  # bytes of an untied embedding table (0 when tied to the LM head)
    linear_params: int  # parameters of the matmuls every prompt token goes through (not the LM head)
    slot: int  # one state slot, all SSM layers
    kv_token: int  # K and V of one token, all attention layers


def model_bytes(model: nn.Module, slot_bytes: int, kv_token_bytes: int) -> ModelBytes:
    params = list(model.parameters())  # NOTE: tied parameters appear once
    total = sum(p.numel() * p.element_size() for p in params)
    head = getattr(model, "lm_head", None)
    untied, row = 0, 0
    # NOTE: the LM head multiplies only the rows that sample, not every prompt token
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear) and m is not head)
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            row = m.weight.shape[1] * m.weight.element_size()
            if head is None or head.weight is not m.weight:
                untied += m.weight.numel() * m.weight.element_size()
    return ModelBytes(weights=total - untied, embedding_row=row, untied_embedding=untied, linear_params=linear,
                      slot=slot_bytes, kv_token=kv_token_bytes)


def decode_floor_bytes(mb: ModelBytes, batch: int, kv_tokens_read: int = 0) -> int:
    """Bytes a decode step of `batch` sequences must move: the weights once, each sequence's state
    read and written, the KV it attends over read and its new token's KV written."""
    untied_rows = batch * mb.embedding_row if mb.untied_embedding else 0
    return mb.weights + untied_rows + 2 * batch * mb.slot + (kv_tokens_read + batch) * mb.kv_token


def prefill_floor(mb: ModelBytes, tokens: int, copy_bytes_per_s: float, matmul_flops_per_s: float) -> tuple[float, str, int]:
    """(floor seconds, "memory" | "matmul", bytes) of prefilling `tokens` tokens of one sequence."""
    untied_rows = tokens * mb.embedding_row if mb.untied_embedding else 0
    nbytes = mb.weights + untied_rows + mb.slot + tokens * mb.kv_token
    mem_s = nbytes / copy_bytes_per_s
    mma_s = 2.0 * tokens * mb.linear_params / matmul_flops_per_s
    return (mma_s, "matmul", nbytes) if mma_s > mem_s else (mem_s, "memory", nbytes)
