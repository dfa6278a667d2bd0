"""StatePages: everything a request's cache holds, as one movable unit.

This is what a prefill worker ships and a decode worker installs; connectors move it and nothing
else, and they never need to know the architecture: a page is a named tensor of one layer.

  SSM layer l:        {"conv": [conv_dim, d_conv-1], "ssm": [nheads, headdim, dstate]}
  attention layer l:  {"k": [num_tokens, num_kv_heads, head_dim], "v": same}

KV is exported contiguous (token-major) so the receiver can lay it into whatever blocks it
reserved; SSM pages are the slot's rows verbatim (same dtype as the pool: bit-exact round trip).

Runs: `export_pages` gathers each pool tensor over all its layers at once, so its pages come as
`PageRun`s -- the same-named tensors of the layers, stacked -- and a connector that sends runs
(the NCCL connector) or an import that copies runs never touches the 128 per-layer tensors of a
2.7B request in Python. `StatePages.layers`, the contract every connector understands, is built
from the runs on first use (views, no copy); from then on the per-layer dict is the truth (it may
be edited) and `runs` is None.
`RequestState` carries the bookkeeping needed to continue: tokens so far, sampling params and
the sampler state (seed + offset = number of sampled tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pd_ssm.cache.pool import CachePool


@dataclass(slots=True)
class RequestState:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    num_computed_tokens: int  # tokens whose state the pages hold
    params: dict[str, Any]  # SamplingParams.to_dict()
    seed: int
    max_tokens: int
    prompt: str | None = None


@dataclass(slots=True)
class LayerPages:
    layer_idx: int
    kind: str  # "ssm" | "attention"
    tensors: dict[str, torch.Tensor]

    def nbytes(self) -> int:
        n = 0  # NOTE: per layer per request when streaming: a loop, ~2x cheaper than sum() of a generator
        for t in self.tensors.values():
            n += t.nbytes
        return n


@dataclass(slots=True)
class PageRun:
    """The same-named tensors of several layers, stacked in layer order (ascending)."""

    kind: str  # "ssm" | "attention"
    name: str
    layers: tuple[int, ...]
    stacked: torch.Tensor  # [len(layers), *one layer's shape]

    def nbytes(self) -> int:
        return self.stacked.numel() * self.stacked.element_size()

    def unit(self) -> int:
        """Bytes of one layer's tensor."""
        return self.stacked[0].numel() * self.stacked.element_size()

    def part(self, start: int, stop: int) -> PageRun:
        """Layers [start, stop) of this run (a view)."""
        if start == 0 and stop == len(self.layers):
            return self
        return PageRun(self.kind, self.name, self.layers[start:stop], self.stacked[start:stop])


class StatePages:
    """A request's state and its pages, per layer (`layers`) or still as runs (`runs`)."""

    __slots__ = ("request", "_layers", "_runs")

    def __init__(
        self, request: RequestState, layers: dict[int, LayerPages] | None = None, runs: list[PageRun] | None = None
    ) -> None:
        if layers is not None and runs is not None:
            raise ValueError("StatePages takes per-layer pages or runs, not both")
        self.request = request
        self._runs = runs
        self._layers = layers if layers is not None else ({} if runs is None else None)

    @property
    def layers(self) -> dict[int, LayerPages]:
        """{layer_idx: LayerPages}, sorted by layer (built from the runs on first use)."""
        if self._layers is None:
            assert self._runs is not None
            self._layers = layers_of(self._runs)
            self._runs = None  # NOTE: the dict may be edited from now on: runs could go stale
        return self._layers

    @layers.setter
    def layers(self, value: dict[int, LayerPages]) -> None:
        self._layers, self._runs = value, None

    @property
    def runs(self) -> list[PageRun] | None:
        """The stacked form, while nobody has asked for (and so could have edited) `layers`."""
        return self._runs

    @property
    def req_id(self) -> str:
        return self.request.req_id

    @property
    def num_tokens(self) -> int:
        return self.request.num_computed_tokens

    def nbytes(self) -> int:
        if self._runs is not None:
            return sum(r.nbytes() for r in self._runs)
        return sum(p.nbytes() for p in self.layers.values())

    def __repr__(self) -> str:
        form = f"{len(self._runs)} runs" if self._runs is not None else f"{len(self.layers)} layers"
        return f"StatePages({self.request.req_id!r}, {form}, {self.nbytes()} B)"


