"""TransferLedger: what a connector has to report, kept apart from how it moves bytes.

Both connectors compose one: finished (sent / received) ids, failures with their reasons and
kinds (base.FailureKind) and per-request TransferStats, each handed out once by the `take_*`
calls (the Connector contract's "since the last call"), plus the ids aborted recently, so late
frames of an aborted request are dropped rather than delivered.  Pure Python, no sockets.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

from pd_ssm.state_transfer.base import FailureKind, TransferFailure, TransferStats


class TransferLedger:
    def __init__(self, max_aborted: int = 1 << 16) -> None:
        self.max_aborted = max_aborted  # NOTE: request ids are unique; this bounds memory only
        self._aborted: OrderedDict[str, None] = OrderedDict()
        self._sent: set[str] = set()
        self._received: set[str] = set()
        self._failed: dict[str, TransferFailure] = {}
        self._stats: dict[str, TransferStats] = {}
        self._anon = itertools.count()

    def sent(self, stats: TransferStats) -> None:
        if stats.req_id not in self._aborted:
            self._sent.add(stats.req_id)
            self._stats[stats.req_id] = stats

    def received(self, stats: TransferStats) -> None:
        self._received.add(stats.req_id)
        self._stats[stats.req_id] = stats

    def fail(self, req_id: str, reason: str, kind: FailureKind = FailureKind.ERROR) -> None:
        self._failed[req_id] = TransferFailure(reason, kind)

    def fail_anonymous(self, kind: str, reason: str) -> None:
        """A failure that names no trustworthy request (wrong token, unreadable header): keyed
        `!kind-n`, so a bad peer can never fail or cancel a real request."""
        self._failed[f"!{kind}-{next(self._anon)}"] = TransferFailure(reason)

    def is_aborted(self, req_id: str) -> bool:
        return req_id in self._aborted

    def forget_abort(self, req_id: str) -> None:
        """A request id sent again is a new transfer."""
        self._aborted.pop(req_id, None)

    def abort(self, req_id: str) -> None:
        self._aborted[req_id] = None
        while len(self._aborted) > self.max_aborted:
            self._aborted.popitem(last=False)
        self._sent.discard(req_id)
        self._received.discard(req_id)
        self._failed.pop(req_id, None)

    def take_finished(self) -> tuple[set[str], set[str]]:
        sent, received = self._sent, self._received
        self._sent, self._received = set(), set()
        return sent, received

    def take_failed(self) -> dict[str, str]:
        """`take_failures` with the reasons only."""
        return {req_id: f.reason for req_id, f in self.take_failures().items()}

    def take_failures(self) -> dict[str, TransferFailure]:
        failed, self._failed = self._failed, {}
        return failed

    def take_stats(self) -> dict[str, TransferStats]:
        stats, self._stats = self._stats, {}
        return stats
