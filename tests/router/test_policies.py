"""Routing policies on random worker snapshots (pure: no processes)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from pd_ssm.router.policies import (
    POLICIES,
    LeastLoaded,
    PowerOfTwo,
    RoundRobin,
    WorkerView,
    load_key,
    make_policy,
)


def random_views(rng: random.Random, n: int) -> list[WorkerView]:
    ids = rng.sample(range(1000), n)
    return [WorkerView(f"w{i}", inflight=rng.randint(0, 9), running=rng.randint(0, 8), waiting=rng.randint(0, 4),
                       free_slots=rng.randint(0, 16), free_blocks=rng.randint(0, 512)) for i in ids]


@pytest.fixture
def rng() -> random.Random:
    return random.Random(random.randrange(1 << 30))


def test_make_policy_by_name() -> None:
    for name in POLICIES:
        assert make_policy(name).name == name
    with pytest.raises(ValueError, match="round_robin"):
        make_policy("fastest")


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_returns_a_candidate_and_refuses_none(name: str, rng: random.Random) -> None:
    policy = make_policy(name, random.Random(rng.randrange(99)))
    for _ in range(200):
        views = random_views(rng, rng.randint(1, 6))
        assert policy.choose(views) in views
    with pytest.raises(ValueError, match="no worker"):
        policy.choose([])


def test_round_robin_cycles_in_id_order_and_survives_membership_changes(rng: random.Random) -> None:
    views = random_views(rng, 5)
    rr = RoundRobin()
    picks = [rr.choose(rng.sample(views, len(views))).worker_id for _ in range(15)]  # input order does not matter
    order = sorted(v.worker_id for v in views)
    assert picks == order * 3
    # a worker leaves: the cycle continues after the last pick among those left
    gone = order[2]
    left = [v for v in views if v.worker_id != gone]
    rr2 = RoundRobin()
    seq = [rr2.choose(left).worker_id for _ in range(8)]
    assert gone not in seq and Counter(seq) == Counter({w: 2 for w in order if w != gone})


def test_least_loaded_picks_the_minimum_load_then_most_free_pages(rng: random.Random) -> None:
    for _ in range(200):
        views = random_views(rng, rng.randint(1, 6))
        pick = LeastLoaded().choose(views)
        assert all(pick.load <= v.load for v in views)
        assert pick == min(views, key=load_key)
    # the router's in-flight count counts even before the worker reports it
    a = WorkerView("a", inflight=3, running=0)
    b = WorkerView("b", inflight=0, running=1)
    assert LeastLoaded().choose([a, b]).worker_id == "b"
    # equal load: more free state slots wins
    assert LeastLoaded().choose([WorkerView("a", free_slots=1), WorkerView("b", free_slots=5)]).worker_id == "b"


def test_power_of_two_never_picks_the_worse_of_its_pair_and_spreads(rng: random.Random) -> None:
    views = random_views(rng, 6)
    worst = max(views, key=load_key)
    policy = PowerOfTwo(random.Random(rng.randrange(99)))
    picks = Counter(policy.choose(views).worker_id for _ in range(600))
    assert worst.worker_id not in picks  # it loses every pair it is drawn into
    assert len(picks) >= 3  # and the others share the load, unlike least_loaded
    assert PowerOfTwo().choose(views[:1]) == views[0]
