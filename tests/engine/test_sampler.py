from __future__ import annotations

import math

import pytest
import torch

from pd_ssm.engine.device_sample import DeviceSample, HostTokenRing
from pd_ssm.engine.sampler import GREEDY_EPS, Sampler, SamplerOutput, counter_seed, make_seed
from pd_ssm.kernels.argmax_triton import GreedyArgmax
from pd_ssm.sampling_params import SamplingParams

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


def _logits(n: int, vocab: int, seed: int, scale: float = 3.0, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, vocab, generator=g) * scale).to(device)


def _run(logits: torch.Tensor, params: list[SamplingParams], seeds=None, offsets=None) -> SamplerOutput:
    n = logits.shape[0]
    seeds = list(range(100, 100 + n)) if seeds is None else seeds
    offsets = [0] * n if offsets is None else offsets
    return Sampler()(logits, params, seeds, offsets)


def _draws(row: torch.Tensor, params: SamplingParams, n: int, seed: int = 7) -> torch.Tensor:
    """n samples of one logits row [V]: one batch, one seed, offsets 0..n-1."""
    out = Sampler()(row[None].expand(n, -1).contiguous(), [params] * n, [seed] * n, list(range(n)))
    return torch.tensor(out.token_ids)


def _probs_row(probs: list[float], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits with the given softmax, in a seeded random token order; also that order's probs."""
    perm = torch.randperm(len(probs), generator=torch.Generator().manual_seed(seed))
    p = torch.tensor(probs)[perm]
    return p.log(), p


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax(device):
    logits = _logits(16, 300, seed=1, device=device)
    out = _run(logits, [SamplingParams(temperature=0.0)] * 16)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 16


def test_greedy_ignores_filters_and_seed():
    logits = _logits(4, 50, seed=2)
    params = [SamplingParams(temperature=0.0, top_k=3, top_p=0.5, min_p=0.3)] * 4
    a = _run(logits, params, seeds=[1, 2, 3, 4], offsets=[0, 5, 9, 11])
    assert a.token_ids == logits.argmax(-1).tolist()


def test_greedy_tie_takes_lowest_id():
    logits = torch.tensor([[0.5, 2.0, 1.0, 2.0, 2.0]])
    assert _run(logits, [SamplingParams(temperature=0.0)]).token_ids == [1]


def test_logits_not_modified():
    logits = _logits(6, 80, seed=3)
    before = logits.clone()
    params = [SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05, logprobs=3)] * 3 + [
        SamplingParams(temperature=0.0)
    ] * 3
    _run(logits, params)
    assert torch.equal(logits, before)


@pytest.mark.parametrize("device", DEVICES)
def test_row_result_independent_of_batch(device):
    """Same (row, params, seed, offset) -> same token and logprobs at any position in any batch."""
    vocab = 500
    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3),
        SamplingParams(temperature=0.7, top_k=4),
        SamplingParams(temperature=1.0, top_p=0.3, logprobs=7),
        SamplingParams(temperature=0.9, min_p=0.2),
    ]
    targets = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.6, top_k=20, logprobs=2),
        SamplingParams(temperature=1.5, top_p=0.8),
        SamplingParams(temperature=1.2, top_k=50, top_p=0.9, min_p=0.01, logprobs=0),
        SamplingParams(temperature=0.0, logprobs=4),
    ]
    gen = torch.Generator().manual_seed(0)
    for t, target in enumerate(targets):
        row = _logits(1, vocab, seed=10 + t, device=device)
        seed, offset = 1000 + t, 37 * t
        alone = Sampler()(row, [target], [seed], [offset])
        for batch_size in (2, 5, 17):
            pos = int(torch.randint(batch_size, (1,), generator=gen))
            logits = _logits(batch_size, vocab, seed=50 + batch_size + t, device=device)
            logits[pos] = row[0]
            params = [others[(i + t) % len(others)] for i in range(batch_size)]
            params[pos] = target
            seeds = torch.randint(1 << 62, (batch_size,), generator=gen).tolist()
            offsets = torch.randint(1000, (batch_size,), generator=gen).tolist()
            seeds[pos], offsets[pos] = seed, offset
            out = Sampler()(logits, params, seeds, offsets)
            assert out.token_ids[pos] == alone.token_ids[0]
            assert out.logprobs[pos] == alone.logprobs[0]


