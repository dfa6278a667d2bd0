"""Sampler: one token per logits row, reproducible from (seed, offset) alone.

Contract: the token (and logprobs) of row `i` is a function of `logits[i]`, `params[i]`, `seeds[i]`
and `offsets[i]` only, never of the other rows, the batch size or the row's position, and it is
the same in any process on the same device type.  So a request exported mid-generation, with its
`seed` and `offset` (the number of tokens it has sampled so far), samples on the importing engine
exactly the tokens it would have sampled at home.

How: randomness is counter-based.  Row `i` seeds a torch.Generator on the logits' device with
`counter_seed(seeds[i], offsets[i])`, draws V uniforms `u` and samples by the exponential race
`argmax(probs / -log(u))`, which picks token `t` with probability `probs[t] / sum(probs)`.  The
noise is indexed by token id, so nothing about the draw depends on the filters' sort order.

Processing, in vLLM's (v0) order: temperature, then top-k, top-p, min-p masks, each computed on the
distribution the previous one left.  Ties are broken by token id (lower id first): top-k keeps
exactly k tokens, top-p keeps the shortest prefix of the stably-sorted distribution whose mass
reaches p.  Greedy rows (temperature < `GREEDY_EPS`) take `argmax(logits)` (first maximum) and use
no randomness.

Logprobs are vLLM's default "raw" logprobs: log_softmax of the unprocessed logits, top-n by topk,
reported highest first with ties by token id (only a tie exactly at the n-th place is resolved by
topk itself).

NOTE (device streams): CPU and CUDA generators give different streams for one seed, so a request
must continue on the same device type it started on, and on the same torch RNG implementation
(the noise stream is part of the contract: changing how it is drawn changes seeded outputs).  On
CUDA, element t of a row comes from Philox subsequence t as long as V <= SMs * max threads per SM
(270k on H100/H200, 221k on A100); within that the stream does not depend on the GPU model.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

import torch
from torch import Tensor

from pd_ssm.engine.device_sample import DeviceSample, HostTokenRing, LogprobParts, SamplerOutput
from pd_ssm.engine.host_copy import host_values
from pd_ssm.kernels.argmax import greedy_argmax_ref
from pd_ssm.sampling_params import SamplingParams

# NOTE: below this temperature a row samples greedily (vLLM's _SAMPLING_EPS); logits / T would
# otherwise overflow float32 and turn the softmax into NaN.
GREEDY_EPS = 1e-5

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def make_seed() -> int:
    """A fresh 63-bit seed for a request that brought none; the engine stores it with the request."""
    return secrets.randbits(63)


def _mix64(x: int) -> int:
    """splitmix64's finalizer: a bijection on 64-bit ints in which every input bit flips ~half the output."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def counter_seed(seed: int, offset: int) -> int:
    """The 63-bit generator seed of draw number `offset` of the request seeded `seed`.

    For one seed, distinct offsets give distinct 64-bit hashes (both mixes are bijections); the
    top 63 bits are kept so the value is a valid seed for every torch generator.
    """
    key = _mix64((seed + _GOLDEN) & _M64)
    return _mix64(key ^ (offset & _M64)) >> 1


def _is_greedy(p: SamplingParams) -> bool:
    return p.temperature < GREEDY_EPS


def _has_filters(p: SamplingParams) -> bool:
    return p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0


class Sampler:
    """Samples one token per row of `logits` [N, V] (float32, cpu or cuda); see the module docstring.

    The sampler holds no per-request state: the engine owns each request's `seed` (params.seed, or
    `make_seed()` once at admission) and `offset` (tokens sampled so far), and passes both each step.
    `logits` is not modified.
    """

    def __init__(self, argmax: Callable[..., Tensor] = greedy_argmax_ref) -> None:
        # the greedy argmax (logits [N, V], host_out) -> [N] int64 (first maximum): a model's
        # `kernels.greedy_argmax` (kernels/argmax.py)
        self._argmax = argmax
        self._ring = HostTokenRing()
        # one reusable generator per device; reseeded for every row, so it carries no state across calls
        self._generators: dict[torch.device, torch.Generator] = {}

    def __call__(
        self,
        logits: Tensor,
        params: list[SamplingParams],
        seeds: list[int],
        offsets: list[int],
    ) -> SamplerOutput:
        """Sample and read the results on the host (one device -> host sync)."""
        return self.sample(logits, params, seeds, offsets).host()

    def sample(
        self,
        logits: Tensor,
        params: list[SamplingParams],
        seeds: list[int],
        offsets: list[int],
    ) -> DeviceSample:
        """Sample without waiting for the device: tokens and logprobs stay there until `host()`."""
        _check_inputs(logits, params, seeds, offsets)
        if logits.dtype != torch.float32:
            logits = logits.float()
        sampled_rows = [i for i, p in enumerate(params) if not _is_greedy(p)]
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        # all greedy, no logprobs (on CUDA): the argmax writes the tokens to the host itself
        slot, host = self._ring.take(len(params)) if logits.is_cuda and not sampled_rows and not lp_rows else (0, None)
        tokens = self._argmax(logits, host)  # [N] int64; greedy rows keep it
        if sampled_rows:
            idx = host_values(sampled_rows, torch.int64, logits.device)
            tokens[idx] = self._sample(logits, sampled_rows, params, seeds, offsets)
        lp = None
        if lp_rows:
            sampled_lp, top_lp, top_ids = _raw_logprobs(logits, lp_rows, params, tokens)
            lp = LogprobParts(lp_rows, [params[i].logprobs or 0 for i in lp_rows], sampled_lp, top_lp, top_ids)
        sample = DeviceSample(tokens, lp, host_tokens=host)
        if host is not None:
            self._ring.bind(slot, sample)
        return sample

    def _sample(
        self,
        logits: Tensor,
        rows: list[int],
        params: list[SamplingParams],
        seeds: list[int],
        offsets: list[int],
    ) -> Tensor:
        device = logits.device
        idx = host_values(rows, torch.int64, device)
        temp = host_values([params[i].temperature for i in rows], torch.float32, device)
        probs = torch.softmax(logits.index_select(0, idx) / temp[:, None], dim=-1)  # [M, V]
        # NOTE: rows without filters skip the sort entirely; a filter whose parameter is off masks
        # nothing, so a row's probs are the same whichever other rows share its batch.
        filtered = [j for j, i in enumerate(rows) if _has_filters(params[i])]
        if filtered:
            fidx = host_values(filtered, torch.int64, device)
            fparams = [params[rows[j]] for j in filtered]
            sub = probs.index_select(0, fidx)  # [F, V]
            probs[fidx] = sub.masked_fill(_filter_mask(sub, fparams), 0.0)
        race = self._exponential(probs.shape, [counter_seed(seeds[i], offsets[i]) for i in rows], device)
        return (probs / race).argmax(dim=-1)  # [M]

    def _exponential(self, shape: torch.Size, row_seeds: list[int], device: torch.device) -> Tensor:
        """Exp(1) noise [M, V]; row j is a function of row_seeds[j] and V only."""
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device=device)
        u = torch.empty(shape, dtype=torch.float32, device=device)
        for j, s in enumerate(row_seeds):
            gen.manual_seed(s)  # resets the generator's position too: the row's stream starts at 0
            u[j].uniform_(generator=gen)  # [0, 1)
        # u == 0 gives inf (that token cannot win); the clamp guards 0 / 0 should u ever reach 1
        return u.log_().neg_().clamp_min_(torch.finfo(torch.float32).tiny)