def layers_of(runs: list[PageRun]) -> dict[int, LayerPages]:
    """Per-layer views of `runs`; ValueError if a layer gets a name twice or two page kinds."""
    layers: dict[int, LayerPages] = {}
    for run in runs:
        for layer_idx, tensor in zip(run.layers, run.stacked.unbind(0), strict=True):
            page = layers.get(layer_idx)
            if page is None:
                page = layers[layer_idx] = LayerPages(layer_idx, run.kind, {})
            elif page.kind != run.kind or run.name in page.tensors:
                raise ValueError(f"layer {layer_idx}: tensor {run.name!r} repeated or page kinds disagree")
            page.tensors[run.name] = tensor
    return dict(sorted(layers.items()))


def runs_of(layers: dict[int, LayerPages]) -> list[PageRun]:
    """Per-layer pages stacked into runs: per (kind, name), the layers that have it, ascending (a
    copy; every layer's tensor of one name must have one shape and dtype)."""
    groups: dict[tuple[str, str], list[LayerPages]] = {}
    for layer_idx in sorted(layers):
        page = layers[layer_idx]
        for name in sorted(page.tensors):
            groups.setdefault((page.kind, name), []).append(page)
    return [PageRun(kind, name, tuple(p.layer_idx for p in pages), torch.stack([p.tensors[name] for p in pages]))
            for (kind, name), pages in groups.items()]


def export_layer(pool: CachePool, layer_idx: int, slot: int, block_table: list[int], num_tokens: int) -> LayerPages:
    """Copy one layer's pages of a request out of the pool (a clone: the slot may be reused)."""
    if layer_idx in pool.ssm_index:
        return LayerPages(
            layer_idx,
            "ssm",
            {"conv": pool.conv(layer_idx)[slot].clone(), "ssm": pool.ssm(layer_idx)[slot].clone()},
        )
    if layer_idx in pool.attn_index:
        k_cache, v_cache = pool.kv(layer_idx)
        flat = _token_slots(block_table, num_tokens, pool.block_size, k_cache.device)
        kf = k_cache.flatten(0, 1)  # [num_blocks * block_size, Hkv, D]
        vf = v_cache.flatten(0, 1)
        return LayerPages(layer_idx, "attention", {"k": kf[flat].clone(), "v": vf[flat].clone()})
    raise KeyError(f"layer {layer_idx} holds no cache")


def export_pages(pool: CachePool, request: RequestState, slot: int, block_table: list[int]) -> StatePages:
    """Copy a request's pages out of the pool: ONE gather per pool tensor over all its layers (a
    copy per layer and tensor would be 128 small kernels and their Python for Mamba2-2.7B), as
    runs (layer order is pool order: both ascend)."""
    runs: list[PageRun] = []
    if pool.ssm_index:
        ssm_layers = tuple(sorted(pool.ssm_index))
        runs.append(PageRun("ssm", "conv", ssm_layers, pool.conv_state[:, slot].clone()))
        runs.append(PageRun("ssm", "ssm", ssm_layers, pool.ssm_state[:, slot].clone()))
    if pool.attn_index:
        attn_layers = tuple(sorted(pool.attn_index))
        flat = _token_slots(block_table, request.num_computed_tokens, pool.block_size, pool.k_cache.device)
        # [n_attn, tokens, Hkv, D]: advanced indexing gathers (copies) the request's rows of every layer
        runs.append(PageRun("attention", "k", attn_layers, pool.k_cache.flatten(1, 2)[:, flat]))
        runs.append(PageRun("attention", "v", attn_layers, pool.v_cache.flatten(1, 2)[:, flat]))
    return StatePages(request, runs=runs)


def import_layer(pool: CachePool, page: LayerPages, slot: int, block_table: list[int], num_tokens: int) -> None:
    """Write one layer's pages into a reserved slot / blocks, checking shapes and dtypes first."""
    if page.kind == "ssm":
        conv, ssm = pool.conv(page.layer_idx), pool.ssm(page.layer_idx)
        _check(page, "conv", conv[slot])
        _check(page, "ssm", ssm[slot])
        conv[slot].copy_(page.tensors["conv"])
        ssm[slot].copy_(page.tensors["ssm"])
    elif page.kind == "attention":
        k_cache, v_cache = pool.kv(page.layer_idx)
        expect = torch.empty((num_tokens, *k_cache.shape[2:]), dtype=k_cache.dtype, device="meta")
        _check(page, "k", expect)
        _check(page, "v", expect)
        flat = _token_slots(block_table, num_tokens, pool.block_size, k_cache.device)
        k_cache.flatten(0, 1)[flat] = page.tensors["k"].to(k_cache.device)
        v_cache.flatten(0, 1)[flat] = page.tensors["v"].to(v_cache.device)
    else:
        raise ValueError(f"unknown page kind {page.kind!r} for layer {page.layer_idx}")


def import_pages(pool: CachePool, pages: StatePages, slot: int, block_table: list[int]) -> None:
    """Write a request's pages into a reserved slot / blocks: every tensor's shape and dtype is
    checked first, then one copy per pool tensor over all its layers (as export_pages)."""
    if pages.runs is not None and _import_runs(pool, pages.runs, slot, block_table, pages.num_tokens):
        return
    expected = set(pool.ssm_index) | set(pool.attn_index)
    if set(pages.layers) != expected:
        missing, extra = sorted(expected - set(pages.layers)), sorted(set(pages.layers) - expected)
        raise ValueError(f"pages of {pages.req_id!r} do not fit this model: missing layers {missing}, extra {extra}")
    for page in pages.layers.values():
        if page.kind != ("ssm" if page.layer_idx in pool.ssm_index else "attention"):
            raise ValueError(f"layer {page.layer_idx}: a {page.kind!r} page, but this pool holds the other kind there")
    if pool.ssm_index:
        ssm_layers = sorted(pool.ssm_index)  # pool order (ascending, as export_pages)
        for name, like in (("conv", pool.conv_state[0, slot]), ("ssm", pool.ssm_state[0, slot])):
            for layer_idx in ssm_layers:
                _check(pages.layers[layer_idx], name, like)
        device = pool.conv_state.device
        pool.conv_state[:, slot] = torch.stack([pages.layers[i].tensors["conv"].to(device) for i in ssm_layers])
        pool.ssm_state[:, slot] = torch.stack([pages.layers[i].tensors["ssm"].to(device) for i in ssm_layers])
    for layer_idx in pool.attn_index:  # a few layers in a hybrid: KV rows scatter into blocks
        import_layer(pool, pages.layers[layer_idx], slot, block_table, pages.num_tokens)


def _import_runs(pool: CachePool, runs: list[PageRun], slot: int, block_table: list[int], num_tokens: int) -> bool:
    """The fast path of import_pages for runs shaped exactly as export_pages makes them (one run
    per pool tensor, every layer of it, pool order): checked, then one copy each. False (nothing
    written) for any other shape of runs -- the per-layer path then checks and reports."""
    by_name = {(r.kind, r.name): r for r in runs}
    ssm_layers, attn_layers = tuple(sorted(pool.ssm_index)), tuple(sorted(pool.attn_index))
    want: dict[tuple[str, str], tuple[tuple[int, ...], torch.Tensor]] = {}
    if ssm_layers:
        want[("ssm", "conv")] = (ssm_layers, pool.conv_state[:, slot])
        want[("ssm", "ssm")] = (ssm_layers, pool.ssm_state[:, slot])
    if attn_layers:
        kv_like = torch.empty((len(attn_layers), num_tokens, *pool.k_cache.shape[3:]), dtype=pool.k_cache.dtype,
                              device="meta")
        want[("attention", "k")] = (attn_layers, kv_like)
        want[("attention", "v")] = (attn_layers, kv_like)
    if len(runs) != len(want) or by_name.keys() != want.keys():
        return False
    for key, (layers, like) in want.items():
        run = by_name[key]
        if run.layers != layers or run.stacked.shape != like.shape or run.stacked.dtype != like.dtype:
            return False
    # the block table is checked (raises) before anything is written
    flat = _token_slots(block_table, num_tokens, pool.block_size, pool.k_cache.device) if attn_layers else None
    device = pool.conv_state.device
    if ssm_layers:
        pool.conv_state[:, slot] = by_name[("ssm", "conv")].stacked.to(device)
        pool.ssm_state[:, slot] = by_name[("ssm", "ssm")].stacked.to(device)
    if flat is not None:
        pool.k_cache.flatten(1, 2)[:, flat] = by_name[("attention", "k")].stacked.to(pool.k_cache.device)
        pool.v_cache.flatten(1, 2)[:, flat] = by_name[("attention", "v")].stacked.to(pool.v_cache.device)
    return True


def _token_slots(block_table: list[int], num_tokens: int, block_size: int, device: torch.device) -> torch.Tensor:
    pos = torch.arange(num_tokens, device=device)
    blocks = torch.tensor(block_table, dtype=torch.int64, device=device)
    if num_tokens > len(block_table) * block_size:
        raise ValueError(f"{num_tokens} tokens do not fit in {len(block_table)} blocks of {block_size}")
    return blocks[pos // block_size] * block_size + pos % block_size


def _check(page: LayerPages, name: str, like: torch.Tensor) -> None:
    t = page.tensors.get(name)
    if t is None:
        raise ValueError(f"layer {page.layer_idx} page lacks {name!r}")
    if tuple(t.shape) != tuple(like.shape) or t.dtype != like.dtype:
        raise ValueError(
            f"layer {page.layer_idx} {name!r}: got {tuple(t.shape)} {t.dtype}, "
            f"this pool holds {tuple(like.shape)} {like.dtype}"
        )