def test_reproducible_across_instances_and_calls():
    logits = _logits(8, 200, seed=4)
    params = [SamplingParams(temperature=1.0, top_p=0.95)] * 8
    seeds, offsets = [make_seed() for _ in range(8)], list(range(8))
    a = Sampler()(logits, params, seeds, offsets)
    s = Sampler()
    assert s(logits, params, seeds, offsets) == a
    assert s(logits, params, seeds, offsets) == a  # the cached generator carries no state


def test_resume_mid_generation_matches_uninterrupted():
    """A request continued elsewhere with its (seed, offset) samples the tokens it would have."""
    vocab, seed = 100, make_seed()
    steps = [_logits(1, vocab, seed=200 + k, scale=1.0) for k in range(12)]
    p = [SamplingParams(temperature=1.0)]
    home = Sampler()
    uninterrupted = [home(steps[k], p, [seed], [k]).token_ids[0] for k in range(12)]
    first = [home(steps[k], p, [seed], [k]).token_ids[0] for k in range(5)]
    away = Sampler()
    rest = [away(steps[k], p, [seed], [k]).token_ids[0] for k in range(5, 12)]
    assert first + rest == uninterrupted


def test_offsets_and_seeds_give_different_draws():
    row = _logits(1, 1000, seed=5, scale=0.1)[0]  # nearly flat: draws rarely collide by chance
    tokens = _draws(row, SamplingParams(temperature=1.0), 200)
    assert len(set(tokens.tolist())) > 150
    by_seed = [_run(row[None], [SamplingParams()], seeds=[s]).token_ids[0] for s in range(100)]
    assert len(set(by_seed)) > 75


def test_counter_seed_is_63_bit_and_distinct():
    values = {counter_seed(s, o) for s in (0, 1, -1, (1 << 63) - 1) for o in range(2000)}
    assert len(values) == 4 * 2000
    assert all(0 <= v < (1 << 63) for v in values)


def test_make_seed_range():
    seeds = {make_seed() for _ in range(100)}
    assert len(seeds) == 100 and all(0 <= s < (1 << 63) for s in seeds)


def _chi_square(tokens: torch.Tensor, expected_probs: torch.Tensor) -> float:
    n = tokens.numel()
    counts = torch.bincount(tokens, minlength=expected_probs.numel()).double()
    expected = expected_probs.double() * n
    support = expected > 0
    assert counts[~support].sum() == 0, "sampled a token of probability 0"
    return float(((counts[support] - expected[support]) ** 2 / expected[support]).sum())


# NOTE: draws are seeded, so these are deterministic; the bounds are the chi-square 0.999 quantiles
# with slack (dof 7: 24.3, dof 2: 13.8), which a correct sampler passes for almost every seed.
def test_distribution_matches_softmax_with_temperature():
    row = _logits(1, 8, seed=6, scale=1.0)[0]
    for temperature in (0.7, 1.0, 1.8):
        tokens = _draws(row, SamplingParams(temperature=temperature), 20000, seed=11)
        assert _chi_square(tokens, torch.softmax(row / temperature, -1)) < 30.0


def test_distribution_under_top_k_is_renormalized():
    row = _logits(1, 8, seed=7, scale=1.0)[0]
    tokens = _draws(row, SamplingParams(temperature=1.0, top_k=3), 20000, seed=12)
    expected = torch.zeros(8)
    top = row.topk(3).indices
    expected[top] = torch.softmax(row[top], -1)
    assert _chi_square(tokens, expected) < 20.0


def test_top_k_never_outside_top_k():
    vocab = 64
    for k in (1, 2, 5, 17):
        row = _logits(1, vocab, seed=20 + k, scale=0.5)[0]
        tokens = set(_draws(row, SamplingParams(temperature=2.0, top_k=k), 3000).tolist())
        allowed = set(row.topk(k).indices.tolist())
        assert tokens <= allowed
        assert len(tokens) == k  # flat enough that every allowed token appears
    # top_k >= V is no filter
    row = _logits(1, 6, seed=30, scale=0.3)[0]
    assert set(_draws(row, SamplingParams(temperature=1.0, top_k=100), 2000).tolist()) == set(range(6))


