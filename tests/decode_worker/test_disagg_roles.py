"""The prefill and decode roles in one process, over a real ZmqConnector on loopback (no router).

Reservations never over-commit (a full pool refuses), abort and expiry give the slot back, and a
request prefilled by the prefill role and decoded by the decode role yields LLM.generate's tokens.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
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
from pd_ssm.control.messages import AbortRequest, StepOutputs
from pd_ssm.decode_worker.receivers import Receiver, Receivers
from pd_ssm.decode_worker.role import DecodeRole
from pd_ssm.engine.engine import Engine
from pd_ssm.prefill_worker.role import PrefillRole
from pd_ssm.state_transfer.reservations import ReservationTable
from pd_ssm.state_transfer.zmq_connector import ZmqConfig, ZmqConnector
from pd_ssm.worker.engine_worker import delta_from_output

TOKEN = "test-token"


def _engine(model_dir: Path, slots: int) -> Engine:
    return LLM(model=str(model_dir), max_num_seqs=slots, num_kv_blocks=64, block_size=16).engine


def _decode_role(engine: Engine, ttl: float) -> DecodeRole:
    def make(table: ReservationTable) -> Receiver:
        c = ZmqConnector(ZmqConfig(TOKEN), bind="tcp://127.0.0.1:0", reservations=table)
        assert c.address is not None
        return Receiver(c, c.address, "")

    return DecodeRole(engine, Receivers(make, ReservationTable(ttl, TOKEN), per_prefill=False), "d0")


@pytest.fixture
def sent() -> list[Any]:
    return []


@pytest.fixture
def decode(model_dir: Path, sent: list[Any]) -> Iterator[DecodeRole]:
    role = _decode_role(_engine(model_dir, 2), ttl=0.3)
    role.start(sent.append)
    yield role
    role.close()


def _clean(engine: Engine) -> bool:
    c = engine.cache
    c.check()
    return c.num_used_slots == 0 and c.num_used_blocks == 0 and not engine.reserved


def test_full_pool_refuses_abort_and_expiry_give_back(decode: DecodeRole, sent: list[Any]) -> None:
    rng = random.Random()
    cache = decode.engine.cache
    for rid in ("a", "b", "c"):
        decode.handle(ReserveRequest(rid, "p0", rng.randint(1, 300)))
    replies = [m for m in sent if isinstance(m, ReserveReply)]
    assert [r.ticket is not None for r in replies] == [True, True, False]  # 2 slots: the third is refused
    assert replies[2].reason and cache.num_used_slots == 2 and cache.num_free_slots == 0
    assert {r.ticket.slot for r in replies[:2] if r.ticket} == {cache.slot("a"), cache.slot("b")}
    assert decode.handle(AbortRequest("a")) and decode.reserved == 1 and cache.num_free_slots == 1
    assert not decode.handle(AbortRequest("unknown"))  # not reserved here: the loop's engine abort (a no-op)
    sent.clear()
    time.sleep(0.35)  # b's reservation lapses: nothing came
    assert decode.progress()
    (report,) = [m for m in sent if isinstance(m, TransferReport)]
    assert report.req_id == "b" and not report.ok and "reservation" in report.error
    assert _clean(decode.engine) and len(decode.table) == 0 and not decode.pending()


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_prefill_role_to_decode_role_equals_llm_generate(model_dir: Path, sampling: str) -> None:
    rng = random.Random()
    prompts = [[rng.randrange(3, 259) for _ in range(rng.randint(3, 60))] for _ in range(rng.randint(2, 4))]
    n = rng.randint(2, 12)
    params = (SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) if sampling == "greedy" else
              SamplingParams(temperature=0.9, top_k=40, seed=rng.randrange(1 << 30), max_tokens=n, ignore_eos=True))
    want = [o.outputs[0].token_ids for o in _engine_llm(model_dir).generate(prompts, params)]
    to_router: list[Any] = []
    prefill = PrefillRole(_engine(model_dir, 4), ZmqConnector(ZmqConfig(TOKEN)), "p0")
    decode = _decode_role(_engine(model_dir, 4), ttl=30.0)
    prefill.start(to_router.append)
    decode.start(to_router.append)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    try:
        for i, prompt in enumerate(prompts):
            prefill.handle(PrefillRequest(f"r{i}", prompt, params))
            decode.handle(ReserveRequest(f"r{i}", "p0", len(prompt) + n))
        for reply in [m for m in to_router if isinstance(m, ReserveReply)]:
            assert reply.ticket is not None
            prefill.handle(ForwardTicket(reply.ticket, "d0"))
        deadline = time.monotonic() + 20
        while not all(len(t) == n for t in tokens.values()):
            assert time.monotonic() < deadline, tokens
            for role in (prefill, decode):
                role.progress()
                if role.engine.has_unfinished():
                    for out in role.engine.step():
                        tokens[out.request_id] += delta_from_output(out).token_ids
        assert [tokens[f"r{i}"] for i in range(len(prompts))] == want
        reports = [m for m in to_router if isinstance(m, TransferReport)]
        assert all(r.ok for r in reports) and not any(isinstance(m, StepOutputs) for m in to_router)
        while prefill.pending():
            prefill.progress()
        assert sorted(r.req_id for r in to_router if isinstance(r, TransferReport) and r.role == "prefill") == \
            sorted(tokens)
        assert _clean(prefill.engine) and _clean(decode.engine) and prefill.transfers == 0
    finally:
        prefill.close()
        decode.close()


def _engine_llm(model_dir: Path) -> LLM:
    return LLM(model=str(model_dir), max_num_seqs=4, num_kv_blocks=64, block_size=16)
