"""StatePages: everything a request's cache holds, as one movable unit.

This is what a prefill worker ships and a decode worker installs; connectors move it and nothing
else, and they never need to know the architecture: a page is a named tensor of one layer.

  SSM layer l:        {"conv": [conv_dim, d_conv-1], "ssm": [nheads, headdim, dstate]}
  attention layer l:  {"k": [num_tokens, num_kv_heads, head_dim], "v": same}

KV is exported contiguous (token-major) so the receiver can lay it into whatever blocks it
reserved; SSM pages are the slot's rows verbatim (same dtype as the pool: bit-exact round trip).
`RequestState` carries the bookkeeping needed to continue: tokens so far, sampling params and
the sampler state (seed + offset = number of sampled tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field
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
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@dataclass(slots=True)
class StatePages:
    request: RequestState
    layers: dict[int, LayerPages] = field(default_factory=dict)

    @property
    def req_id(self) -> str:
        return self.request.req_id

    @property
    def num_tokens(self) -> int:
        return self.request.num_computed_tokens

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.layers.values())


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
    copy per layer and tensor would be 128 small kernels and their Python for Mamba2-2.7B); each
    layer's tensors are views of those copies, in layer order (a connector can send them as runs)."""
    pages = StatePages(request)
    layers: dict[int, LayerPages] = {}
    if pool.ssm_index:
        conv = pool.conv_state[:, slot].clone().unbind(0)
        ssm = pool.ssm_state[:, slot].clone().unbind(0)
        for layer_idx, i in pool.ssm_index.items():
            layers[layer_idx] = LayerPages(layer_idx, "ssm", {"conv": conv[i], "ssm": ssm[i]})
    if pool.attn_index:
        flat = _token_slots(block_table, request.num_computed_tokens, pool.block_size, pool.k_cache.device)
        k = pool.k_cache.flatten(1, 2)[:, flat].unbind(0)  # [n_attn, tokens, Hkv, D] gathered, then views
        v = pool.v_cache.flatten(1, 2)[:, flat].unbind(0)
        for layer_idx, i in pool.attn_index.items():
            layers[layer_idx] = LayerPages(layer_idx, "attention", {"k": k[i], "v": v[i]})
    pages.layers = dict(sorted(layers.items()))
    return pages


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
    expected = set(pool.ssm_index) | set(pool.attn_index)
    if set(pages.layers) != expected:
        missing, extra = sorted(expected - set(pages.layers)), sorted(set(pages.layers) - expected)
        raise ValueError(f"pages of {pages.req_id!r} do not fit this model: missing layers {missing}, extra {extra}")
    for page in pages.layers.values():
        if page.kind != ("ssm" if page.layer_idx in pool.ssm_index else "attention"):
            raise ValueError(f"layer {page.layer_idx}: a {page.kind!r} page, but this pool holds the other kind there")
    if pool.ssm_index:
        ssm_layers = sorted(pool.ssm_index, key=pool.ssm_index.__getitem__)  # pool order
        for name, like in (("conv", pool.conv_state[0, slot]), ("ssm", pool.ssm_state[0, slot])):
            for layer_idx in ssm_layers:
                _check(pages.layers[layer_idx], name, like)
        device = pool.conv_state.device
        pool.conv_state[:, slot] = torch.stack([pages.layers[i].tensors["conv"].to(device) for i in ssm_layers])
        pool.ssm_state[:, slot] = torch.stack([pages.layers[i].tensors["ssm"].to(device) for i in ssm_layers])
    for layer_idx in pool.attn_index:  # a few layers in a hybrid: KV rows scatter into blocks
        import_layer(pool, pages.layers[layer_idx], slot, block_table, pages.num_tokens)


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
