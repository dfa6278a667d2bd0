"""Scheduler bookkeeping without a model: budgets, ordering, preemption, invariants."""

from __future__ import annotations

import random

from pd_ssm.cache.manager import CacheManager
from pd_ssm.config import SchedulerConfig
from pd_ssm.engine.decode_manager import DecodeManager
from pd_ssm.engine.prefill_manager import PrefillManager
from pd_ssm.engine.request import Request, Status
from pd_ssm.engine.scheduler import Scheduler
from pd_ssm.sampling_params import SamplingParams


def make(num_slots: int, num_blocks: int, block_size: int, budget: int, max_seqs: int) -> Scheduler:
    cache = CacheManager(num_slots, num_blocks, block_size, uses_kv=num_blocks > 0)
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget)
    return Scheduler(cfg, cache, PrefillManager(cache), DecodeManager(cache))


def run(s: Scheduler, reqs: list[Request], max_steps: int = 10_000) -> dict[str, int]:
    """Drive the scheduler as the engine does, feeding fake tokens; return preemptions per request."""
    for r in reqs:
        s.add(r)
    steps = 0
    while s.has_work():
        steps += 1
        assert steps < max_steps, "scheduler made no progress"
        out = s.schedule()
        assert out.num_tokens <= s.config.max_num_batched_tokens
        assert s.num_running <= s.config.max_num_seqs
        assert all(seq.num_new_tokens == 1 for seq in out.decodes)
        ids = [seq.request.req_id for seq in out.seqs]
        assert len(ids) == len(set(ids))
        for seq in out.seqs:
            r = seq.request
            assert s.cache.holds(r.req_id)
            if s.cache.uses_kv:
                assert len(s.cache.block_table(r.req_id)) * s.cache.block_size >= r.num_computed_tokens + seq.num_new_tokens
            r.num_computed_tokens += seq.num_new_tokens
        for seq in out.seqs:
            r = seq.request
            if r.num_computed_tokens == r.num_tokens:  # samples a token
                was_prefill = r in s.prefill.prefilling
                r.output_token_ids.append(len(r.output_token_ids))
                if len(r.output_token_ids) >= r.max_tokens:
                    r.finish("length")
                    s.release(r)
                elif was_prefill:
                    s.finish_prefill(r)
                    s.add_decoding(r)
        s.cache.check()
    assert s.cache.num_used_slots == 0 and s.cache.num_free_blocks == s.cache.num_blocks
    return {r.req_id: r.num_preemptions for r in reqs}


def req(i: int, prompt_len: int, max_tokens: int) -> Request:
    return Request(f"r{i}", list(range(prompt_len)), SamplingParams(max_tokens=max_tokens), seed=i, max_tokens=max_tokens)


def test_chunked_prefill_mixes_with_decodes() -> None:
    s = make(num_slots=8, num_blocks=200, block_size=4, budget=7, max_seqs=8)
    a, b = req(0, 3, 5), req(1, 20, 3)
    s.add(a)
    s.add(b)
    first = s.schedule()
    assert [(x.request.req_id, x.num_new_tokens) for x in first.prefills] == [("r0", 3), ("r1", 4)]
    for seq in first.seqs:
        seq.request.num_computed_tokens += seq.num_new_tokens
    a.output_token_ids.append(0)
    s.finish_prefill(a)
    s.add_decoding(a)
    second = s.schedule()
    assert [x.request.req_id for x in second.decodes] == ["r0"]
    assert [(x.request.req_id, x.num_new_tokens) for x in second.prefills] == [("r1", 6)]


def test_all_finish_under_random_load() -> None:
    rng = random.Random(7)
    reqs = [req(i, rng.randint(1, 40), rng.randint(1, 12)) for i in range(40)]
    run(make(num_slots=6, num_blocks=300, block_size=4, budget=16, max_seqs=5), reqs)
    assert all(r.finished and len(r.output_token_ids) == r.max_tokens for r in reqs)


def test_preemption_under_block_pressure() -> None:
    rng = random.Random(11)
    reqs = [req(i, rng.randint(4, 20), rng.randint(8, 20)) for i in range(12)]
    pre = run(make(num_slots=8, num_blocks=24, block_size=4, budget=32, max_seqs=8), reqs)
    assert sum(pre.values()) > 0, "the pool was sized to force preemption"
    assert all(r.finished and len(r.output_token_ids) == r.max_tokens for r in reqs)


def test_slots_bound_admission_for_pure_ssm() -> None:
    reqs = [req(i, 30, 4) for i in range(6)]
    s = make(num_slots=2, num_blocks=0, block_size=16, budget=100, max_seqs=8)
    for r in reqs:
        s.add(r)
    out = s.schedule()
    assert len(out.prefills) == 2 and s.num_waiting == 4
    assert all(r.status is Status.WAITING for r in reqs[2:])
    for r in reqs:
        s.release(r)
    s.cache.check()
