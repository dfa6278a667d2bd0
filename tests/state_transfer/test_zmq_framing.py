"""zmq_framing.py: slabs (one frame each) from runs and from per-layer pages, message sizes, and
the cuts of a request's slabs into messages at layer boundaries."""

from __future__ import annotations

from typing import Any

import torch

from pd_ssm.cache.pages import LayerPages, PageRun
from pd_ssm.state_transfer.wire import Unsealed
from pd_ssm.state_transfer.zmq_framing import (
    cut,
    message_sizes,
    slabs_of_layers,
    slabs_of_runs,
    unsealed_frames,
)


def test_message_sizes_ramp_up_and_down_and_cover_the_request() -> None:
    """The first and last messages are small (checksummed before / after the wire), the middle
    ones at most `most`; the sizes add up to the request."""
    mb = 1 << 20
    sizes = message_sizes(86 * mb, 2 * mb, 32 * mb)
    assert sum(sizes) == 86 * mb and sizes[0] == sizes[-1] == 2 * mb and max(sizes) <= 32 * mb
    assert sizes[:4] == [2 * mb, 4 * mb, 8 * mb, 16 * mb] and sizes[-4:] == [16 * mb, 8 * mb, 4 * mb, 2 * mb]
    assert message_sizes(3 * mb, 2 * mb, 32 * mb) == [3 * mb]  # too small to split
    assert message_sizes(5, 4, 1) == [1] * 5  # edge is capped by most
    assert message_sizes(0, 4, 8) == [0]


def slab(name: str, layers: list[int], unit: int) -> PageRun:
    return PageRun("ssm", name, tuple(layers), torch.arange(len(layers) * unit, dtype=torch.uint8).view(len(layers), unit))


def shape_of(groups: list[list[PageRun]]) -> list[list[tuple[str, tuple[int, ...]]]]:
    return [[(s.name, s.layers) for s in g] for g in groups]


def test_cut_splits_slabs_at_layer_boundaries() -> None:
    # a: 6 layers of 1 byte, b: 3 layers of 3 bytes; cuts at running totals 2, 6, 12, 14
    slabs = [slab("a", [0, 1, 2, 3, 4, 5], 1), slab("b", [0, 1, 2], 3)]
    groups = cut(slabs, [2, 4, 6, 2])
    assert shape_of(groups) == [
        [("a", (0, 1))],
        [("a", (2, 3, 4, 5))],
        [("b", (0, 1))],
        [("b", (2,))],
    ]
    # the parts are views of the slabs' bytes, in order
    flat = torch.cat([s.stacked.reshape(-1) for g in groups for s in g])
    assert torch.equal(flat, torch.cat([s.stacked.reshape(-1) for s in slabs]))
    assert groups[1][0].stacked.data_ptr() == slabs[0].stacked[2].data_ptr()
    # one message per layer, a layer larger than a message spans its cut, no messages: one group
    assert shape_of(cut(slabs, [1] * 15)) == [[("a", (i,))] for i in range(6)] + [[("b", (i,))] for i in range(3)]
    assert shape_of(cut([slab("c", [0, 1], 5)], [1, 1, 1, 1, 1, 1])) == [[("c", (0,))], [("c", (1,))]]
    assert cut([], [0]) == [[]]
    assert shape_of(cut(slabs, [100])) == [[("a", (0, 1, 2, 3, 4, 5)), ("b", (0, 1, 2))]]


def test_slabs_of_runs_are_views_and_layers_of_small_pages_are_stacked() -> None:
    conv = torch.randn(4, 48, 3)
    runs = [PageRun("ssm", "conv", (0, 1, 2, 4), conv)]
    (s,) = slabs_of_runs(runs)
    assert s.layers == (0, 1, 2, 4) and s.stacked.data_ptr() == conv.data_ptr()  # no copy

    big = 300 << 10  # bytes: above STACK_BELOW, each layer goes alone (a copy would cost more)
    layers = [
        LayerPages(i, "ssm", {"conv": torch.full((48, 3), float(i)), "ssm": torch.full((big // 4,), float(i))})
        for i in (3, 0, 1)
    ] + [LayerPages(2, "attention", {"k": torch.ones(5, 2), "v": torch.ones(5, 2)})]
    slabs = slabs_of_layers(layers)
    assert [(s.name, s.layers) for s in slabs] == [
        ("conv", (0, 1, 3)), ("ssm", (0,)), ("ssm", (1,)), ("ssm", (3,)), ("k", (2,)), ("v", (2,))
    ]
    assert torch.equal(slabs[0].stacked[:, 0, 0], torch.tensor([0.0, 1.0, 3.0]))
    assert slabs[1].stacked.data_ptr() == layers[1].tensors["ssm"].data_ptr()  # a view of layer 0's page
    kinds = [f.header["kind"] for f in unsealed_frames("r", slabs)]
    assert kinds == ["run", "page", "page", "page", "page", "page"]


def test_frames_split_large_slabs_at_layer_boundaries() -> None:
    """No frame is larger than `most` unless it is one layer; as few parts as that allows, in order."""

    def kinds(frames: list[Unsealed]) -> list[tuple[str, Any]]:
        return [(f.header["kind"], f.header.get("layers", f.header.get("layer"))) for f in frames]

    big = slab("ssm", list(range(10)), 100)  # 1000 bytes
    assert kinds(unsealed_frames("r", [big], most=1000)) == [("run", list(range(10)))]
    assert kinds(unsealed_frames("r", [big], most=450)) == [
        ("run", [0, 1, 2, 3]), ("run", [4, 5, 6, 7]), ("run", [8, 9])
    ]
    assert kinds(unsealed_frames("r", [big], most=50)) == [("page", i) for i in range(10)]  # a layer > most
    frames = unsealed_frames("r", [big], most=450)
    assert b"".join(bytes(f.payload) for f in frames) == big.stacked.numpy().tobytes()
