"""StreamedParts: the NCCL receiver's bookkeeping of requests streamed layer by layer -- the runs of
their parts, checked and held until the request's last entry completes them.

Pure bookkeeping over the runs (views of the received buffers, which they keep alive); no
device work. Every (tensor name, layer) must come exactly once over a request's parts and its last
entry, a layer of one page kind only, and the last entry must count the parts that came
(the side channel and the p2p stream are FIFO, so a part never arrives after its last entry;
one missing means it failed or was dropped, and so does the request).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from pd_ssm.cache.pages import PageRun
from pd_ssm.state_transfer.wire import FrameError


@dataclass(slots=True)
class _Held:
    runs: list[PageRun] = field(default_factory=list)
    parts: int = 0
    by_name: dict[str, set[int]] = field(default_factory=dict)  # tensor name -> layers that brought it
    by_kind: dict[str, set[int]] = field(default_factory=dict)  # page kind -> its layers
    nbytes: int = 0  # the parts' bytes in their messages
    start: float = 0.0  # when its first part was read (time.monotonic())


class Streamed(NamedTuple):
    runs: list[PageRun]  # every run of the request, in layer order
    nbytes: int  # the bytes of its parts before the last entry
    start: float | None  # when its first part was read; None: it had none


class StreamedParts:
    def __init__(self) -> None:
        self._held: dict[str, _Held] = {}

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._held

    def req_ids(self) -> list[str]:
        return list(self._held)

    def add(self, req_id: str, runs: list[PageRun], nbytes: int = 0, start: float = 0.0) -> None:
        """One part's runs of `req_id` (`nbytes` of its message, read at `start`); FrameError
        (nothing kept of this part) if a layer came before or under another page kind."""
        held = self._held.get(req_id)
        if held is None:
            held = self._held[req_id] = _Held(start=start)
        _claim(held, req_id, runs)
        held.runs += runs
        held.parts += 1
        held.nbytes += nbytes

    def finish(self, req_id: str, parts: int, runs: list[PageRun]) -> Streamed:
        """The request's last entry: its `runs` and the `parts` it says went before -> every run
        of the request, in layer order (and what its parts weighed). FrameError if the count or a
        layer disagrees; the request is forgotten either way."""
        held = self._held.pop(req_id, None)
        if held is None:
            if parts:
                raise FrameError(f"{req_id!r}: its last entry counts {parts} part(s) before it, none arrived")
            return Streamed(runs, 0, None)
        if held.parts != parts:
            raise FrameError(f"{req_id!r}: its last entry counts {parts} part(s) before it, {held.parts} arrived")
        _claim(held, req_id, runs)
        return Streamed(sorted(held.runs + runs, key=lambda r: (r.layers[0], r.name)), held.nbytes, held.start)

    def drop(self, req_id: str) -> bool:
        """Forget `req_id`'s parts (failed, aborted, expired); whether any were held."""
        return self._held.pop(req_id, None) is not None


def _claim(held: _Held, req_id: str, runs: list[PageRun]) -> None:
    """Record the runs' (name, layers) in `held`, all or nothing; FrameError on a repeat or a kind clash."""
    for r in runs:
        named = held.by_name.get(r.name, set())
        repeated = named.intersection(r.layers)
        if repeated:
            raise FrameError(f"{req_id!r}: layers {sorted(repeated)} of {r.name!r} arrived twice")
        for kind, of_kind in held.by_kind.items():
            if kind != r.kind and of_kind.intersection(r.layers):
                raise FrameError(f"{req_id!r}: layers {sorted(of_kind.intersection(r.layers))} came as {kind} and {r.kind}")
    for r in runs:
        held.by_name.setdefault(r.name, set()).update(r.layers)
        held.by_kind.setdefault(r.kind, set()).update(r.layers)
