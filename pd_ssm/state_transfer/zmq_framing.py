"""How the ZmqConnector cuts a request's pages into messages and frames, and checksums them.

A slab is a PageRun (cache/pages.py) staged on the host with one contiguous payload: consecutive
layers of one tensor name, what one frame carries -- a "run" frame for several layers, a "page"
frame for one (wire.py). Frames have a fixed cost of ~40 us a side in Python, so a request goes
out in as few as its messages allow:
  - pages as runs (export_pages: one stacked tensor per pool tensor) are sliced at message
    boundaries, views of the runs, no copy: a Mamba2-2.7B request is ~10 frames, not 128;
  - per-layer pages (layer-wise streaming, pages edited after export) of one name, shape and
    dtype are stacked into one slab when each is small (a 32 KB conv page: the copy costs a few
    us, a frame ~80); a large one (an SSM page of 1.3-2.6 MB) goes as a page frame of its own,
    since copying it would cost more than its frame.

A whole request is cut into messages of ramping sizes (`message_sizes`) at layer boundaries, so
checksumming on either side overlaps the wire, and no frame exceeds FRAME_MOST bytes (unless it is
one layer). Each message's payloads are summed by the pool in
about equal shares of bytes (`Sealing`, checksum.sum_shares): a 32 MB run frame keeps every thread
busy, as a dozen page frames did.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from concurrent.futures import Executor, Future

import torch

from pd_ssm.cache.pages import LayerPages, PageRun
from pd_ssm.state_transfer.checksum import WireSums, gather_sums, sum_share, sum_shares
from pd_ssm.state_transfer.wire import Parts, Unsealed, page_frame, run_frame, seal

# bytes: per-layer tensors below this are stacked into one run frame (a copy); larger ones are not
STACK_BELOW = 256 << 10
# bytes: a frame holds at most this much (or one layer): libzmq mallocs each received frame, and one
# above glibc's mmap threshold (32 MiB once the receiver tuned malloc, zmq_connector.py) would be
# mapped fresh and faulted in page by page on every request
FRAME_MOST = 24 << 20
_NEVER = 1 << 62


def slabs_of_runs(runs: Sequence[PageRun]) -> list[PageRun]:
    """One slab per run (in order), staged to pinned host memory if on a GPU."""
    staged = _Staging()
    return staged.done([PageRun(r.kind, r.name, tuple(r.layers), staged.host(r.stacked)) for r in runs])


def slabs_of_layers(layers: Sequence[LayerPages], stack_below: int = STACK_BELOW) -> list[PageRun]:
    """Per-layer pages grouped by (kind, name, dtype, shape), layers ascending, in order of first
    appearance; a group of small tensors (< `stack_below` bytes each) is stacked into one slab, a
    group of large ones gives one slab per layer (a view)."""
    staged = _Staging()
    groups: dict[tuple[str, str, torch.dtype, torch.Size], tuple[list[int], list[torch.Tensor]]] = {}
    for page in sorted(layers, key=lambda p: p.layer_idx):
        for name, t in sorted(page.tensors.items()):
            ids, tensors = groups.setdefault((page.kind, name, t.dtype, t.shape), ([], []))
            ids.append(page.layer_idx)
            tensors.append(staged.host(t))
    slabs: list[PageRun] = []
    for (kind, name, _, _), (ids, tensors) in groups.items():
        if len(ids) > 1 and tensors[0].numel() * tensors[0].element_size() < stack_below:
            slabs.append(PageRun(kind, name, tuple(ids), torch.stack(tensors)))
        else:
            slabs.extend(PageRun(kind, name, (i,), t.unsqueeze(0)) for i, t in zip(ids, tensors, strict=True))
    return staged.done(slabs)


class _Staging:
    """CPU tensors as they are (made contiguous); GPU ones copied into pinned host staging, all
    copies waited for once (`done`) before ZMQ's I/O thread may read them."""

    def __init__(self) -> None:
        self.staged = False

    def host(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cpu":
            return t.contiguous()
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        self.staged = True
        return host

    def done(self, slabs: list[PageRun]) -> list[PageRun]:
        if self.staged:
            torch.cuda.synchronize()
        return slabs


def message_sizes(total: int, edge: int, most: int) -> list[int]:
    """Payload bytes per message of a `total`-byte request: `edge` doubling up to `most` from the
    front, and the mirror image towards the end (e.g. 2, 4, 8, 16, 32, ..., 32, 16, 8, 4, 2 MB), so
    little waits for checksums before the wire starts or after it ends. Sums to `total`."""
    edge = min(edge, most)
    front: list[int] = []
    back: list[int] = []
    size, rest = edge, total
    while rest > 2 * size:
        front.append(size)
        back.append(size)
        rest -= 2 * size
        size = min(2 * size, most)
    middle = [rest] if rest <= most else [rest - rest // 2, rest // 2]
    return front + middle + back[::-1]


def cut(slabs: Sequence[PageRun], sizes: Sequence[int]) -> list[list[PageRun]]:
    """The slabs' layers, in order, cut into groups where their running bytes first reach each
    running total of `sizes`; a slab that spans a cut is split there (views). Layers are not
    split: every group holds at least one, unless there are none."""
    groups: list[list[PageRun]] = [[]]
    cuts = itertools.accumulate(sizes)
    end, done = next(cuts, 0), 0
    for slab in slabs:
        n, unit, start = len(slab.layers), slab.unit(), 0
        while start < n:
            if groups[-1] and done >= end:
                groups.append([])
                while done >= end:  # a layer larger than a message spans its cut and maybe the next
                    end = next(cuts, _NEVER)
            # the layers that fit before the cut, at least one (the old loop added one at a time)
            take = n - start if unit == 0 else min(n - start, max(1, -(-(end - done) // unit)))
            groups[-1].append(slab.part(start, start + take))
            done += take * unit
            start += take
    return groups


def unsealed_frames(req_id: str, slabs: Sequence[PageRun], most: int = FRAME_MOST) -> list[Unsealed]:
    """The slabs as frames of at most `most` bytes or one layer each (a slab larger than that is
    split at layer boundaries): a page frame for one layer, a run frame for more (payloads are
    views)."""
    return [
        page_frame(req_id, s.layers[0], s.kind, s.name, s.stacked[0]) if len(s.layers) == 1
        else run_frame(req_id, s.layers, s.kind, s.name, s.stacked)
        for s in _split(slabs, most)
    ]


def _split(slabs: Sequence[PageRun], most: int) -> list[PageRun]:
    """Each slab in as few parts as keep each at most `most` bytes (or one layer), the same number
    of layers in each but the last."""
    parts: list[PageRun] = []
    for slab in slabs:
        n, unit = len(slab.layers), slab.unit()
        fit = n if unit == 0 else max(1, most // unit)  # layers a part may hold
        count = -(-n // fit)
        per = -(-n // count)  # <= fit: the last part is not left with a single layer when it need not be
        parts.extend(slab.part(start, min(start + per, n)) for start in range(0, n, per))
    return parts


class Sealing:
    """One message's frames while the pool sums their payloads (one task per thread); `seal`
    packs their headers once every sum is in. A message whose frames could not even be built
    carries the reason instead (`error`), and fails its request when its turn comes to leave."""

    def __init__(self, frames: list[Unsealed], pool: Executor | None, threads: int, error: str | None = None) -> None:
        self.frames = frames
        self.error = error
        payloads = [f.payload for f in frames]
        self._shares = sum_shares([p.nbytes for p in payloads], threads) if error is None else []
        self._sums: list[Future[list[WireSums]]] | list[list[WireSums]]
        if pool is None:
            self._sums = [sum_share(payloads, share) for share in self._shares]
        else:
            self._sums = [pool.submit(sum_share, payloads, share) for share in self._shares]

    def pending(self) -> list[Future[list[WireSums]]]:
        return [f for f in self._sums if isinstance(f, Future) and not f.done()]

    def failure(self) -> str | None:
        """Why this message cannot leave, once every sum is in (None: it can)."""
        if self.error is not None:
            return self.error
        for f in self._sums:
            if isinstance(f, Future) and f.exception() is not None:
                return f"its checksums failed: {f.exception()}"
        return None

    def seal(self) -> list[Parts]:
        """The frames, headers packed; only once `pending()` is empty and `failure()` None."""
        results = [f.result() if isinstance(f, Future) else f for f in self._sums]
        sums = gather_sums(len(self.frames), self._shares, results)
        return [seal(frame, s) for frame, s in zip(self.frames, sums, strict=True)]