def test_top_k_ties_keep_lowest_ids():
    row = torch.tensor([1.0, 3.0, 0.5, 3.0, 3.0, -1.0])
    tokens = set(_draws(row, SamplingParams(temperature=1.0, top_k=2), 500).tolist())
    assert tokens == {1, 3}


@pytest.mark.parametrize(
    "probs, top_p, kept",
    [
        ([0.5, 0.3, 0.15, 0.05], 0.4, [0.5]),
        ([0.5, 0.3, 0.15, 0.05], 0.7, [0.5, 0.3]),
        ([0.5, 0.3, 0.15, 0.05], 0.85, [0.5, 0.3, 0.15]),
        ([0.5, 0.3, 0.15, 0.05], 0.99, [0.5, 0.3, 0.15, 0.05]),
        ([0.4, 0.2, 0.2, 0.1, 0.1], 0.5, [0.4, 0.2]),
    ],
)
def test_top_p_keeps_smallest_set_reaching_p(probs, top_p, kept):
    logits, p = _probs_row(probs, seed=len(kept))
    tokens = set(_draws(logits, SamplingParams(temperature=1.0, top_p=top_p), 3000).tolist())
    # by probability, ties by id: a tie at the boundary keeps the lower id
    order = sorted(range(len(probs)), key=lambda i: (-float(p[i]), i))
    assert sorted(float(p[i]) for i in order[: len(kept)]) == pytest.approx(sorted(kept))
    assert tokens == set(order[: len(kept)])


def test_top_p_applies_after_top_k():
    # top-k 2 leaves {0.4, 0.3} renormalized to {0.571, 0.429}: top-p 0.5 then keeps only the first
    logits, p = _probs_row([0.4, 0.3, 0.2, 0.1], seed=3)
    tokens = set(_draws(logits, SamplingParams(temperature=1.0, top_k=2, top_p=0.5), 1000).tolist())
    assert tokens == {int(p.argmax())}


@pytest.mark.parametrize(
    "min_p, kept",
    [(0.05, [0.5, 0.3, 0.15, 0.05]), (0.2, [0.5, 0.3, 0.15]), (0.5, [0.5, 0.3]), (0.9, [0.5])],
)
def test_min_p_masks_below_fraction_of_top(min_p, kept):
    logits, p = _probs_row([0.5, 0.3, 0.15, 0.05], seed=9)
    tokens = set(_draws(logits, SamplingParams(temperature=1.0, min_p=min_p), 3000).tolist())
    assert tokens == {
        i for i, x in enumerate(p.tolist()) if any(math.isclose(x, k, rel_tol=1e-6) for k in kept)
    }


def test_logprobs_are_raw_log_softmax_with_sampled_token():
    logits = _logits(6, 120, seed=40)
    raw = torch.log_softmax(logits, -1)
    params = [
        SamplingParams(temperature=0.5, top_k=3, logprobs=5),  # processed probs must not leak into logprobs
        SamplingParams(temperature=1.0, logprobs=0),
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=2.0),
        SamplingParams(temperature=3.0, logprobs=1),
        SamplingParams(temperature=1.0, logprobs=500),  # more than V: all of them
    ]
    out = _run(logits, params, offsets=[3, 1, 4, 1, 5, 9])
    for i, p in enumerate(params):
        d, tok = out.logprobs[i], out.token_ids[i]
        if p.logprobs is None:
            assert d is None
            continue
        n = min(p.logprobs, 120)
        top = raw[i].topk(n).indices.tolist()
        assert list(d)[:n] == top  # the top-n first, in rank order
        assert set(d) == set(top) | {tok}
        for t, v in d.items():
            assert v == pytest.approx(float(raw[i, t]), abs=1e-5)
    assert out.token_ids[2] == int(logits[2].argmax())
    assert len(out.logprobs[1]) == 1


def test_logprobs_include_sampled_token_outside_top_n():
    row = _logits(1, 40, seed=41, scale=0.2)[0]  # flat: many draws fall outside the top 1
    tokens_outside = 0
    for offset in range(50):
        out = Sampler()(row[None], [SamplingParams(temperature=1.0, logprobs=1)], [3], [offset])
        tok, d = out.token_ids[0], out.logprobs[0]
        assert tok in d and len(d) == (1 if tok == int(row.argmax()) else 2)
        tokens_outside += tok != int(row.argmax())
    assert tokens_outside > 0


