"""ForwardMeta's host-side facts: the longest chunk of a step, and none where the host lists are a
captured graph's placeholders (a graph serves every batch of its bucket)."""

from __future__ import annotations

import torch

from pd_ssm.engine.forward_meta import ForwardMeta
from pd_ssm.kernels.ssd_config import SSDConfig
from pd_ssm.kernels.ssd_plan import use_serial_states


def meta(q_lens: list[int], num_decodes: int, *, host_lists: bool = True) -> ForwardMeta:
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    S, T = len(q_lens), qsl[-1]
    i32 = dict(dtype=torch.int32)
    ctx = [3 * i for i in range(S)]
    return ForwardMeta(
        num_decodes=num_decodes, num_prefills=S - num_decodes, num_tokens=T,
        query_start_loc=torch.tensor(qsl, **i32), context_lens=torch.tensor(ctx, **i32),
        seq_lens=torch.tensor([c + n for c, n in zip(ctx, q_lens, strict=True)], **i32),
        state_indices=torch.arange(S, **i32), has_initial_state=torch.tensor(ctx) > 0,
        slot_mapping=torch.full((T,), -1, dtype=torch.int64), block_tables=torch.zeros(S, 1, **i32),
        query_start_loc_cpu=qsl, context_lens_cpu=ctx, seq_lens_cpu=[c + n for c, n in zip(ctx, q_lens, strict=True)],
        host_lists=host_lists,
    )


def test_longest_chunk_from_the_host_lists() -> None:
    m = meta([1, 1, 700, 1500, 20], num_decodes=2)
    assert m.max_query_len == 1500
    assert m.prefill_view().max_query_len == 1500
    assert m.decode_view().max_query_len == 1


def test_placeholders_give_no_longest_chunk_and_the_views_keep_that() -> None:
    """Inside a captured prefill graph the lists are zeros (prefill_graphs.py): a longest chunk of
    0 tokens would send every bucket down the serial state path, whatever the replayed batch."""
    m = meta([0, 0, 0], num_decodes=0, host_lists=False)
    assert m.max_query_len is None
    assert m.prefill_view().max_query_len is None and m.decode_view().host_lists is False
    cfg = SSDConfig()
    # the bucket's own tokens and sequences decide: one sequence of 2048 takes the two kernels
    assert not use_serial_states(cfg, 2048, 1, m.max_query_len)
    assert use_serial_states(cfg, 2048, 4, m.max_query_len)
    assert use_serial_states(cfg, 2048, 1, 0)  # what the placeholders used to say
