"""The prefill role's back-pressure: at most `max_unsent` live requests without a decode worker's
ticket; later PrefillRequests wait outside the engine, one whose ticket comes goes in at once, an
abort drops a waiting one, and every request still ends with LLM.generate's tokens.

Real engines and a real ZmqConnector on loopback, no router: the test plays the router (it forwards
tickets when it chooses, as the router does when a decode worker has room).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pd_ssm import LLM, SamplingParams
from pd_ssm.control.disagg_messages import (
    ForwardTicket,
    PrefillRequest,
    ReserveReply,
    ReserveRequest,
    TransferReport,
)
from pd_ssm.control.messages import AbortRequest
from pd_ssm.prefill_worker.role import PrefillRole
from pd_ssm.state_transfer.zmq_connector import ZmqConfig, ZmqConnector
from pd_ssm.worker.engine_worker import delta_from_output
from tests.decode_worker.test_disagg_roles import TOKEN, _clean, _decode_role, _engine


def test_max_unsent_defers_admits_ticketed_first_and_keeps_the_tokens(model_dir: Path) -> None:
    rng = random.Random()
    n = rng.randint(2, 6)
    prompts = [[rng.randrange(3, 259) for _ in range(rng.randint(3, 40))] for _ in range(6)]
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    want = {f"r{i}": o.outputs[0].token_ids for i, o in enumerate(
        LLM(model=str(model_dir), max_num_seqs=8, num_kv_blocks=64, block_size=16).generate(prompts, params))}
    to_router: list[Any] = []
    prefill = PrefillRole(_engine(model_dir, 8), ZmqConnector(ZmqConfig(TOKEN)), "p0", max_unsent=2)
    decode = _decode_role(_engine(model_dir, 8), ttl=30.0)
    prefill.start(to_router.append)
    decode.start(to_router.append)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}

    def turn() -> None:
        for role in (prefill, decode):
            role.progress()
            if role.engine.has_unfinished():
                for out in role.engine.step():
                    tokens[out.request_id] += delta_from_output(out).token_ids

    def until(cond: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + 20
        while not cond():
            assert time.monotonic() < deadline, what
            turn()

    def forward(req_id: str) -> None:  # the router: D reserves, its ticket goes to P
        decode.handle(ReserveRequest(req_id, "p0", len(prompts[int(req_id[1:])]) + n))
        (reply,) = [m for m in to_router if isinstance(m, ReserveReply) and m.req_id == req_id]
        assert reply.ticket is not None
        prefill.handle(ForwardTicket(reply.ticket, "d0"))

    try:
        for i, prompt in enumerate(prompts):
            prefill.handle(PrefillRequest(f"r{i}", prompt, params))
        # two in the engine, four held back (a few hundred bytes each, on the host)
        assert set(prefill.engine.requests) == {"r0", "r1"} and list(prefill.deferred) == ["r2", "r3", "r4", "r5"]
        assert prefill.queued == 4
        prefill.handle(PrefillRequest("r3", prompts[3], params))  # a second one of that id is refused
        (refusal,) = [m for m in to_router if not isinstance(m, ReserveReply)]
        assert refusal.deltas[0].req_id == "r3" and "already here" in refusal.deltas[0].error
        to_router.clear()
        until(lambda: not prefill.engine.has_unfinished(), "r0, r1 prefilled")
        assert prefill.sink.num_waiting == 2 and len(prefill.deferred) == 4  # no ticket: nothing more goes in

        # a ticket for a held-back request lets it in at once, past the cap; an abort drops one
        forward("r4")
        assert "r4" in prefill.engine.requests and "r4" not in prefill.deferred
        prefill.handle(AbortRequest("r3"))
        assert list(prefill.deferred) == ["r2", "r5"]
        until(lambda: any(isinstance(m, TransferReport) and m.req_id == "r4" for m in to_router), "r4 shipped")
        assert list(prefill.deferred) == ["r2", "r5"]  # r4 had a ticket: it took no ticketless place

        # r0's pages leave: one ticketless place frees, r2 goes in (in arrival order), r5 still waits
        forward("r0")
        until(lambda: "r2" not in prefill.deferred, "r2 admitted")
        assert list(prefill.deferred) == ["r5"]
        forward("r1")
        until(lambda: not prefill.deferred, "r5 admitted")
        forward("r2")
        forward("r5")
        done = [f"r{i}" for i in range(6) if i != 3]
        until(lambda: all(len(tokens[r]) == n for r in done), "every request decoded")
        assert {r: tokens[r] for r in done} == {r: want[r] for r in done}
        assert tokens["r3"] == []  # aborted while held back: never prefilled
        while prefill.pending():
            prefill.progress()
        reports = [m for m in to_router if isinstance(m, TransferReport)]
        assert all(r.ok for r in reports)
        assert sorted(r.req_id for r in reports if r.role == "prefill") == sorted(done)
        assert _clean(prefill.engine) and _clean(decode.engine)
        assert not prefill.live and not prefill.ticketed and not prefill.deferred and prefill.transfers == 0
    finally:
        prefill.close()
        decode.close()


def test_max_unsent_must_be_positive(model_dir: Path) -> None:
    connector = ZmqConnector(ZmqConfig(TOKEN))
    try:
        with pytest.raises(ValueError, match="max_unsent"):
            PrefillRole(_engine(model_dir, 2), connector, "p0", max_unsent=0)
    finally:
        connector.close()
