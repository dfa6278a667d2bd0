"""WorkerRole: what turns the colocated EngineWorker loop into a prefill or a decode worker.

Roles by composition (DESIGN.md): the loop (engine_worker.py) drains commands, steps the engine
and sends its token deltas whatever the role; a role adds the commands of its half of the
disaggregated path and the transfers beside the engine.  No role: colocated.

Contract, all calls on the loop's one thread:
- `start(send)` once before the loop; `send` queues a message to the router.
- `handle(msg)` for every command; True when the role consumed it (the loop then ignores it).
  A role sees AbortRequest before the loop does: it releases what it holds of the request.
- `progress()` once per loop iteration: move transfers on; True when pages were freed or taken
  (the loop then sends a LoadReport at once, so the router's view of the pools stays current).
- `pending()`: transfers are in flight, so the loop must not sleep on its command socket.
- `reserved` / `transfers` / `queued`: counts for the LoadReport (`queued`: requests the role
  holds back from the engine, counted as waiting).
- `delta(out)`: the TokenDelta of one step output (the role decides what text it carries).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from pd_ssm.control.messages import TokenDelta
from pd_ssm.outputs import RequestOutput


class WorkerRole(Protocol):
    name: str  # what the worker's hello says: "prefill" | "decode"

    def start(self, send: Callable[[Any], None]) -> None: ...

    def handle(self, msg: Any) -> bool: ...

    def progress(self) -> bool: ...

    def pending(self) -> bool: ...

    @property
    def reserved(self) -> int: ...

    @property
    def transfers(self) -> int: ...

    @property
    def queued(self) -> int: ...

    def delta(self, out: RequestOutput) -> TokenDelta: ...

    def close(self) -> None: ...
