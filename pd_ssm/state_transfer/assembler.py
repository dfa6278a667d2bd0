"""PageAssembler: one request's frames, in any order with the end frame last, back into StatePages.

Layer-wise streaming sends pages as layers finish, so frames of a request arrive in any order;
the assembler checks that the request frame and every (layer, tensor) arrived exactly once -- a
run frame carries one tensor name for several layers, so a layer it names must not have come
before in any page or run frame -- and that the sender's frame count matches, before it hands
out the StatePages.

The StatePages come as runs (`StatePages(runs=...)`): each run frame's tensor as it arrived (a
view of the received buffer), each page frame as a run of one layer, so no per-layer Python runs
for a request that came in a few run frames; `StatePages.layers` gives per-layer views on demand.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pd_ssm.cache.pages import PageRun, RequestState, StatePages
from pd_ssm.state_transfer.wire import Buffer, Frame, FrameError, decode_frame


class PageAssembler:
    """Collects one request's frames (any order, end last) and checks each arrived exactly once."""

    def __init__(self, req_id: str | None = None, expected_layers: Iterable[int] | None = None) -> None:
        self.req_id = req_id
        self.expected_layers = None if expected_layers is None else set(expected_layers)
        self.request: RequestState | None = None
        self.runs: list[PageRun] = []
        self._by_name: dict[str, set[int]] = {}  # tensor name -> layers that brought it
        self._by_kind: dict[str, set[int]] = {}  # page kind -> layers of that kind
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
        assert frame.page_kind is not None and frame.name is not None and frame.tensor is not None
        layers: tuple[int, ...]
        if frame.kind == "page":
            assert frame.layer_idx is not None
            layers, stacked = (frame.layer_idx,), frame.tensor.unsqueeze(0)
        else:
            assert frame.layers is not None
            layers, stacked = frame.layers, frame.tensor
        self._claim(frame.page_kind, frame.name, layers)
        self.runs.append(PageRun(frame.page_kind, frame.name, layers, stacked))
        return False

    def _claim(self, page_kind: str, name: str, layers: Sequence[int]) -> None:
        """Record that `layers` brought tensor `name`; FrameError if one of them had it already or
        was of another page kind. Set operations: no Python loop over a run's layers."""
        named = self._by_name.setdefault(name, set())
        repeated = named.intersection(layers)
        if repeated:
            raise FrameError(f"duplicate frame: layers {sorted(repeated)} {name!r} of {self.req_id!r}")
        for kind, of_kind in self._by_kind.items():
            clash = of_kind.intersection(layers) if kind != page_kind else None
            if clash:
                raise FrameError(f"layers {sorted(clash)} of {self.req_id!r} sent as both {kind} and {page_kind}")
        named.update(layers)
        self._by_kind.setdefault(page_kind, set()).update(layers)

    def arrived_layers(self) -> list[int]:
        """Layers of which at least one tensor has arrived, ascending."""
        return sorted(set().union(*self._by_kind.values()))

    def _finish(self, num_frames: int) -> None:
        if self.request is None:
            raise FrameError(f"end frame of {self.req_id!r} arrived before its request frame")
        if num_frames != self.num_frames:
            raise FrameError(
                f"{self.req_id!r}: sender sent {num_frames} frames before end, {self.num_frames} arrived "
                f"(layers received: {self.arrived_layers()})"
            )
        arrived = set(self.arrived_layers())
        if self.expected_layers is not None and arrived != self.expected_layers:
            missing = sorted(self.expected_layers - arrived)
            extra = sorted(arrived - self.expected_layers)
            raise FrameError(f"{self.req_id!r}: missing layers {missing}, unexpected layers {extra}")
        self.done = True

    def result(self) -> StatePages:
        if not self.done or self.request is None:
            raise FrameError(f"{self.req_id!r} is incomplete: no end frame yet")
        # layer order, so that per-layer views list each layer's tensors as a page frame did
        return StatePages(self.request, runs=sorted(self.runs, key=lambda r: (r.layers[0], r.name)))


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