def _filter_mask(probs: Tensor, params: list[SamplingParams]) -> Tensor:
    """Tokens that top-k, then top-p, then min-p remove: bool [F, V] for probs [F, V]."""
    f, vocab = probs.shape
    device = probs.device
    # stable: equal probabilities keep token-id order, so ties go to the lower id
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)  # [F, V] each
    top_k = host_values([p.top_k if p.top_k > 0 else vocab for p in params], torch.int64, device)
    drop = torch.arange(vocab, device=device)[None, :] >= top_k[:, None]  # [F, V] in sorted order
    if any(p.top_p < 1.0 for p in params):
        top_p = host_values([p.top_p for p in params], torch.float32, device)
        kept = sorted_p.masked_fill(drop, 0.0)
        cum = kept.cumsum(dim=-1)
        before = torch.cat([cum.new_zeros(f, 1), cum[:, :-1]], dim=-1)  # mass strictly above each token
        # keep a token while the mass above it is short of p (renormalized over what top-k kept);
        # rows with p == 1 are exempt, else float saturation of the cumsum would cut their tail
        drop |= (before >= top_p[:, None] * cum[:, -1:]) & (top_p < 1.0)[:, None]
    if any(p.min_p > 0.0 for p in params):
        min_p = host_values([p.min_p for p in params], torch.float32, device)
        # relative to the top token, so renormalization by earlier masks does not change it
        drop |= sorted_p < min_p[:, None] * sorted_p[:, :1]
    return torch.zeros_like(drop).scatter_(-1, order, drop)  # back to token-id order


def _raw_logprobs(
    logits: Tensor, rows: list[int], params: list[SamplingParams], tokens: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """(sampled [L], top values [L, n_max], top ids [L, n_max]) of log_softmax(raw logits)."""
    idx = host_values(rows, torch.int64, logits.device)
    lp = torch.log_softmax(logits.index_select(0, idx), dim=-1)  # [L, V]
    sampled = lp.gather(-1, tokens.index_select(0, idx)[:, None])[:, 0]  # [L]
    n_max = min(max(params[i].logprobs or 0 for i in rows), lp.shape[-1])
    if n_max == 0:
        empty = lp.new_empty(len(rows), 0)
        return sampled, empty, empty.long()
    top_lp, top_ids = lp.topk(n_max, dim=-1)  # [L, n_max] each
    # canonical order, highest first and ties by token id, whatever order topk returned them in.
    # NOTE: values are exact; only tokens tied exactly at the n-th place may be swapped by topk
    top_ids, perm = top_ids.sort(dim=-1)
    top_lp, perm = top_lp.gather(-1, perm).sort(dim=-1, descending=True, stable=True)
    return sampled, top_lp, top_ids.gather(-1, perm)


def _check_inputs(logits: Tensor, params: list[SamplingParams], seeds: list[int], offsets: list[int]) -> None:
    if logits.dim() != 2 or logits.shape[1] == 0 or not logits.is_floating_point():
        raise ValueError(f"logits must be a float tensor [N, V] with V >= 1, got {tuple(logits.shape)}")
    n = logits.shape[0]
    if not len(params) == len(seeds) == len(offsets) == n:
        raise ValueError(
            f"one params, seed and offset per logits row: {n} rows, {len(params)} params, "
            f"{len(seeds)} seeds, {len(offsets)} offsets"
        )
    if any(o < 0 for o in offsets):
        raise ValueError(f"offsets count tokens already sampled and must be >= 0, got {offsets}")
