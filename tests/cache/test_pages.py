"""export_pages / import_pages: one gather per pool tensor out, one copy per pool tensor in, every
tensor checked before anything is written."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pd_ssm.cache.pages import RequestState, export_pages, import_pages
from pd_ssm.cache.pool import CachePool
from pd_ssm.config import CacheConfig, ModelConfig


def _pool(path: str, seed: int) -> CachePool:
    mc = ModelConfig.from_pretrained(path)
    pool = CachePool(mc, CacheConfig(num_state_slots=3, num_kv_blocks=6, block_size=4), "cpu", torch.float32)
    g = torch.Generator().manual_seed(seed)
    for t in (pool.conv_state, pool.ssm_state, pool.k_cache, pool.v_cache):
        t.copy_(torch.randn(t.shape, generator=g) + 2.0)
    return pool


def _request(tokens: int) -> RequestState:
    return RequestState("r", list(range(3, 3 + tokens)), [9], tokens, {"temperature": 0.0}, 7, 8)


@pytest.mark.parametrize("name", ["mamba2-g1", "bamba-attn-first"])
def test_round_trip_into_another_slot_is_exact(name: str, hf_checkpoint: Any) -> None:
    path = hf_checkpoint(name)[0]
    src, dst = _pool(path, 1), _pool(path, 2)
    pages = export_pages(src, _request(7), slot=1, block_table=[4, 0])
    assert list(pages.layers) == sorted(pages.layers)
    ssm = [p.tensors["ssm"] for p in pages.layers.values() if p.kind == "ssm"]
    assert len({t.untyped_storage().data_ptr() for t in ssm}) == 1  # views of one gathered copy
    src.ssm_state.zero_()  # a clone: the slot may be reused at once
    untouched = dst.ssm_state[:, 0].clone()
    import_pages(dst, pages, slot=2, block_table=[1, 5])
    assert torch.equal(dst.ssm_state[:, 0], untouched)
    again = export_pages(dst, _request(7), slot=2, block_table=[1, 5])
    for i, page in pages.layers.items():
        for k, t in page.tensors.items():
            assert torch.equal(t, again.layers[i].tensors[k]), (i, k)


def test_a_wrong_tensor_is_refused_before_any_write(hf_checkpoint: Any) -> None:
    path = hf_checkpoint("bamba-attn-first")[0]
    src, dst = _pool(path, 3), _pool(path, 4)
    pages = export_pages(src, _request(5), slot=0, block_table=[2, 3])
    last_ssm = max(i for i, p in pages.layers.items() if p.kind == "ssm")
    pages.layers[last_ssm].tensors["ssm"] = pages.layers[last_ssm].tensors["ssm"].to(torch.bfloat16)
    before = dst.ssm_state.clone(), dst.conv_state.clone()
    with pytest.raises(ValueError, match=f"layer {last_ssm} 'ssm'"):
        import_pages(dst, pages, slot=1, block_table=[0, 1])
    assert torch.equal(dst.ssm_state, before[0]) and torch.equal(dst.conv_state, before[1])