def test_tiny_temperature_matches_greedy():
    logits = _logits(32, 100, seed=42)
    greedy = logits.argmax(-1)
    logits[torch.arange(32), greedy] += 0.1  # a clear winner: at T=1e-3 the runner-up has odds e^-100
    greedy = greedy.tolist()
    for t in (1e-3, GREEDY_EPS / 10):
        out = _run(logits, [SamplingParams(temperature=t)] * 32, seeds=list(range(32)))
        assert out.token_ids == greedy


def test_bfloat16_logits_are_upcast():
    logits = _logits(4, 64, seed=43)
    params = [SamplingParams(temperature=0.9, top_p=0.9)] * 4
    a = _run(logits.bfloat16(), params)
    b = _run(logits.bfloat16().float(), params)
    assert a == b


def test_bad_inputs_raise():
    logits = _logits(2, 10, seed=44)
    with pytest.raises(ValueError, match="one params"):
        Sampler()(logits, [SamplingParams()], [0, 1], [0, 0])
    with pytest.raises(ValueError, match="offsets"):
        Sampler()(logits, [SamplingParams()] * 2, [0, 1], [0, -1])
    with pytest.raises(ValueError, match="logits"):
        Sampler()(logits[0], [SamplingParams()], [0], [0])


def test_empty_batch():
    assert Sampler()(torch.empty(0, 10), [], [], []) == SamplerOutput([], [])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_row_invariance_at_real_vocab_size():
    """At a real vocab size the CUDA softmax / sort / cumsum kernels still see each row alone."""
    vocab = 151_936
    target = SamplingParams(temperature=0.8, top_k=1000, top_p=0.95, min_p=0.001, logprobs=5)
    row = _logits(1, vocab, seed=60, scale=2.0, device="cuda")
    alone = Sampler()(row, [target], [123], [45])
    for n in (3, 64, 257):
        logits = _logits(n, vocab, seed=61 + n, scale=2.0, device="cuda")
        pos = n // 2
        logits[pos] = row[0]
        params = [SamplingParams(temperature=1.0, top_p=0.9 if i % 2 else 1.0) for i in range(n)]
        params[pos] = target
        seeds, offsets = list(range(n)), list(range(n))
        seeds[pos], offsets[pos] = 123, 45
        out = Sampler()(logits, params, seeds, offsets)
        assert out.token_ids[pos] == alone.token_ids[0]
        assert out.logprobs[pos] == alone.logprobs[0]


def test_logprob_ties_are_ordered_by_token_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, 2.0]])
    out = _run(logits, [SamplingParams(temperature=0.0, logprobs=4)])
    assert list(out.logprobs[0]) == [1, 2, 4, 5]


def test_host_token_ring_reads_a_sample_before_reusing_its_buffer():
    """A buffer comes back only after its sample's values were kept (read late, still its own)."""
    ring = HostTokenRing(pin=False)
    samples = []
    for step in range(HostTokenRing.SLOTS + 2):
        slot, buf = ring.take(3)
        buf.copy_(torch.tensor([step, step + 1, step + 2]))  # what the argmax kernel writes
        sample = DeviceSample(buf.clone(), None, host_tokens=buf)
        ring.bind(slot, sample)
        samples.append(sample)
    # the first two buffers were handed out again: their samples had been read before that
    for step, sample in enumerate(samples):
        assert sample.host().token_ids == [step, step + 1, step + 2]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_greedy_tokens_written_to_host_by_the_argmax():
    """All-greedy CUDA steps through the Triton argmax: tokens reach the host without a copy, also
    when read several steps late (the ring keeps them), and equal torch.argmax."""
    sampler = Sampler(argmax=GreedyArgmax())
    steps = [_logits(n, 50_280, seed=70 + n, device="cuda") for n in (1, 5, 32, 32, 7, 128, 2)]
    params = [[SamplingParams(temperature=0.0)] * s.shape[0] for s in steps]
    pending = [sampler.sample(s, p, [0] * len(p), [0] * len(p)).start_copy() for s, p in zip(steps, params, strict=True)]
    for s, d in zip(steps, pending, strict=True):
        assert d.host().token_ids == s.argmax(-1).tolist()
        assert torch.equal(d.tokens, s.argmax(-1))
