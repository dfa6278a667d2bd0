from __future__ import annotations

import random

import pytest

from pd_ssm.cache.manager import CacheFullError, CacheManager


def test_allocate_grow_free_keeps_invariants() -> None:
    m = CacheManager(num_slots=4, num_blocks=10, block_size=4, uses_kv=True)
    s = m.allocate("a", 5)  # 2 blocks
    assert m.block_table("a") and len(m.block_table("a")) == 2 and m.slot("a") == s
    m.grow("a", 9)
    assert len(m.block_table("a")) == 3
    m.grow("a", 9)  # no-op
    assert len(m.block_table("a")) == 3
    m.check()
    m.free("a")
    m.free("a")  # freeing twice is harmless
    assert m.num_free_slots == 4 and m.num_free_blocks == 10
    m.check()


def test_all_or_nothing() -> None:
    m = CacheManager(num_slots=2, num_blocks=3, block_size=2, uses_kv=True)
    m.allocate("a", 4)
    with pytest.raises(CacheFullError):
        m.allocate("b", 4)  # needs 2 blocks, 1 free
    assert not m.holds("b") and m.num_free_slots == 1 and m.num_free_blocks == 1
    with pytest.raises(CacheFullError):
        m.grow("a", 7)  # needs 2 more
    assert len(m.block_table("a")) == 2
    with pytest.raises(ValueError):
        m.allocate("a", 1)
    m.check()


def test_try_grow_is_grow_or_nothing() -> None:
    m = CacheManager(num_slots=2, num_blocks=3, block_size=4, uses_kv=True)
    m.allocate("a", 5)  # 2 blocks
    assert m.try_grow("a", 8) and len(m.block_table("a")) == 2  # covered: no new block
    assert m.try_grow("a", 9) and len(m.block_table("a")) == 3
    assert not m.try_grow("a", 13) and len(m.block_table("a")) == 3 and m.num_free_blocks == 0
    m.check()
    ssm = CacheManager(num_slots=1, num_blocks=0, block_size=4, uses_kv=False)
    ssm.allocate("b", 3)
    assert ssm.try_grow("b", 10_000) and ssm.block_table("b") == []


def test_ssm_only_needs_no_blocks() -> None:
    m = CacheManager(num_slots=2, num_blocks=100, block_size=16, uses_kv=False)
    assert m.num_blocks == 0
    m.allocate("a", 10_000)
    m.allocate("b", 1)
    assert m.block_table("a") == [] and not m.can_admit(1)
    with pytest.raises(CacheFullError):
        m.allocate("c", 1)
    m.check()


def test_random_walk_invariants() -> None:
    rng = random.Random(1234)
    m = CacheManager(num_slots=8, num_blocks=40, block_size=4, uses_kv=True)
    live: dict[str, int] = {}
    for step in range(2000):
        op = rng.random()
        if op < 0.4:
            rid, n = f"r{step}", rng.randint(1, 30)
            if m.can_admit(n):
                m.allocate(rid, n)
                live[rid] = n
            else:
                with pytest.raises(CacheFullError):
                    m.allocate(rid, n)
        elif op < 0.7 and live:
            rid = rng.choice(sorted(live))
            n = live[rid] + rng.randint(1, 8)
            if m.can_grow(rid, n):
                m.grow(rid, n)
                live[rid] = n
        elif live:
            rid = rng.choice(sorted(live))
            m.free(rid)
            del live[rid]
        m.check()
        for rid, n in live.items():
            assert len(m.block_table(rid)) * 4 >= n
    for rid in list(live):
        m.free(rid)
    assert m.num_free_slots == 8 and m.num_free_blocks == 40
