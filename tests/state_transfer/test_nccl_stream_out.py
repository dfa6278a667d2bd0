"""StreamOut (nccl_stream_out.py): which held layers make a part, what the final send takes, and
broken streams -- bookkeeping only, on tiny random pages."""

from __future__ import annotations

import torch

from pd_ssm.cache.pages import LayerPages
from pd_ssm.state_transfer.nccl_stream_out import Finished, StreamOut


def _layer(i: int) -> LayerPages:
    return LayerPages(i, "ssm", {"conv": torch.randn(4, 3), "ssm": torch.randn(2, 8) + 1.0})  # 112 bytes


def test_layers_become_a_part_at_stream_bytes_and_the_rest_goes_last() -> None:
    out = StreamOut()
    assert out.add("r", [_layer(0)], 200) is None  # 112 < 200
    part = out.add("r", [_layer(1)], 200)
    assert part is not None and part.ready is None
    assert sorted(part.pages.layers) == [0, 1] and part.pages.req_id == "r" and part.pages.nbytes() == 224
    assert out.add("r", [_layer(2)], 200) is None and out.with_parts() == ["r"]
    last = out.finish("r")
    assert last is not None and [p.layer_idx for p in last.layers] == [2] and last.parts == 1
    assert out.finish("never-streamed") == Finished([], 0) and out.with_parts() == []


def test_a_broken_stream_drops_its_final_send_once() -> None:
    out = StreamOut()
    out.add("r", [_layer(0)], 1)
    out.break_("r")
    assert out.is_broken("r") and out.with_parts() == []
    assert out.finish("r") is None  # dropped: its failure was reported when it broke
    assert not out.is_broken("r") and out.finish("r") == Finished([], 0)  # the id may be used again


def test_abort_breaks_only_a_stream_in_progress() -> None:
    out = StreamOut()
    out.abort("whole")  # never streamed: its (whole) send is the connector's to drop
    assert not out.is_broken("whole")
    out.add("s", [_layer(0)], 1 << 20)
    out.abort("s")
    assert out.is_broken("s") and out.finish("s") is None


def test_a_part_and_the_final_send_carry_the_latest_ready_event_of_their_layers() -> None:
    """Device pages come with the event they are complete after, recorded in order on one stream:
    the latest one of a part's layers covers them all, and a part resets it."""
    out = StreamOut()
    first, second, third = object(), object(), object()  # stand-ins: StreamOut only passes them on
    assert out.add("r", [_layer(0)], 200, ready=first) is None
    part = out.add("r", [_layer(1)], 200, ready=second)
    assert part is not None and part.ready is second
    assert out.add("r", [_layer(2)], 200) is None  # host pages after device ones: nothing to wait for
    last = out.finish("r")
    assert last is not None and last.ready is None and last.parts == 1
    out.add("s", [_layer(0)], 1 << 20, ready=third)
    last = out.finish("s")
    assert last is not None and last.ready is third and [p.layer_idx for p in last.layers] == [0]


def test_flush_makes_a_part_of_what_is_held_below_stream_bytes() -> None:
    """A request's last layers (`flush`) leave as a part at once: its final send then has none."""
    out = StreamOut()
    assert out.add("r", [_layer(0)], 1 << 20) is None
    part = out.add("r", [_layer(1)], 1 << 20, flush=True)
    assert part is not None and sorted(part.pages.layers) == [0, 1]
    assert out.add("r", [], 1 << 20, flush=True) is None  # nothing held: no empty part
    last = out.finish("r")
    assert last is not None and last.layers == [] and last.parts == 1
