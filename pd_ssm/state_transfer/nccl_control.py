"""The NCCL connector's side-channel control part: what a ZMQ message is, and for data, which
requests its p2p message carries and how many bytes each takes in it.

  hello  [token, control{kind="hello", gen, req_ids=[], sizes=[], parts=[]}]: a sender joins
          generation `gen`
  data   [token, control{kind="data", gen, req_ids, sizes, parts}, then per entry: request
          header, request payload, runs]: ONE p2p message of sum(sizes) bytes follows on the
          stream, the entries' bytes back to back in the order of `req_ids` (coalesced: see
          nccl_batch.py). An entry is a request's last part (its request frame, and `parts[i]`:
          how many parts of it went before, 0 for a request sent whole) or, with an empty request
          header and payload (`parts[i]` 0), a PART: some of its layers streamed ahead while its
          prefill runs (its first token is not sampled yet), which the receiver checks and holds
          until the last part comes
  abort  [token, control{kind="abort", gen, req_ids=[req_id], sizes=[0], parts=[0]}]: the sender
          gave it up

The request ids are here, not only in the request frames, so a request whose frame is mangled
still fails by name (its reservation released) and a message of a dead generation fails all of
its requests without parsing anything else.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack

from pd_ssm.state_transfer.nccl_checksum import BLOCK
from pd_ssm.state_transfer.wire import MAX_HEADER_BYTES, FrameError
from pd_ssm.state_transfer.wire_fields import unpack

CONTROL_KINDS = ("hello", "data", "abort")
MAX_BATCH = 1024  # requests in one data message (the sender coalesces far fewer: nccl_batch.py)
PARTS_PER_REQUEST = 3  # request header, request payload, runs
MAX_PARTS = 1 << 16  # parts of one request streamed ahead of its last
_CONTROL_KEYS = frozenset({"kind", "gen", "req_ids", "sizes", "parts"})


@dataclass(frozen=True, slots=True)
class Control:
    kind: str  # "hello" | "data" | "abort"
    gen: int  # the pairing generation the p2p bytes travel on (nccl_group.py)
    req_ids: tuple[str, ...]  # data: the message's requests, in buffer order; abort: the one; hello: none
    sizes: tuple[int, ...]  # data: each entry's bytes in the p2p message (BLOCK multiples); else 0s
    parts: tuple[int, ...] = ()  # data: per entry, the parts of its request sent before it; else 0s

    @staticmethod
    def hello(gen: int) -> Control:
        return Control("hello", gen, (), (), ())

    @staticmethod
    def abort(gen: int, req_id: str) -> Control:
        return Control("abort", gen, (req_id,), (0,), (0,))

    @staticmethod
    def data(gen: int, req_ids: list[str], sizes: list[int], parts: list[int] | None = None) -> Control:
        return Control("data", gen, tuple(req_ids), tuple(sizes), tuple(parts or [0] * len(req_ids)))

    @property
    def nbytes(self) -> int:
        """Size of the p2p message that follows a "data" control."""
        return sum(self.sizes)

    @property
    def req_id(self) -> str:
        """The one request of an abort (or of a single-request data message); "" for a hello."""
        return self.req_ids[0] if self.req_ids else ""

    def encode(self) -> bytes:
        return msgpack.packb(
            {"kind": self.kind, "gen": self.gen, "req_ids": list(self.req_ids), "sizes": list(self.sizes),
             "parts": list(self.parts)},
            use_bin_type=True,
        )


def parse_control(raw: bytes) -> Control:
    """The control part, checked: keys, types, one size and one part count per request id, sizes
    whole blocks, and the number of requests each kind has (data 1..MAX_BATCH, abort 1, hello 0);
    only a data message counts parts."""
    c = unpack(raw, MAX_HEADER_BYTES, "control part")
    if not isinstance(c, dict) or set(c) != _CONTROL_KEYS:
        raise FrameError(f"control part must have exactly the keys {sorted(_CONTROL_KEYS)}: {c!r:.120}")
    kind, gen, req_ids, sizes, parts = c["kind"], c["gen"], c["req_ids"], c["sizes"], c["parts"]
    if kind not in CONTROL_KINDS or type(gen) is not int or gen < 1:
        raise FrameError(f"control part: bad kind, or gen not an int >= 1: {c!r:.120}")
    if (
        type(req_ids) is not list
        or type(sizes) is not list
        or len(req_ids) != len(sizes)
        or any(type(r) is not str for r in req_ids)
        or any(type(n) is not int or n < 0 or n % BLOCK for n in sizes)
        or type(parts) is not list
        or len(parts) != len(req_ids)
        or any(type(k) is not int or not 0 <= k <= MAX_PARTS for k in parts)
    ):
        raise FrameError(
            f"control part: req_ids must be strings, one size and one part count each, sizes non-negative "
            f"multiples of {BLOCK}, part counts 0..{MAX_PARTS}: {c!r:.120}"
        )
    count = len(req_ids)
    wrong = {"data": not 1 <= count <= MAX_BATCH, "abort": count != 1 or any(sizes) or any(parts),
             "hello": count != 0}
    if wrong[kind]:
        raise FrameError(
            f"control part: a {kind} message cannot name {count} request(s) of sizes {sizes!r:.60}, parts {parts!r:.60}"
        )
    return Control(kind, gen, tuple(req_ids), tuple(sizes), tuple(parts))
