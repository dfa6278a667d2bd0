"""What the scheduler hands the runner for one step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from pd_ssm.engine.request import Request


class ScheduledSeq(NamedTuple):
    request: Request
    num_new_tokens: int  # tokens fed this step, from request.num_computed_tokens on


@dataclass(slots=True)
class SchedulerOutput:
    decodes: list[ScheduledSeq] = field(default_factory=list)  # one token each, first in the batch
    prefills: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def seqs(self) -> list[ScheduledSeq]:
        return self.decodes + self.prefills

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills
