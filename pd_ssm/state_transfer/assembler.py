"""PageAssembler: one request's frames, in any order with the end frame last, back into StatePages.

Layer-wise streaming sends pages as layers finish, so frames of a request arrive in any order;
the assembler checks that the request frame and every (layer, tensor) arrived exactly once and
that the sender's frame count matches, before it hands out the StatePages.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pd_ssm.cache.pages import LayerPages, RequestState, StatePages
from pd_ssm.state_transfer.wire import Buffer, Frame, FrameError, decode_frame


class PageAssembler:
    """Collects one request's frames (any order, end last) and checks each arrived exactly once."""

    def __init__(self, req_id: str | None = None, expected_layers: Iterable[int] | None = None) -> None:
        self.req_id = req_id
        self.expected_layers = None if expected_layers is None else set(expected_layers)
        self.request: RequestState | None = None
        self.layers: dict[int, LayerPages] = {}
        self.num_frames = 0  # frames before "end"
        self.done = False

    def add(self, frame: Frame) -> bool:
        """Take one frame; True once the end frame has arrived and everything checked out."""
        if self.req_id is None:
            self.req_id = frame.req_id
        if frame.req_id != self.req_id:
            raise FrameError(f"frame of {frame.req_id!r} given to the assembler of {self.req_id!r}")
        if self.done:
            raise FrameError(f"{frame.kind} frame of {self.req_id!r} arrived after its end frame")
        if frame.kind == "abort":
            assert frame.body is not None
            raise FrameError(f"{self.req_id!r} was aborted by its sender: {frame.body['reason']}")
        if frame.kind == "end":
            assert frame.body is not None
            self._finish(frame.body["num_frames"])
            return True
        self.num_frames += 1
        if frame.kind == "request":
            if self.request is not None:
                raise FrameError(f"duplicate request frame for {self.req_id!r}")
            assert frame.body is not None
            self.request = RequestState(**frame.body)
            return False
        assert frame.layer_idx is not None and frame.page_kind is not None and frame.name is not None
        assert frame.tensor is not None
        page = self.layers.setdefault(frame.layer_idx, LayerPages(frame.layer_idx, frame.page_kind, {}))
        if page.kind != frame.page_kind:
            raise FrameError(f"layer {frame.layer_idx} of {self.req_id!r} sent as both {page.kind} and {frame.page_kind}")
        if frame.name in page.tensors:
            raise FrameError(f"duplicate frame: layer {frame.layer_idx} {frame.name!r} of {self.req_id!r}")
        page.tensors[frame.name] = frame.tensor
        return False

    def _finish(self, num_frames: int) -> None:
        if self.request is None:
            raise FrameError(f"end frame of {self.req_id!r} arrived before its request frame")
        if num_frames != self.num_frames:
            raise FrameError(
                f"{self.req_id!r}: sender sent {num_frames} frames before end, {self.num_frames} arrived "
                f"(layers received: {sorted(self.layers)})"
            )
        if self.expected_layers is not None and set(self.layers) != self.expected_layers:
            missing = sorted(self.expected_layers - set(self.layers))
            extra = sorted(set(self.layers) - self.expected_layers)
            raise FrameError(f"{self.req_id!r}: missing layers {missing}, unexpected layers {extra}")
        self.done = True

    def result(self) -> StatePages:
        if not self.done or self.request is None:
            raise FrameError(f"{self.req_id!r} is incomplete: no end frame yet")
        return StatePages(self.request, dict(sorted(self.layers.items())))


def frames_to_pages(frames: Iterable[Sequence[Buffer] | Frame], expected_layers: Iterable[int] | None = None) -> StatePages:
    """Decode and assemble one request's frames (as made by `pages_to_frames`, or decoded `Frame`s)."""
    asm = PageAssembler(expected_layers=expected_layers)
    for parts in frames:
        if isinstance(parts, Frame):
            frame = parts
        elif len(parts) == 2:
            frame = decode_frame(parts[0], parts[1])
        else:
            raise FrameError(f"a frame has 2 parts (header, payload), got {len(parts)}")
        asm.add(frame)
    return asm.result()
