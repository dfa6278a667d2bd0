"""The NCCL connector's side-channel control part: what a ZMQ message is, and for data, which
requests its p2p message carries and how many bytes each takes in it.

  hello  [token, control{kind="hello", gen, req_ids=[], sizes=[], ops=[]}]: a sender joins generation `gen`
  data   [token, control{kind="data", gen, req_ids, sizes, ops}, then per request: request
          header, request payload, runs]: the message's buffer -- sum(sizes) bytes, the requests'
          parts back to back in the order of `req_ids` (coalesced: see nccl_batch.py), then the
          sums trailer -- follows on the p2p stream in the ops `spans` names: `ops[j]` requests
          in the j-th
  abort  [token, control{kind="abort", gen, req_ids=[req_id], sizes=[0], ops=[]}]: the sender gave it up

The request ids are here, not only in the request frames, so a request whose frame is mangled
still fails by name (its reservation released) and a message of a dead generation fails all of
its requests without parsing anything else.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import msgpack

from pd_ssm.state_transfer.nccl_checksum import BLOCK, trailer_bytes
from pd_ssm.state_transfer.wire import MAX_HEADER_BYTES, FrameError
from pd_ssm.state_transfer.wire_fields import unpack

CONTROL_KINDS = ("hello", "data", "abort")
MAX_BATCH = 1024  # requests in one data message (the sender coalesces far fewer: nccl_batch.py)
PARTS_PER_REQUEST = 3  # request header, request payload, runs
_CONTROL_KEYS = frozenset({"kind", "gen", "req_ids", "sizes", "ops"})


@dataclass(frozen=True, slots=True)
class Control:
    kind: str  # "hello" | "data" | "abort"
    gen: int  # the pairing generation the p2p bytes travel on (nccl_group.py)
    req_ids: tuple[str, ...]  # data: the message's requests, in buffer order; abort: the one; hello: none
    sizes: tuple[int, ...]  # data: each request's bytes in the p2p message (BLOCK multiples); else 0s
    ops: tuple[int, ...]  # data: how many consecutive requests each p2p op carries (`spans`); else none

    @staticmethod
    def hello(gen: int) -> Control:
        return Control("hello", gen, (), (), ())

    @staticmethod
    def abort(gen: int, req_id: str) -> Control:
        return Control("abort", gen, (req_id,), (0,), ())

    @staticmethod
    def data(gen: int, req_ids: list[str], sizes: list[int], ops: list[int] | None = None) -> Control:
        """`ops` None: one request per op."""
        return Control("data", gen, tuple(req_ids), tuple(sizes), tuple([1] * len(req_ids) if ops is None else ops))

    @property
    def nbytes(self) -> int:
        """Size of the p2p message that follows a "data" control."""
        return sum(self.sizes)

    @property
    def req_id(self) -> str:
        """The one request of an abort (or of a single-request data message); "" for a hello."""
        return self.req_ids[0] if self.req_ids else ""

    @property
    def spans(self) -> list[tuple[int, int]]:
        """The p2p ops a data message's buffer travels in (`spans`)."""
        return spans(self.sizes, self.ops)

    def encode(self) -> bytes:
        return msgpack.packb(
            {"kind": self.kind, "gen": self.gen, "req_ids": list(self.req_ids), "sizes": list(self.sizes),
             "ops": list(self.ops)},
            use_bin_type=True,
        )


def spans(sizes: tuple[int, ...] | list[int], ops: tuple[int, ...] | list[int] | None = None) -> list[tuple[int, int]]:
    """[start, end) of each p2p op of a data message whose requests take `sizes` bytes, the j-th
    op carrying the next `ops[j]` requests (None: one each): ops without bytes are left out, and
    the last one with bytes carries the sums trailer too.

    Why several ops a message and not one: the sender lays request i + 1 out and sums it while
    request i is on the link, and the receiver sums request i while i + 1 arrives, so only the
    first op's layout and the last one's sums stay serial with the link (nccl_layout.py,
    nccl_checksum.StreamedSums). Why not always one per request: each op costs both hosts a post
    (NCCL ~tens of us, gloo ~0.2 ms) and the link a few us, which small requests do not repay
    (the sender's `NcclConfig.op_bytes` groups them). The trailer rides with the last op (a lone
    request is one op, as before). Both sides take the ops from the control part alone, so the
    receiver posts exactly the ops the sender posts -- stream sync -- whatever the rest of the
    message says."""
    counts = [1] * len(sizes) if ops is None else list(ops)
    ends = list(accumulate(sizes))
    out: list[tuple[int, int]] = []
    start = first = 0
    for k in counts:
        first += k
        end = ends[first - 1]
        if end > start:
            out.append((start, end))
        start = end
    if out:
        total = ends[-1]
        out[-1] = (out[-1][0], total + trailer_bytes(total))
    return out


def parse_control(raw: bytes) -> Control:
    """The control part, checked: keys, types, one size per request id, sizes whole blocks, and the
    number of requests each kind has (data 1..MAX_BATCH, abort 1, hello 0)."""
    c = unpack(raw, MAX_HEADER_BYTES, "control part")
    if not isinstance(c, dict) or set(c) != _CONTROL_KEYS:
        raise FrameError(f"control part must have exactly the keys {sorted(_CONTROL_KEYS)}: {c!r:.120}")
    kind, gen, req_ids, sizes, ops = c["kind"], c["gen"], c["req_ids"], c["sizes"], c["ops"]
    if kind not in CONTROL_KINDS or type(gen) is not int or gen < 1:
        raise FrameError(f"control part: bad kind, or gen not an int >= 1: {c!r:.120}")
    if (
        type(req_ids) is not list
        or type(sizes) is not list
        or len(req_ids) != len(sizes)
        or any(type(r) is not str for r in req_ids)
        or any(type(n) is not int or n < 0 or n % BLOCK for n in sizes)
    ):
        raise FrameError(
            f"control part: req_ids must be strings, one size each, sizes non-negative multiples of {BLOCK}: {c!r:.120}"
        )
    count = len(req_ids)
    wrong = {"data": not 1 <= count <= MAX_BATCH, "abort": count != 1 or any(sizes), "hello": count != 0}
    if wrong[kind]:
        raise FrameError(f"control part: a {kind} message cannot name {count} request(s) of sizes {sizes!r:.60}")
    # NOTE: the ops decide how the receiver cuts the p2p stream: checked as strictly as the sizes
    if type(ops) is not list or any(type(k) is not int or k < 1 for k in ops) or sum(ops) != (count if kind == "data" else 0):
        raise FrameError(f"control part: ops must be positive request counts adding up to the data requests: {c!r:.120}")
    return Control(kind, gen, tuple(req_ids), tuple(sizes), tuple(ops))
